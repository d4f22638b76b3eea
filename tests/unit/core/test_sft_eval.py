"""SFT loop and greedy evaluation on tiny random-init models."""
from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest
import torch

from core.evaluate import evaluate, greedy_generate, load_model
from core.sft import _collate, completion_loss, encode_example, encode_prompt, sft
from core.tiny import build_tiny_model
from core.toy_tasks import make_dataset, reward_rotate, reward_reverse, sft_rows


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0,
                                num_layers=1, intermediate_size=128))


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_model(tiny_dir)


def test_encode_example_masks_only_completion(tiny):
    _, tok = tiny
    p, c = encode_example(tok, [{"role": "user", "content": "What is 1 + 2?"}],
                          [{"role": "assistant", "content": "3"}])
    full = tok.apply_chat_template(
        [{"role": "user", "content": "What is 1 + 2?"}, {"role": "assistant", "content": "3"}],
        tokenize=True)["input_ids"]
    assert p + c == full[:len(p) + len(c)]  # same tokens as the chat template renders
    assert c[-1] == tok.eos_token_id and tok.decode(c[:-1]) == "3"
    ids_BT, mask_BT, labels_BT = _collate([(p, c), (p[:-2], c)], tok.pad_token_id)
    assert labels_BT[0].tolist() == [-100] * len(p) + c
    assert mask_BT[1].sum() == len(p) - 2 + len(c)
    assert (labels_BT[1, len(p) - 2 + len(c):] == -100).all()


def test_completion_loss_matches_full_logits(tiny):
    model, tok = tiny
    ds = sft_rows("reverse", "train", 4)
    ex = [encode_example(tok, p, c) for p, c in zip(ds["prompt"], ds["completion"])]
    ids_BT, mask_BT, labels_BT = _collate(ex, tok.pad_token_id)
    with torch.no_grad():
        fast = completion_loss(model, ids_BT, mask_BT, labels_BT)
        logits = model(input_ids=ids_BT, attention_mask=mask_BT).logits
        ref = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.size(-1)), labels_BT[:, 1:].reshape(-1), ignore_index=-100)
    torch.testing.assert_close(fast, ref)


def test_sft_lowers_loss_and_saves_checkpoint(tiny_dir, tmp_path):
    ds = sft_rows("rotate", "train", 64, seed=0)
    out = sft(tiny_dir, ds, str(tmp_path / "sft"), steps=12, lr=3e-3, batch_size=16, warmup=2,
              progress=False)
    assert out == str(tmp_path / "sft")
    log = json.loads((tmp_path / "sft" / "sft_log.json").read_text())
    assert len(log["losses"]) == 12

    def loss_of(path):
        model, tok = load_model(path)
        ex = [encode_example(tok, p, c) for p, c in zip(ds["prompt"], ds["completion"])]
        with torch.no_grad():
            return completion_loss(model, *_collate(ex, tok.pad_token_id)).item()

    before, after = loss_of(tiny_dir), loss_of(out)
    assert after < before - 0.5, (before, after)
    # deterministic given the seed
    again = sft(tiny_dir, ds, str(tmp_path / "again"), steps=12, lr=3e-3, batch_size=16, warmup=2,
                progress=False)
    assert json.loads((tmp_path / "again" / "sft_log.json").read_text())["losses"] == log["losses"]
    assert loss_of(again) == pytest.approx(after, abs=1e-6)


def test_sft_bf16_autocast_tracks_fp32(tiny_dir, tmp_path):
    """precision=bf16 autocasts the step (the losses differ from fp32's in the low digits, so it
    is on) and trains the same run (within 2% per step); the log records it."""
    ds = sft_rows("rotate", "train", 64, seed=0)
    logs = {}
    for prec in ("fp32", "bf16"):
        sft(tiny_dir, ds, str(tmp_path / prec), steps=6, lr=3e-3, batch_size=16, progress=False, precision=prec)
        logs[prec] = json.loads((tmp_path / prec / "sft_log.json").read_text())
    assert logs["bf16"]["precision"] == "bf16"
    assert logs["bf16"]["losses"] != logs["fp32"]["losses"]
    assert logs["bf16"]["losses"] == pytest.approx(logs["fp32"]["losses"], rel=0.02)
    with pytest.raises(ValueError, match="precision"):
        sft(tiny_dir, ds, str(tmp_path / "x"), steps=1, lr=1e-3, batch_size=2, progress=False, precision="fp16")


def test_sft_rejects_bad_data(tiny_dir, tmp_path):
    with pytest.raises(ValueError, match="completion"):
        sft(tiny_dir, make_dataset("rotate", "train", 4), str(tmp_path / "x"), steps=1, lr=1e-3,
            batch_size=2, progress=False)
    assert not (tmp_path / "x").exists()


def test_greedy_generate_deterministic_and_batch_independent(tiny):
    model, tok = tiny
    prompts = list(make_dataset("reverse", "test", 12)["prompt"]) + list(make_dataset("rotate", "test", 12)["prompt"])
    a = greedy_generate(model, tok, prompts, max_new_tokens=6, batch_size=24)
    assert len(a) == 24 and all(isinstance(x, str) for x in a)
    assert greedy_generate(model, tok, prompts, max_new_tokens=6, batch_size=24) == a
    assert greedy_generate(model, tok, prompts, max_new_tokens=6, batch_size=5) == a
    assert greedy_generate(model, tok, prompts, max_new_tokens=6, batch_size=1) == a
    assert not model.training


def test_greedy_generate_matches_hf_generate(tiny):
    model, tok = tiny
    prompts = make_dataset("rotate", "test", 3)["prompt"]
    ours = greedy_generate(model, tok, prompts, max_new_tokens=8, batch_size=3)
    for prompt, text in zip(prompts, ours):
        ids = torch.tensor([encode_prompt(tok, prompt)])
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                             do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        assert text == tok.decode(ref[0, ids.shape[1]:], skip_special_tokens=True)


class _Scripted(torch.nn.Module):
    """A fake causal LM that emits a fixed token script per prompt length, then EOS."""

    def __init__(self, vocab, scripts):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.vocab, self.scripts = vocab, scripts

    def forward(self, input_ids, attention_mask, position_ids, past_key_values=None, use_cache=True):
        from types import SimpleNamespace

        B = input_ids.shape[0]
        # The "cache" remembers each row's prompt length (its script) and how many tokens it made.
        if past_key_values is None:
            past_key_values = [(n, 0) for n in attention_mask.sum(-1).tolist()]
        logits = torch.zeros(B, input_ids.shape[1], self.vocab)
        for i, (key, step) in enumerate(past_key_values):
            script = self.scripts[key]
            logits[i, -1, script[min(step, len(script) - 1)]] = 1.0
        return SimpleNamespace(logits=logits, past_key_values=[(k, s + 1) for k, s in past_key_values])


def test_greedy_generate_stops_at_eos_per_row(tiny):
    _, tok = tiny
    eos = tok.eos_token_id
    one, two = tok.encode("1", add_special_tokens=False)[0], tok.encode("2", add_special_tokens=False)[0]
    p_short = [{"role": "user", "content": "a"}]
    p_long = [{"role": "user", "content": "a b c d e"}]
    n_short, n_long = len(encode_prompt(tok, p_short)), len(encode_prompt(tok, p_long))
    fake = _Scripted(len(tok), {n_short: [one, eos, two, two], n_long: [two, two, two, eos]})
    out = greedy_generate(fake, tok, [p_short, p_long], max_new_tokens=10)
    assert out == ["1", "222"]
    assert greedy_generate(fake, tok, [p_long], max_new_tokens=2) == ["22"]  # cut at the limit


def test_evaluate_from_path_and_model(tiny_dir, tiny):
    model, tok = tiny
    ds = make_dataset("rotate", "test", 8)
    score = evaluate(tiny_dir, ds, reward_rotate, max_new_tokens=4, batch_size=4)
    assert 0.0 <= score <= 1.0
    assert evaluate(model, ds, reward_rotate, max_new_tokens=4, tokenizer=tok) == score
    mean, comps, scores = evaluate(model, ds, reward_rotate, max_new_tokens=4, tokenizer=tok,
                                   return_completions=True)
    assert mean == score and len(comps) == len(scores) == 8


def test_evaluate_scores_gold_model_perfectly(tiny, monkeypatch):
    """evaluate passes the dataset columns to the reward and averages its scores."""
    model, tok = tiny
    ds = make_dataset("reverse", "test", 6)
    answers = list(ds["answer"])
    import core.evaluate as ev

    monkeypatch.setattr(ev, "greedy_generate", lambda *a, **k: answers[:3] + ["wrong"] * 3)
    assert ev.evaluate(model, ds, reward_reverse, max_new_tokens=4, tokenizer=tok) == 0.5


def test_evaluate_refuses_other_domain_rows(tiny):
    model, tok = tiny
    ds = datasets.concatenate_datasets([make_dataset("rotate", "test", 2), make_dataset("reverse", "test", 2)])
    with pytest.raises(ValueError, match="reward_rotate returned None"):
        evaluate(model, ds, reward_rotate, max_new_tokens=2, tokenizer=tok)


def test_sft_with_qat_saves_weights_on_the_int4_grid(tiny_dir, tmp_path):
    """QAT from SFT onward: the saved Linear weights are the fake-quantized values the
    training forward used, so each group of 32 holds at most 16 distinct values (int4
    codes times one scale); lm_head (ignored by default) stays full precision."""
    from safetensors.torch import load_file

    from core.quant import QuantConfig

    q = QuantConfig(enabled=True, group_size=32)
    out = sft(tiny_dir, sft_rows("rotate", "train", 32, seed=0), str(tmp_path / "qat"), steps=3, lr=3e-3,
              batch_size=8, progress=False, quant=q)
    sd = load_file(str(Path(out) / "model.safetensors"))
    lin = [k for k in sd if k.endswith("proj.weight")]
    assert lin
    def max_distinct(w):
        return max(len(torch.unique(g)) for g in w.reshape(-1, 32))
    for k in lin:
        assert max_distinct(sd[k]) <= 16, k
    assert max_distinct(sd["lm_head.weight"]) > 16
    assert json.loads((Path(out) / "sft_log.json").read_text())["quant"]["group_size"] == 32

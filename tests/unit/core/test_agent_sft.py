"""core.agent.sft: supervised training on agent transcripts. Labels only on the tokens the
assistant wrote (observations, prompt and padding are -100), and a few steps on a tiny
model lower the loss."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from core.agent.sft import labelled_batch, lr_lambda, masked_batch, train_on_transcripts
from core.agent.transcript import encode_segments, encode_transcript
from core.sft import completion_loss
from core.tiny import build_tiny_model

PAD = 3


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("agent_sft") / "m", seed=0, max_position_embeddings=1536)


def _model(model_dir):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)


@pytest.fixture(scope="module")
def oracle_rows(tok):
    """Oracle transcripts of the agent domain (json_plain), as encode_segments lays them out."""
    from experts.agent.data import make_dataset, oracle_messages
    from rewards.agent import harness_config, make_env

    hc = harness_config("json_plain")
    rows = []
    for t in make_dataset("train", 6, seed=0, difficulty=2)["task"]:
        task = json.loads(t)
        env = make_env(hc)
        env.reset(task)
        rows += encode_segments(tok, env.messages[:1] + oracle_messages(task, hc), env.harness.apply_context)
    return rows


MSGS = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Add 2 and 3."},
        {"role": "assistant", "content": "add(a=2, b=3)"}, {"role": "tool", "content": "5"},
        {"role": "assistant", "content": "The sum is 5."}]


def test_labelled_batch_labels_only_the_assistant_tokens(tok):
    short = encode_transcript(tok, MSGS[:3])
    full = encode_transcript(tok, MSGS)
    ids, attn, labels = labelled_batch([full, short], PAD)
    assert ids.shape == labels.shape == attn.shape and ids.shape[1] == len(full[0]) + len(full[1])
    for i, (p, c, m) in enumerate([full, short]):
        n = len(p) + len(c)
        assert ids[i, :n].tolist() == p + c and attn[i].tolist() == [1] * n + [0] * (ids.shape[1] - n)
        assert ids[i, n:].eq(PAD).all()
        want = [-100] * len(p) + [t if k else -100 for t, k in zip(c, m)] + [-100] * (ids.shape[1] - n)
        assert labels[i].tolist() == want
    # what carries a label is exactly the assistant text + EOS
    kept = labels[0][labels[0] != -100].tolist()
    eos = tok.convert_ids_to_tokens(tok.eos_token_id)
    assert tok.decode(kept, skip_special_tokens=False) == f"add(a=2, b=3){eos}The sum is 5.{eos}"


def test_labelled_batch_rejects_a_mask_of_the_wrong_length(tok):
    p, c, m = encode_transcript(tok, MSGS)
    for bad in (m[:-1], [1]):   # [1] would broadcast silently
        with pytest.raises(ValueError, match="loss-mask entries"):
            labelled_batch([(p, c, bad)], PAD)
        with pytest.raises(ValueError, match="loss-mask entries"):
            masked_batch([(p, c, bad)], PAD)


def test_masked_batch_mask_is_the_loss_mask(tok):
    full = encode_transcript(tok, MSGS)
    b = masked_batch([full], PAD)
    assert b["mask"][0].tolist() == [float(x) for x in full[2]]
    assert 0 < b["mask"].sum() < len(full[1])


def test_loss_is_cross_entropy_on_assistant_tokens_only(tok, model_dir):
    model = _model(model_dir).eval()
    p, c, m = encode_transcript(tok, MSGS)
    with torch.no_grad():
        got = completion_loss(model, *labelled_batch([(p, c, m)], PAD))
        logits = model(input_ids=torch.tensor([p + c])).logits[0]
    pos = [len(p) + t for t in range(len(c)) if m[t]]          # input positions of assistant tokens
    want = F.cross_entropy(logits[[q - 1 for q in pos]], torch.tensor([(p + c)[q] for q in pos]))
    assert got.item() == pytest.approx(want.item(), abs=1e-5)
    # every completion token counted would be a different number
    every = F.cross_entropy(logits[len(p) - 1:len(p) + len(c) - 1], torch.tensor(c))
    assert abs(every.item() - want.item()) > 1e-3


def test_observation_tokens_have_no_effect_on_the_loss(tok, model_dir):
    """A trailing observation (its tokens predict nothing later) changes nothing when its
    tokens change; an assistant token does."""
    model = _model(model_dir).eval()
    p, c, m = encode_transcript(tok, MSGS[:3])
    obs = [t for t in tok.encode("\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n")]
    row = (p, c + obs, m + [0] * len(obs))
    other = (p, c + [(t * 7 + 11) % 2000 + 4 for t in obs], m + [0] * len(obs))
    with torch.no_grad():
        base = completion_loss(model, *labelled_batch([row], PAD)).item()
        changed_obs = completion_loss(model, *labelled_batch([other], PAD)).item()
        bad = list(c)
        bad[1] = (bad[1] + 1) % 2000 + 4
        changed_asst = completion_loss(model, *labelled_batch([(p, bad + obs, row[2])], PAD)).item()
    assert changed_obs == pytest.approx(base, abs=1e-6)
    assert abs(changed_asst - base) > 1e-4


def test_train_on_transcripts_lowers_the_loss(model_dir, oracle_rows):
    assert len(oracle_rows) >= 6 and all(0 < sum(m) < len(c) for _, c, m in oracle_rows)
    model = _model(model_dir)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    logged = []
    losses = train_on_transcripts(model, oracle_rows, pad_id=PAD, steps=12, lr=1e-2, batch_size=3, seed=0,
                                  log=lambda s, m: logged.append((s, m)), log_every=6)
    assert len(losses) == 12 and all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3, losses
    assert [s for s, _ in logged] == [6, 12] and set(logged[0][1]) == {"loss", "grad_norm", "lr"}
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    with torch.no_grad():   # the rows' loss itself went down, not only the logged batches'
        model.eval()
        after = completion_loss(model, *labelled_batch(oracle_rows, PAD)).item()
        fresh = completion_loss(_model(model_dir).eval(), *labelled_batch(oracle_rows, PAD)).item()
    assert after < fresh


def test_train_on_transcripts_is_seeded_and_accumulates(model_dir, oracle_rows):
    a = train_on_transcripts(_model(model_dir), oracle_rows, pad_id=PAD, steps=2, lr=1e-3, batch_size=2, seed=1,
                             log_every=100)
    b = train_on_transcripts(_model(model_dir), oracle_rows, pad_id=PAD, steps=2, lr=1e-3, batch_size=2, seed=1,
                             log_every=100)
    c = train_on_transcripts(_model(model_dir), oracle_rows, pad_id=PAD, steps=2, lr=1e-3, batch_size=1,
                             grad_accum=2, seed=1, log_every=100)
    assert a == b
    assert c[0] == pytest.approx(a[0], rel=0.1)   # two half-batches: about the same mean loss
    with pytest.raises(ValueError, match="no training rows"):
        train_on_transcripts(_model(model_dir), [], pad_id=PAD, steps=1, lr=1e-3, batch_size=1)


def test_lr_lambda():
    f = lr_lambda(10, 2, "cosine")
    assert [f(0), f(1)] == [0.5, 1.0] and f(2) == pytest.approx(1.0) and f(10) == pytest.approx(0.0, abs=1e-9)
    g = lr_lambda(10, 0, "linear")
    assert g(0) == 1.0 and g(5) == pytest.approx(0.5)
    assert lr_lambda(10, 0, "constant")(7) == 1.0
    with pytest.raises(ValueError, match="lr schedule"):
        lr_lambda(10, 0, "step")


# ----------------------------------------------------------------------------- core.sft token rows
def _sft_losses(model_dir, ds, out, **kw):
    from core.sft import sft

    sft(str(model_dir), ds, str(out), progress=False, **kw)
    return json.loads((out / "sft_log.json").read_text())["losses"]


CHAT = [([{"role": "user", "content": f"Add {a} and {b}."}], [{"role": "assistant", "content": f"{a + b}"}])
        for a, b in [(2, 3), (10, 7), (41, 1), (5, 5)]]


def test_sft_token_rows_with_mask_all_one_train_like_the_chat_form(tok, model_dir, tmp_path):
    import datasets

    from core.sft import encode_example

    chat = datasets.Dataset.from_dict({"prompt": [p for p, _ in CHAT], "completion": [c for _, c in CHAT]})
    enc = [encode_example(tok, p, c) for p, c in CHAT]
    rows = datasets.Dataset.from_dict({"prompt_ids": [p for p, _ in enc], "completion_ids": [c for _, c in enc],
                                       "loss_mask": [[1] * len(c) for _, c in enc]})
    kw = dict(steps=4, lr=1e-2, batch_size=2, seed=0)
    a = _sft_losses(model_dir, chat, tmp_path / "chat", **kw)
    b = _sft_losses(model_dir, rows, tmp_path / "rows", **kw)
    assert len(a) == 4 and a == b
    # without a loss_mask column the token rows train the same way too
    c = _sft_losses(model_dir, rows.remove_columns(["loss_mask"]), tmp_path / "nomask", **kw)
    assert c == a


def test_sft_token_rows_apply_the_loss_mask(tok, model_dir, tmp_path):
    import datasets

    rows = [encode_transcript(tok, MSGS), encode_transcript(tok, MSGS[:3])]
    ds = datasets.Dataset.from_dict({"prompt_ids": [r[0] for r in rows], "completion_ids": [r[1] for r in rows],
                                     "loss_mask": [r[2] for r in rows]})
    losses = _sft_losses(model_dir, ds, tmp_path / "masked", steps=6, lr=1e-2, batch_size=2, seed=0)
    with torch.no_grad():   # step 0's loss is the start model's, on the assistant tokens only
        want = completion_loss(_model(model_dir).eval(), *labelled_batch(rows, PAD)).item()
    assert losses[0] == pytest.approx(want, abs=1e-4)
    assert losses[-1] < losses[0]
    trained = AutoModelForCausalLM.from_pretrained(str(tmp_path / "masked"), dtype=torch.float32)
    assert any(not torch.equal(x, y) for x, y in zip(trained.parameters(), _model(model_dir).parameters()))


def test_sft_token_rows_errors(tok, model_dir, tmp_path):
    import datasets

    p, c, m = encode_transcript(tok, MSGS)
    bad = datasets.Dataset.from_dict({"prompt_ids": [p], "completion_ids": [c], "loss_mask": [m[:-1]]})
    with pytest.raises(ValueError, match="loss-mask entries"):
        _sft_losses(model_dir, bad, tmp_path / "bad", steps=1, lr=1e-3, batch_size=1)
    none = datasets.Dataset.from_dict({"prompt_ids": [p], "completion_ids": [c], "loss_mask": [[0] * len(c)]})
    with pytest.raises(ValueError, match="empty completion"):
        _sft_losses(model_dir, none, tmp_path / "none", steps=1, lr=1e-3, batch_size=1)
    no_prompt = datasets.Dataset.from_dict({"completion_ids": [c]})
    with pytest.raises(ValueError, match="prompt_ids"):
        _sft_losses(model_dir, no_prompt, tmp_path / "np", steps=1, lr=1e-3, batch_size=1)

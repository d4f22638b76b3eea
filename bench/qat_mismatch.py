"""Sampler/trainer log-prob mismatch with and without INT4 QAT.

    python -m bench.qat_mismatch --out runs/bench_qat [--model PATH] [--group-size 128]

MOPD's importance weights and reverse-KL reward compare log p from the vLLM sampler with
log p from the trainer; any gap between the two that is not policy change is noise (or
bias) in the update. This measures mean |Δ log p| (sampler − trainer) on one trained tiny
model and one fixed set of sampled tokens, with ONE vLLM engine into which three weight
sets are synced in turn:

- ``bf16_floor``: both unquantized. What remains is the engines' numerical floor
  (different kernels, same bf16 weights).
- ``qat_identical``: trainer = ``apply_qat`` model, sampler = its synced
  ``quantized_state_dict`` (what `mopd.distill` does). Should sit on the floor.
- ``sampler_only_quant``: the quantized sampler against the unquantized trainer
  (quantizing only for serving / sampling). Should be far above it.

Headline numbers score the fixed tokens with the engine's ``prompt_logprobs`` (prefill),
so all three settings see exactly the same tokens. ``generation_path`` repeats the three
with the log-probs vLLM returns while generating (decode path, what the MOPD loop uses);
there the quantized sampler samples its own tokens from the same seeds, so (b)/(c) use
other tokens than (a).

Without --model a tiny Qwen2 is built and trained for a few hundred SFT steps on the toy
pretraining chat data (`core.sft.sft`), so the weights are not random-init; it is kept in
OUT/model and reused by later runs with the same OUT. Writes OUT/qat_mismatch.json and
prints a table.
"""
from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def build_trained_model(out: Path, steps: int, seed: int = 0) -> tuple[Path, dict]:
    """Tiny Qwen2 + `steps` SFT steps on generic chat data (reused if already there)."""
    from core.sft import sft
    from core.tiny import build_tiny_model
    from core.toy_tasks import TOY_DEFAULTS, make_pretrain_dataset

    trained = out / "model" / "trained"
    log = trained / "sft_log.json"
    if log.exists() and json.loads(log.read_text()).get("steps") == steps:
        return trained, json.loads(log.read_text())
    init = build_tiny_model(out / "model" / "init", seed=seed, **TOY_DEFAULTS["model"])
    sft(str(init), make_pretrain_dataset(8000, seed=seed), str(trained), steps=steps, lr=3e-3,
        batch_size=32, seed=seed, warmup=min(30, steps // 10))
    return trained, json.loads(log.read_text())


def make_prompts(tokenizer, n: int, seed: int) -> list[list[int]]:
    """Chat prompts the model was trained on (held-out draws) plus the toy tasks it was
    not (longer, less certain answers): its own on-policy distribution, broadly."""
    from core.sft import encode_prompt
    from core.toy_tasks import make_dataset, make_pretrain_dataset

    k = n // 4
    rows = list(make_pretrain_dataset(n - 2 * k, seed=seed + 1000)["prompt"])
    rows += list(make_dataset("reverse", "test", k, seed=seed)["prompt"])
    rows += list(make_dataset("rotate", "test", k, seed=seed)["prompt"])
    return [encode_prompt(tokenizer, msgs) for msgs in rows]


def engine_scores(rollout, prompts: list[list[int]], completions: list[list[int]]) -> list[list[float]]:
    """log p of each completion token under the engine's current weights, teacher-forced
    with prompt_logprobs (as teachers.scoring.VLLMTeacher; prefix caching is off)."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
    outs = rollout.llm.generate([TokensPrompt(prompt_token_ids=p + c) for p, c in zip(prompts, completions)],
                                params, use_tqdm=False)
    res = []
    for p, o in zip(prompts, outs, strict=True):
        ids = o.prompt_token_ids
        res.append([o.prompt_logprobs[j][ids[j]].logprob for j in range(len(p), len(ids))])
    return res


def trainer_scores(model, prompts, completions, pad_id: int) -> torch.Tensor:
    from core.models import collate, completion_logprobs

    batch = collate(prompts, completions, pad_id, {})
    with torch.no_grad():
        return completion_logprobs(model, batch), batch["mask"]


def gap(sampler: list[list[float]], trainer_BT: torch.Tensor, mask_BT: torch.Tensor) -> dict:
    B, T = mask_BT.shape
    s_BT = torch.zeros(B, T)
    for i, row in enumerate(sampler):
        s_BT[i, :len(row)] = torch.tensor(row, dtype=torch.float32)
    d = (s_BT - trainer_BT).abs() * mask_BT
    return {"mean_abs": d.sum().item() / mask_BT.sum().item(), "max_abs": d.max().item()}


def fused(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF tensors arranged as vLLM holds them (qkv_proj, gate_up_proj)."""
    out = {}
    for n, t in sd.items():
        if ".self_attn.q_proj." in n:
            out[n.replace("q_proj", "qkv_proj")] = torch.cat(
                [t, sd[n.replace("q_proj", "k_proj")], sd[n.replace("q_proj", "v_proj")]])
        elif ".mlp.gate_proj." in n:
            out[n.replace("gate_proj", "gate_up_proj")] = torch.cat([t, sd[n.replace("gate_proj", "up_proj")]])
        elif not any(k in n for k in (".k_proj.", ".v_proj.", ".up_proj.")):
            out[n] = t
    return out


def bit_equal(rollout, sd: dict[str, torch.Tensor]) -> bool:
    got, want = rollout.read_weights(), fused(sd)
    return set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def run(out: Path, model_path: str | None, *, group_size: int, convention: str, dtype: str,
        n_prompts: int, max_new_tokens: int, sft_steps: int, seed: int, compile_engine: bool) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from core.quant import QuantConfig, apply_qat, quantized_state_dict
    from core.rollout import VLLMRollout
    from core.models import sampler_weights

    t_start = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    sft_info = None
    if model_path is None:
        print(f"[bench] building a trained tiny model ({sft_steps} SFT steps) in {out / 'model'}")
        path, log = build_trained_model(out, sft_steps, seed)
        model_path = str(path)
        sft_info = {"steps": log["steps"], "seconds": log["seconds"],
                    "loss_first": log["losses"][0], "loss_last_20": sum(log["losses"][-20:]) / 20}
    tok = AutoTokenizer.from_pretrained(model_path)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    trainer = AutoModelForCausalLM.from_pretrained(model_path, dtype=DTYPES[dtype]).eval()
    qat = copy.deepcopy(trainer)
    apply_qat(qat, QuantConfig(enabled=True, group_size=group_size, convention=convention))
    plain_sd = {k: v.detach() for k, v in trainer.state_dict().items()}
    qat_sd = quantized_state_dict(qat)

    print(f"[bench] one vLLM engine ({dtype}, {'compiled' if compile_engine else 'eager'})")
    rollout = VLLMRollout(model_path, dtype=dtype, seed=seed, max_model_len=512, kv_cache_gb=0.5,
                          enforce_eager=not compile_engine)
    try:
        prompts = make_prompts(tok, n_prompts, seed)
        seeds = list(range(n_prompts))
        # (a) unquantized weights in both; these samples are THE fixed tokens.
        rollout.sync_weights(plain_sd.items())
        plain_synced = bit_equal(rollout, plain_sd)
        samples_a = rollout.generate(prompts, max_new_tokens=max_new_tokens, temperature=1.0, seeds=seeds)
        comps = [s.completion_ids for s in samples_a]
        sampler_a = engine_scores(rollout, prompts, comps)
        # (b), (c): the QAT model's quantized weights in the engine.
        rollout.sync_weights(sampler_weights(qat))
        qat_synced = bit_equal(rollout, qat_sd)
        sampler_q = engine_scores(rollout, prompts, comps)
        samples_q = rollout.generate(prompts, max_new_tokens=max_new_tokens, temperature=1.0, seeds=seeds)
        engine_start_s = rollout.start_seconds
    finally:
        rollout.close()

    lp_plain, mask = trainer_scores(trainer, prompts, comps, pad_id)
    lp_qat, _ = trainer_scores(qat, prompts, comps, pad_id)
    a = gap(sampler_a, lp_plain, mask)
    b = gap(sampler_q, lp_qat, mask)
    c = gap(sampler_q, lp_plain, mask)
    # decode path: log-probs returned while sampling
    gen_a = gap([s.sampler_logprobs for s in samples_a], lp_plain, mask)
    comps_q = [s.completion_ids for s in samples_q]
    lp_plain_q, mask_q = trainer_scores(trainer, prompts, comps_q, pad_id)
    lp_qat_q, _ = trainer_scores(qat, prompts, comps_q, pad_id)
    gen_b = gap([s.sampler_logprobs for s in samples_q], lp_qat_q, mask_q)
    gen_c = gap([s.sampler_logprobs for s in samples_q], lp_plain_q, mask_q)

    floor, ident, only = a["mean_abs"], b["mean_abs"], c["mean_abs"]
    result = {
        "bf16_floor": floor,
        "qat_identical": ident,
        "sampler_only_quant": only,
        "dtype": dtype,
        "targets": {
            "qat_identical <= 1.5 * bf16_floor + 1e-4": ident <= 1.5 * floor + 1e-4,
            "sampler_only_quant >= 5 * qat_identical": only >= 5 * ident,
            "ratio_qat_identical_to_floor": ident / floor if floor else None,
            "ratio_sampler_only_quant_to_qat_identical": only / ident if ident else None,
        },
        "max_abs": {"bf16_floor": a["max_abs"], "qat_identical": b["max_abs"],
                    "sampler_only_quant": c["max_abs"]},
        "method": "mean |sampler log p - trainer log p| over completion tokens; sampler log p "
                  "from vLLM prompt_logprobs on the fixed tokens sampled in setting (a); "
                  "trainer log p from core.models.completion_logprobs",
        "generation_path": {
            "note": "vLLM log-probs returned while sampling (decode kernels); (b) and (c) "
                    "use the quantized engine's own samples from the same seeds",
            "bf16_floor": gen_a["mean_abs"], "qat_identical": gen_b["mean_abs"],
            "sampler_only_quant": gen_c["mean_abs"], "tokens_a": int(mask.sum()),
            "tokens_bc": int(mask_q.sum()),
        },
        # how much the fake-quant moves the trainer's own log-probs (context for (c))
        "trainer_quant_effect": (((lp_qat - lp_plain).abs() * mask).sum() / mask.sum()).item(),
        "sampler_weights_bit_equal": {"unquantized": plain_synced, "qat": qat_synced},
        "quant": {"bits": 4, "group_size": group_size, "convention": convention},
        "model": model_path, "sft": sft_info,
        "n_sequences": len(prompts), "n_tokens": int(mask.sum()),
        "max_new_tokens": max_new_tokens, "seed": seed,
        "engine": {"count": 1, "enforce_eager": not compile_engine, "start_s": round(engine_start_s, 1)},
        "seconds": round(time.perf_counter() - t_start, 1),
    }
    (out / "qat_mismatch.json").write_text(json.dumps(result, indent=1))
    print_table(result, out / "qat_mismatch.json")
    return result


def print_table(r: dict, path: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"sampler vs trainer mean |Δ log p| ({r['dtype']}, int4 g={r['quant']['group_size']} "
                    f"{r['quant']['convention']}, {r['n_tokens']} tokens)")
    for col in ("setting", "same tokens (prefill)", "max", "generation path"):
        t.add_column(col)
    names = {"bf16_floor": "(a) both unquantized: floor", "qat_identical": "(b) QAT, identical fake-quant",
             "sampler_only_quant": "(c) quantized sampler only"}
    for k, label in names.items():
        t.add_row(label, f"{r[k]:.2e}", f"{r['max_abs'][k]:.2e}", f"{r['generation_path'][k]:.2e}")
    Console().print(t)
    tg = r["targets"]
    print(f"qat_identical / floor = {tg['ratio_qat_identical_to_floor']:.2f} (target <= 1.5 + 1e-4/floor): "
          f"{'PASS' if tg['qat_identical <= 1.5 * bf16_floor + 1e-4'] else 'FAIL'}")
    print(f"sampler_only_quant / qat_identical = {tg['ratio_sampler_only_quant_to_qat_identical']:.1f} "
          f"(target >= 5): {'PASS' if tg['sampler_only_quant >= 5 * qat_identical'] else 'FAIL'}")
    print(f"written to {path}")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.qat_mismatch", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="folder for qat_mismatch.json (and the built model)")
    ap.add_argument("--model", default=None, help="HF checkpoint to measure (default: build and "
                    "SFT-train a tiny model in OUT/model)")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--convention", default="llm-compressor", choices=["llm-compressor", "kimi"])
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES),
                    help="engine and trainer dtype (default bfloat16)")
    ap.add_argument("--prompts", type=int, default=192)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--sft-steps", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compile", action="store_true", help="compiled engine (default: eager)")
    args = ap.parse_args(argv)
    return run(Path(args.out), args.model, group_size=args.group_size, convention=args.convention,
               dtype=args.dtype, n_prompts=args.prompts, max_new_tokens=args.max_new_tokens,
               sft_steps=args.sft_steps, seed=args.seed, compile_engine=args.compile)


if __name__ == "__main__":
    main()

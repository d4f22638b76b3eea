"""QAT against post-training quantization, and the sampler/trainer mismatch, per quant
format (bf16 = none, int4, nvfp4, mxfp4) on the tiny pipeline's domains, for
docs/results/2026-12-05-fp4-qat.md.

RUNS/<key>/<fmt>/ are `mopd expert` SFT stages of one domain's recipe (key: math-low,
code, ...) from the tiny pipeline's base, one per format: `bf16` with quant.enabled=false,
the others with QAT in that format (the page has the commands). From them:

- **QAT**: the held-out score each stage gave its own checkpoint (summary.json, the
  recipe's 200 rows, greedy);
- **PTQ**: RUNS/<key>/bf16's checkpoint quantized afterwards in each format with the
  functions the export and the sampler use (`apply_qat` + `quantized_state_dict`),
  written to RUNS/<key>/ptq_<fmt>/model and scored by the same suite
  (`pipeline.expert.score`, the stage's own settings from its config.yaml);
- **mismatch**: |log p(vLLM sampler) - log p(trainer)| of the sampler's tokens on the
  domain's held-out prompts (`mopd.distill.loss.mismatch_stats`: mean, max, k3), in the
  MOPD loop's float32, one engine whose weights are synced per setting: `floor` (the bf16
  expert in both), per format `qat` (the QAT checkpoint loaded with QAT on as the next
  stage's trainer, the sampler synced from it as `mopd distill` does) and `ptq` (the bf16
  expert as the trainer, a quantized sampler: training in bf16, serving in the format).

    PYTHONPATH=$PWD python -m bench.fp4_qat_domains RUNS [--keys math-low code] \
        [--json docs/results/2026-12-05-fp4-qat-domains.json] [--no-mismatch] [--wait SECONDS] \
        [--pool OTHER_SEED_RUNS... --rows-cache DIR]

With --pool, the same stages of other training seeds (runs folders laid out like RUNS, this
bench already run on each) are scored per row and QAT - PTQ is pooled over the seeds
(`pooled`: a t interval over the seeds, a two-level bootstrap over seeds x rows).

PTQ scores and the mismatch are cached under RUNS (ptq_<fmt>/score.json, mismatch.json);
delete them to measure again. Prints the page's table (markdown).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path

FORMATS = ("int4", "nvfp4", "mxfp4")
ALL = ("bf16", *FORMATS)
# what the FP4 formats need beside the recipe's int4 quant section (core/quant_config.py)
FP4 = {"nvfp4": {"format": "nvfp4", "group_size": 16}, "mxfp4": {"format": "mxfp4", "group_size": 32}}


def stage_config(run: Path):
    from core.config import load_config
    from experts.run import ExpertConfig

    return load_config(ExpertConfig, run / "config.yaml")


def quant_of(cfg, fmt: str):
    """The QAT section a `fmt` run has: the recipe's (int4, its group and grid) turned on,
    with the FP4 format's block where `fmt` is one (what the runs' overrides set)."""
    return dataclasses.replace(cfg.quant, enabled=True, **FP4.get(fmt, {}))


def stderr(p: float | None, n: int) -> float | None:
    """Standard error of a mean of n 0/1 rewards (math and code score each row 0 or 1)."""
    return None if p is None or not n else math.sqrt(max(p * (1 - p), 0.0) / n)


def write_ptq(bf16_model: Path, quant, out: Path) -> Path:
    """`bf16_model` quantized after training (the trainer's and the export's functions),
    saved as a plain checkpoint the suite can score."""
    from transformers import AutoTokenizer

    from core.models import build_student
    from core.quant import quantized_state_dict

    qat, plain = build_student(str(bf16_model), quant=quant), build_student(str(bf16_model))
    plain.load_state_dict(quantized_state_dict(qat))
    out.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(str(out))
    AutoTokenizer.from_pretrained(str(bf16_model)).save_pretrained(str(out))
    return out


def ptq_score(runs: Path, key: str, fmt: str) -> dict:
    """{"score", "n"} of RUNS/key/bf16 quantized in `fmt` after training (cached)."""
    from evals.run import load_evaluate
    from pipeline.expert import score

    d = runs / key / f"ptq_{fmt}"
    if (d / "score.json").exists():
        return json.loads((d / "score.json").read_text())
    cfg = stage_config(runs / key / "bf16")
    model = write_ptq(runs / key / "bf16" / "model", quant_of(cfg, fmt), d / "model")
    s, _ = score(cfg, load_evaluate(cfg.domain), str(model))
    res = {"score": s, "n": cfg.data.n_test, "quant": dataclasses.asdict(quant_of(cfg, fmt))}
    (d / "score.json").write_text(json.dumps(res, indent=1))
    return res


def served_as(stage: Path, out: Path) -> dict:
    """A finished expert stage (e.g. the pipeline's int4-QAT expert) quantized again in each
    format after training and scored by its suite: what serving it in another format costs.
    {"as trained": its stage's score, fmt: score}; the checkpoints go to out/<fmt>/model."""
    from evals.run import load_evaluate
    from pipeline.expert import score

    cfg = stage_config(stage)
    res = {"as trained": json.loads((stage / "summary.json").read_text())["score"], "n": cfg.data.n_test}
    for fmt in FORMATS:
        model = write_ptq(stage / "model", quant_of(cfg, fmt), out / fmt / "model")
        res[fmt] = score(cfg, load_evaluate(cfg.domain), str(model))[0]
    return res


def scores(runs: Path, key: str) -> dict:
    """{fmt: {"qat", "ptq", "n", "se_*"}} (bf16: "score" only) from the runs there are."""
    out = {}
    for fmt in ALL:
        f = runs / key / fmt / "summary.json"
        s = json.loads(f.read_text())["score"] if f.exists() else None
        n = stage_config(runs / key / fmt).data.n_test if f.exists() else 0
        row = {"qat" if fmt != "bf16" else "score": s, "n": n}
        if fmt != "bf16" and (runs / key / "bf16" / "summary.json").exists():
            p = ptq_score(runs, key, fmt)
            row.update(ptq=p["score"], n=p["n"])
        for k in ("qat", "ptq", "score"):
            if k in row:
                row[f"se_{k}"] = stderr(row[k], row["n"])
        out[fmt] = row
    return out


# ----------------------------------------------------------------------------- seeds
def row_scores(cfg, model: Path) -> list[float]:
    """Per-row rewards of `model` on the stage's held-out rows: the rows, reward, budget
    and batch that `pipeline.expert.score` gave the stage's own score (so their mean is it)."""
    from core.evaluate import evaluate
    from experts import registry
    from experts.run import build_dataset, domain_reward

    domain = registry.load_domain(cfg.domain)
    ds = build_dataset(cfg, domain, "test", cfg.data.n_test)
    _, _, rows = evaluate(str(model), ds, domain_reward(domain, cfg.rl.reward_kwargs),
                          max_new_tokens=cfg.eval.max_new_tokens, batch_size=cfg.eval.batch_size,
                          return_completions=True)
    return [float(x) for x in rows]


def seed_rows(runs: Path, key: str, cache: Path) -> dict:
    """{"seed": train.seed, "<fmt>/qat" | "<fmt>/ptq": per-row scores} of one seed's runs
    folder (its QAT stages and the PTQ checkpoints this bench wrote there), cached under
    `cache` (never written into RUNS: another session's seed may be read-only). Each
    list's mean is checked against the score the stage (summary.json) or the PTQ arm
    (ptq_<fmt>/score.json) recorded, so the rows are the ones the tables report."""
    cfg = stage_config(runs / key / "bf16")
    f = cache / f"{str(runs.resolve()).strip('/').replace('/', '_')}-{key}.json"
    out = json.loads(f.read_text()) if f.exists() else {"runs": str(runs), "seed": cfg.train.seed}
    for fmt in FORMATS:
        arms = {"qat": (runs / key / fmt / "model", runs / key / fmt / "summary.json"),
                "ptq": (runs / key / f"ptq_{fmt}" / "model", runs / key / f"ptq_{fmt}" / "score.json")}
        for arm, (model, rec) in arms.items():
            if f"{fmt}/{arm}" in out:
                continue
            if not rec.exists():
                fix = "train that stage" if arm == "qat" else f"run this bench on {runs} first (it writes the PTQ arm)"
                raise SystemExit(f"{rec}: missing; {fix}")
            rows, want = row_scores(cfg, model), json.loads(rec.read_text())["score"]
            if abs(sum(rows) / len(rows) - want) > 1e-9:
                raise SystemExit(f"{model}: per-row mean {sum(rows) / len(rows):.4f} is not the recorded "
                                 f"score {want:.4f} ({rec}): the rows would not be the table's")
            out[f"{fmt}/{arm}"] = rows
            cache.mkdir(parents=True, exist_ok=True)
            f.write_text(json.dumps(out))
    return out


def pooled(seeds: list[dict]) -> dict:
    """QAT - PTQ per format over seeds: each seed's gap, their mean with a 95% t interval
    over the seeds (bench.stats.t_interval), and the two-level bootstrap of the per-(seed,
    row) differences (bench.stats.bootstrap_mean_ci: seeds, then rows, the same row draw for
    every seed, as paired_gap_ci does); between formats, the difference of their gaps the
    same two ways."""
    from bench.stats import bootstrap_mean_ci, t_interval

    def gap(s, fmt):
        return [q - p for q, p in zip(s[f"{fmt}/qat"], s[f"{fmt}/ptq"])]

    def both(mat):
        per_seed = [sum(r) / len(r) for r in mat]
        m, lo, hi = t_interval(per_seed)
        _, blo, bhi = bootstrap_mean_ci(mat)   # mat holds paired differences already
        return {"per_seed": per_seed, "mean": m, "t95": [lo, hi], "boot95": [blo, bhi]}

    out = {"seeds": [s["seed"] for s in seeds], "runs": [s["runs"] for s in seeds], "qat_minus_ptq": {},
           "between_formats": {}}
    for fmt in FORMATS:
        out["qat_minus_ptq"][fmt] = both([gap(s, fmt) for s in seeds])
    for i, a in enumerate(FORMATS):
        for b in FORMATS[i + 1:]:
            out["between_formats"][f"{a} - {b}"] = both(
                [[x - y for x, y in zip(gap(s, a), gap(s, b))] for s in seeds])
    return out


def pooled_table(p: dict) -> str:
    def ci(r, k):
        return f"[{r[k][0]:+.3f}, {r[k][1]:+.3f}]"

    seeds = " | ".join(f"seed {s}" for s in p["seeds"])
    lines = [f"| QAT - PTQ | {seeds} | mean | 95% t over seeds | 95% bootstrap, seeds x rows |",
             "|---" * (4 + len(p["seeds"])) + "|"]
    for name, r in [*p["qat_minus_ptq"].items(), *p["between_formats"].items()]:
        lines.append(f"| {name} | " + " | ".join(f"{x:+.3f}" for x in r["per_seed"])
                     + f" | {r['mean']:+.3f} | {ci(r, 't95')} | {ci(r, 'boot95')} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- mismatch
def _measure(rollout, trainer, weights, prompts, *, max_new_tokens: int, pad_id: int) -> dict:
    """Sync `weights` into the engine, sample every prompt once (temperature 1, fixed
    seeds), and compare the engine's log-probs of its tokens with `trainer`'s."""
    import torch

    from core.models import collate, completion_logprobs
    from mopd.distill.loss import mismatch_stats

    rollout.sync_weights(weights)
    samples = rollout.generate(prompts, max_new_tokens=max_new_tokens, temperature=1.0,
                               seeds=list(range(len(prompts))))
    comps = [s.completion_ids for s in samples]
    batch = collate(prompts, comps, pad_id, {})
    with torch.no_grad():
        lp_t = completion_logprobs(trainer, batch)
    mask = batch["mask"]
    lp_s = torch.zeros_like(lp_t)
    for i, s in enumerate(samples):
        lp_s[i, :len(s.sampler_logprobs)] = torch.tensor(s.sampler_logprobs, dtype=lp_t.dtype)
    st = mismatch_stats(lp_t, lp_s, mask)
    n = mask.sum().item()
    return {"abs_mean": st["abs_sum"].item() / n, "abs_max": st["abs_max"].item(),
            "k3": st["k3_sum"].item() / n, "tokens": int(n)}


def _save(path: Path | None, res: dict):
    if path is not None:
        path.write_text(json.dumps(res, indent=1))


def _wait_for(f: Path, deadline: float) -> bool:
    while not f.exists() and time.time() < deadline:
        time.sleep(10)
    return f.exists()


def mismatch(runs: Path, keys: list[str], n_prompts: int = 64, wait_s: float = 0.0,
             save: Path | None = None) -> dict:
    """{key: {"floor", "<fmt>/qat", "<fmt>/ptq"}} (see the module note); one vLLM engine.
    The runs may still be training: each is waited for up to `wait_s` (the bf16 runs and
    the PTQ settings first, then the QAT runs), else left out. The engine starts from the
    first key's bf16 checkpoint (every key's model has its architecture: the same base).
    `save`: written after every measurement (a long wait can be cut short)."""
    from core.models import build_student, pad_id_of, sampler_weights
    from core.rollout.vllm import VLLMRollout
    from core.sft import encode_prompt
    from experts import registry
    from experts.run import build_dataset
    from transformers import AutoTokenizer

    first = runs / keys[0] / "bf16" / "model"
    rollout = VLLMRollout(str(first), dtype="float32", seed=0, max_model_len=1024, kv_cache_gb=0.5,
                          enforce_eager=True)
    out, setup, deadline = {}, {}, time.time() + wait_s
    try:
        for key in keys:
            if not _wait_for(runs / key / "bf16" / "summary.json", deadline):
                continue
            cfg = stage_config(runs / key / "bf16")
            tok = AutoTokenizer.from_pretrained(str(runs / key / "bf16" / "model"))
            rows = build_dataset(cfg, registry.load_domain(cfg.domain), "test", n_prompts)
            prompts = [encode_prompt(tok, p) for p in rows["prompt"]]
            kw = dict(max_new_tokens=cfg.eval.max_new_tokens, pad_id=pad_id_of(tok))
            bf16 = build_student(str(runs / key / "bf16" / "model")).eval()
            res = out[key] = {"floor": _measure(rollout, bf16, sampler_weights(bf16), prompts, **kw)}
            for fmt in FORMATS:
                ptq = build_student(str(runs / key / "bf16" / "model"), quant=quant_of(cfg, fmt)).eval()
                res[f"{fmt}/ptq"] = _measure(rollout, bf16, sampler_weights(ptq), prompts, **kw)
            setup[key] = cfg, prompts, kw
            _save(save, out)
        for key in setup:
            cfg, prompts, kw = setup[key]
            for fmt in FORMATS:
                if _wait_for(runs / key / fmt / "summary.json", deadline):
                    qat = build_student(str(runs / key / fmt / "model"), quant=quant_of(cfg, fmt)).eval()
                    out[key][f"{fmt}/qat"] = _measure(rollout, qat, sampler_weights(qat), prompts, **kw)
                    _save(save, out)
            print(json.dumps({key: out[key]}, indent=1), flush=True)
    finally:
        rollout.close()
    return out


# ----------------------------------------------------------------------------- the table
def _f(x, se=None) -> str:
    if x is None:
        return "-"
    return f"{x:.3f}" + (f" ± {se:.3f}" if se is not None else "")


def table(res: dict) -> str:
    """The page's table: per domain and format, QAT, PTQ, bf16, and the mismatch (mean
    |dlog p| of the QAT run's sampler and trainer; of a bf16 trainer with a quantized
    sampler)."""
    lines = ["| domain | format | QAT | PTQ | bf16 | QAT - PTQ | mismatch QAT (mean / max) "
             "| mismatch bf16 trainer, quantized sampler (mean / max) |",
             "|---|---|---|---|---|---|---|---|"]
    for key, sc in res["scores"].items():
        mm = res.get("mismatch", {}).get(key, {})
        b = sc.get("bf16", {})
        fl = mm.get("floor")
        lines.append(f"| {key} | bf16 (none) | - | - | {_f(b.get('score'), b.get('se_score'))} | - | "
                     + (f"{fl['abs_mean']:.1e} / {fl['abs_max']:.1e} (floor)" if fl else "-") + " | - |")
        for fmt in FORMATS:
            r = sc.get(fmt, {})
            d = (r["qat"] - r["ptq"]) if r.get("qat") is not None and r.get("ptq") is not None else None
            q, p = mm.get(f"{fmt}/qat"), mm.get(f"{fmt}/ptq")
            lines.append(f"| {key} | {fmt} | {_f(r.get('qat'), r.get('se_qat'))} | {_f(r.get('ptq'), r.get('se_ptq'))}"
                         f" | {_f(b.get('score'))} | {'-' if d is None else f'{d:+.3f}'} | "
                         + (f"{q['abs_mean']:.1e} / {q['abs_max']:.1e}" if q else "-") + " | "
                         + (f"{p['abs_mean']:.1e} / {p['abs_max']:.1e}" if p else "-") + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.fp4_qat_domains", description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", help="folder with <key>/<fmt>/ expert SFT stages")
    ap.add_argument("--keys", nargs="*", default=None, help="domains (folder names under RUNS; default: all)")
    ap.add_argument("--json", default=None, help="also write the result here")
    ap.add_argument("--no-mismatch", action="store_true", help="scores only (no vLLM engine)")
    ap.add_argument("--prompts", type=int, default=64, help="held-out prompts per domain for the mismatch")
    ap.add_argument("--wait", type=float, default=0.0,
                    help="seconds to wait for QAT runs still training (the mismatch measures the rest first)")
    ap.add_argument("--pool", nargs="*", default=[],
                    help="other seeds' runs folders, laid out like RUNS and this bench already run on "
                         "them: QAT - PTQ pooled over RUNS and these, per row (needs --rows-cache)")
    ap.add_argument("--rows-cache", default=None, help="folder for the per-row scores --pool measures")
    a = ap.parse_args(argv)
    if a.pool and not a.rows_cache:
        raise SystemExit("--pool needs --rows-cache DIR (the per-row scores are cached there, not in the runs)")
    runs = Path(a.runs)
    keys = a.keys or sorted(p.name for p in runs.iterdir() if (p / "bf16" / "summary.json").exists())
    if not keys:
        raise SystemExit(f"{runs}: no <key>/bf16/summary.json (an unquantized SFT stage per domain) found")
    res = {"keys": keys, "scores": {k: scores(runs, k) for k in keys}}
    if not a.no_mismatch:
        cache = runs / "mismatch.json"
        mm = json.loads(cache.read_text()) if cache.exists() else {}
        todo = [k for k in keys if k not in mm]   # cached: delete mismatch.json to measure again
        if todo:
            mm.update(mismatch(runs, todo, a.prompts, a.wait))
            _save(cache, mm)
        res["mismatch"] = {k: mm[k] for k in keys}
    res["table"] = table(res)
    if a.pool:
        res["pooled"] = {k: pooled(sorted((seed_rows(Path(r), k, Path(a.rows_cache)) for r in [runs, *a.pool]),
                                          key=lambda s: s["seed"])) for k in keys}
        res["table"] += "".join(f"\n\n{k}, over seeds:\n{pooled_table(p)}" for k, p in res["pooled"].items())
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    print(res["table"])
    return res


if __name__ == "__main__":
    main()

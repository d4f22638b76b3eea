"""The kernel reward against the speed of light: for one task of every family, the
reference (the floor), the expert, candidates written to beat the expert, and a cheat that
returns cached outputs, each scored by rewards/kernel.py with this machine's peaks.

    python -m bench.kernel_sol --out runs/bench_kernel_sol [--trials 21] [--families softmax,cumsum]

The candidates (`candidates`) are what a model could learn past the expert's one line: the
same op without the Python wrapper (`torch.layer_norm` for `F.layer_norm`), activations in
place on the one intermediate the op must allocate anyway, tanh-GELU through exp (MKL's
vectorized exp; in the sandbox torch's fused CPU kernels are its generic ones, since
cpuinfo cannot read /proc/cpuinfo there), matrix products (pairwise distances, attention),
and for the fused-op families (softmax, norms, bias + activation, segment sum) numpy on the
tensors' own memory, whose ufuncs pick their SIMD loops from the CPU itself (a one-hot
matrix product for the segment sum). Each is correct to the reward's tolerance on float32
and float64 for every parameter value; none is tuned per shape. Where none is faster than
the expert, the table says so. Not written, since the harness calls them cheats or the
sandbox denies them: an output buffer kept between calls (`cached_output`), writing into
an input, a compiled C loop (ctypes is denied; a compiler is a spawned process).

Writes OUT/kernel_sol.json: the machine's peaks, and per family the task, its `sol`
sizes, speed of light (us) and every completion's time, fraction of the speed of light,
score and verdict; prints the table of docs/results/2026-12-05-kernel-speed-of-light.md.
Also judges one synthetic result (a lookup table answering in 0.1 us per call, which no
real run here produced: every cheat the harness knows is caught before its time counts)
to show the below-speed-of-light verdict on real peaks.
"""
from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from experts.kernel import data
from rewards.kernel import TRIALS, judge, machine_peaks, score_kernels

COLS = ("reference", "expert", "spec", "domain")
# activations in place on the one intermediate the op allocates anyway, called as the C
# functions F's Python wrappers end in (torch._C._nn)
ACT_INPLACE = {"relu": "{t}.relu_()", "sigmoid": "{t}.sigmoid_()", "silu": "torch._C._nn.silu_({t})",
               "tanh": "{t}.tanh_()", "gelu": "torch._C._nn.gelu_({t})"}


def _act(p: dict, t: str) -> str:
    return ACT_INPLACE[p["act"]].format(t=t)


# numpy's ufuncs on the tensors' own memory (x.numpy() and torch.from_numpy share it, no
# copy): numpy picks its SIMD loops (AVX2/AVX-512 exp, tanh, sums) from the CPU itself,
# where torch in the sandbox runs its generic scalar kernels (cpuinfo cannot read
# /proc/cpuinfo there; rewards/kernel_calibrate.py measures under the same condition).
# One fresh output array per call, every later step in place on it.
NP = "import numpy as np\n\n"
# an activation in place on the float array t (gelu has no numpy erf: torch's, in place)
NP_ACT = {"relu": "    np.maximum(t, 0, out=t)\n",
          "sigmoid": "    np.negative(t, out=t)\n    np.exp(t, out=t)\n    t += 1\n    np.reciprocal(t, out=t)\n",
          "silu": "    e = np.negative(t)\n    np.exp(e, out=e)\n    e += 1\n    np.divide(t, e, out=t)\n",
          "tanh": "    np.tanh(t, out=t)\n",
          "gelu": "    torch._C._nn.gelu_(torch.from_numpy(t))\n"}


def _np_softmax(x: str, t: str | None = None, log: bool = False) -> str:
    """Row (log-)softmax of `x` (divided by t) in numpy: C-level ufuncs and their reduces
    only (ndarray.max / .sum go through Python wrappers), one array, every pass in place."""
    scale = f"    e *= {1.0 / float(t)!r}\n" if t else ""
    tail = ("    s = np.add.reduce(np.exp(e), axis=-1, keepdims=True)\n    e -= np.log(s, out=s)\n" if log else
            "    np.exp(e, out=e)\n    e /= np.add.reduce(e, axis=-1, keepdims=True)\n")
    return (f"    a = {x}.numpy()\n    e = np.subtract(a, np.maximum.reduce(a, axis=-1, keepdims=True))\n"
            + scale + tail + "    return torch.from_numpy(e)\n")


def _np_rms(src: str, w: str, eps: str) -> str:
    """RMS norm in numpy: the sum of squares per row as one SIMD dot (np.vecdot, a C
    gufunc), then in place."""
    return (src + "    ms = np.vecdot(t, t)[:, None]\n    ms *= 1.0 / t.shape[-1]\n"
            f"    ms += {eps}\n    np.sqrt(ms, out=ms)\n    t /= ms\n    t *= {w}.numpy()\n"
            "    return torch.from_numpy(t)\n")


def candidates(task: data.Task) -> dict[str, str]:
    """{name: kernel source} for this task's family: `def kernel(...)`, or `kernel = ...`
    bound straight to a C function (no Python frame per call)."""
    n, p = dict(task.names), dict(task.params)
    x, w, b = n.get("x"), n.get("w"), n.get("b")
    f, sig = task.family, task.signature
    d = lambda body: f"def kernel({sig}):\n{body}"
    partial = lambda fn, **kw: "import functools\nkernel = functools.partial(" + fn + "".join(
        f", {k}={v}" for k, v in kw.items()) + ")\n"
    if f == "softmax":
        return {"partial(torch._softmax)": partial("torch._softmax", dim=-1, half_to_float=False),
                "numpy in place": NP + d(_np_softmax(x))}
    if f == "log_softmax":
        return {"partial(torch._log_softmax)": partial("torch._log_softmax", dim=-1, half_to_float=False),
                "numpy in place": NP + d(_np_softmax(x, log=True))}
    if f == "softmax_temp":
        return {"mul then _softmax": d(f"    return torch._softmax({x} * (1.0 / {p['t']}), -1, False)\n"),
                "numpy in place": NP + d(_np_softmax(x, t=p["t"]))}
    if f == "layer_norm":
        return {"torch.layer_norm": d(f"    return torch.layer_norm({x}, {x}.shape[-1:], {w}, {b}, {p['eps']})\n")}
    if f == "norm_act":
        return {"layer_norm, act in place": d(f"    t = torch.layer_norm({x}, {x}.shape[-1:], {w}, {b}, {p['eps']})\n"
                                              f"    return {_act(p, 't')}\n")}
    if f in ("rms_norm", "residual_rms"):
        src = f"torch.add({x}, {n['r']})" if f == "residual_rms" else x
        load = f"    t = np.add({x}.numpy(), {n['r']}.numpy())\n" if f == "residual_rms" else f"    t = {x}.numpy().copy()\n"
        return {"torch.rms_norm": d(f"    return torch.rms_norm({src}, {x}.shape[-1:], {w}, {p['eps']})\n"),
                "numpy in place": NP + d(_np_rms(load, w, p["eps"]))}
    if f == "gelu":
        if p["approximate"] == "tanh":
            # 0.5 x (1 + tanh z) = x sigmoid(2z) = x / (1 + exp(-2z)), in place after the first product
            return {"x / (1 + exp(-2z))": d(f"    z = torch.mul({x}, {x}).mul_(-0.07135481627260025)"
                                            f".sub_(1.5957691216057308).mul_({x})\n"
                                            f"    return z.exp_().add_(1).reciprocal_().mul_({x})\n")}
        return {"kernel = F.gelu": "kernel = F.gelu\n"}
    if f == "bias_act":
        return {"add, act in place": d(f"    t = {x} + {b}\n    return {_act(p, 't')}\n"),
                "numpy in place": NP + d(f"    t = np.add({x}.numpy(), {b}.numpy())\n" + NP_ACT[p["act"]]
                                         + "    return torch.from_numpy(t)\n")}
    if f == "bias_act_scale":
        return {"add, act and scale in place": d(f"    t = {x} + {b}\n    return ({_act(p, 't')}).mul_({p['s']})\n"),
                "numpy in place": NP + d(f"    t = np.add({x}.numpy(), {b}.numpy())\n" + NP_ACT[p["act"]]
                                         + f"    t *= {p['s']}\n    return torch.from_numpy(t)\n")}
    if f == "cumsum":
        # a triangle of ones per (size, dtype), kept: a constant, not an output; then one matmul
        tri, prod = ("tril_", "m @ {x}") if p["dim"] == "0" else ("triu_", "{x} @ m")
        return {"partial(torch.cumsum)": partial("torch.cumsum", dim=p["dim"]),
                "kept triangle matmul": "_tri = {}\n\n" + d(
                    f"    n = {x}.shape[{p['dim']}]\n    m = _tri.get((n, {x}.dtype))\n    if m is None:\n"
                    f"        m = _tri[(n, {x}.dtype)] = torch.ones(n, n, dtype={x}.dtype).{tri}()\n"
                    f"    return {prod.format(x=x)}\n")}
    if f == "segment_sum":
        # the segment sum as one matrix product: a one-hot (k x rows) matrix times x (BLAS)
        return {"new_zeros index_add_": d(f"    return {x}.new_zeros(({p['k']}, {x}.shape[1])).index_add_(0, ids, {x})\n"),
                "numpy one-hot matmul": NP + d(f"    a = {x}.numpy()\n    oh = np.zeros(({p['k']}, a.shape[0]), a.dtype)\n"
                                               f"    oh[ids.numpy(), np.arange(a.shape[0])] = 1\n"
                                               f"    return torch.from_numpy(oh @ a)\n")}
    if f == "pairwise":
        y = n["y"]
        out = {"cdist without its wrapper": d(f"    return torch._C._VariableFunctions.cdist({x}, {y}, {p['p']}.0, None)\n")}
        if p["p"] == "2":
            out["addmm"] = d(f"    t = torch.addmm(({y} * {y}).sum(1), {x}, {y}.t(), alpha=-2)\n"
                             f"    return t.add_(({x} * {x}).sum(1, keepdim=True)).clamp_min_(0).sqrt_()\n")
        return out
    if f == "attention":
        mask = ("    s.masked_fill_(torch.ones(s.shape[-1], s.shape[-1], dtype=torch.bool).triu_(1), float('-inf'))\n"
                if p["causal"] == "True" else "")
        return {"bmm softmax bmm": d("    s = torch.bmm(q, k.transpose(1, 2)).mul_(1.0 / math.sqrt(q.shape[-1]))\n"
                                     + mask + "    return torch.bmm(torch._softmax(s, -1, False), v)\n")}
    raise KeyError(f)


def _fence(code: str) -> str:
    return f"```python\n{code}```"


def tasks(seed: int = 0) -> list[data.Task]:
    """One difficulty-1 draw per family (difficulty 2 or 3 for the fused families)."""
    rng = random.Random(f"bench-kernel-sol/{seed}")
    return [data.draw_task(rng, fam.level, families=(fam,)) for fam in data.FAMILIES]


def run(out: Path, trials: int, families: list[str] | None, seed: int, timeout_s: float = 20.0) -> dict:
    peaks = machine_peaks()
    res = {"peaks": {"bytes_per_s": peaks.bytes_per_s, "flops_per_s": peaks.flops_per_s, "machine": peaks.key,
                     "source": peaks.source, **peaks.detail}, "trials": trials, "tasks": []}
    for task in tasks(seed):
        if families and task.family not in families:
            continue
        row = data._row(task)
        comps = {"reference": data.reference_completion(row), "expert": task.completion}
        comps.update({f"candidate: {k}": _fence(v) for k, v in candidates(task).items()})
        comps["cheat: cached outputs"] = data.cheat_completion(row, "cached_output")
        t0 = time.perf_counter()
        got = score_kernels(None, list(comps.values()), **{c: [row[c]] * len(comps) for c in COLS},
                            trials=trials, peaks=peaks, timeout_s=timeout_s)
        spec = json.loads(row["spec"])
        entry = {"family": task.family, "params": dict(task.params), "shape": dict(task.shape), "sol": spec["sol"],
                 "sol_us": peaks.sol_us(spec["sol"]), "seconds": round(time.perf_counter() - t0, 1), "scored": {}}
        for name, g in zip(comps, got):
            t = g.get("t_ref_us", 0) / g["r"] if g.get("r") else None
            entry["scored"][name] = {"score": g["score"], "reason": g["reason"], "detail": g.get("detail", ""),
                                     "t_us": t, "frac_sol": g.get("frac_sol"), "r": g.get("r"),
                                     "t_ref_us": g.get("t_ref_us"), "t_exp_us": g.get("t_exp_us"),
                                     "frac_sol_expert": g.get("frac_sol_expert")}
        res["tasks"].append(entry)
        _write(out, res)   # after every family: a run cut short keeps what it measured
        print(table_row(entry), flush=True)
    # the verdict on a time no honest kernel reaches (synthetic: see the module docstring)
    last = res["tasks"][-1]
    ref = last["scored"]["expert"]
    fake = {"reason": "ok", "detail": "", "r": ref["t_ref_us"] / 0.1, "r_expert": ref["t_ref_us"] / ref["t_exp_us"],
            "t_ref_us": ref["t_ref_us"], "t_exp_us": ref["t_exp_us"], "t_cand_us": 0.1}
    res["synthetic_lookup_table"] = {"family": last["family"], **judge(fake, last["sol"], peaks)}
    _write(out, res)
    return res


def _write(out: Path, res: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernel_sol.json").write_text(json.dumps(res, indent=1))


def table_row(e: dict) -> str:
    s = e["scored"]
    exp = s["expert"]
    cands = {k: v for k, v in s.items() if k.startswith("candidate")}
    best = max(cands, key=lambda k: cands[k]["score"])
    fmt = lambda v: f"{v['t_us']:.3g} us, {v['frac_sol']:.3f}, **{v['score']:.3f}**" if v["reason"] == "ok" \
        else f"{v['reason']}, **{v['score']:g}**"
    params = ", ".join(f"{k} {v}" for k, v in e["params"].items()) or "-"
    shape = "x".join(str(v) for v in e["shape"].values())
    cheat = s["cheat: cached outputs"]
    return (f"| {e['family']} | {params} | {shape} | {e['sol']['bytes']} B, {e['sol']['flops']} FLOP | "
            f"{e['sol_us']:.3g} | {fmt(s['reference'])} | {fmt(exp)} | {best[len('candidate: '):]}: {fmt(cands[best])} | "
            f"{cheat['reason']}, {cheat['score']:g} |")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--trials", type=int, default=TRIALS)
    ap.add_argument("--families", default="", help="comma-separated families (default: all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout-s", type=float, default=20.0,
                    help="the reward's CPU seconds per completion (wall: 3x + 2); raise it on a crowded machine, "
                         "where a niced run's completions can time out on the wall clock")
    a = ap.parse_args(argv)
    print("| family | params | timing shape | sol sizes | SOL us | reference: time, frac SOL, score | "
          "expert | fastest candidate | cached outputs |\n|---|---|---|---|---|---|---|---|---|")
    res = run(Path(a.out), a.trials, [f for f in a.families.split(",") if f] or None, a.seed, a.timeout_s)
    print(json.dumps({"peaks": res["peaks"], "synthetic_lookup_table": res["synthetic_lookup_table"]}, indent=1))


if __name__ == "__main__":
    main()

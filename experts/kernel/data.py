"""Data of the `kernel` domain: "make this PyTorch op fast" tasks. A task names an op and
its parameters and shows its naive PyTorch reference; the answer is a short vectorized
or fused `kernel(...)` (the expert kernel: timed beside every candidate and reported as a
fraction of the speed of light, which is the reward's 1.0; Task.sol gives its sizes).

    user:      Op: layer_norm over the last dim, eps=1e-5.
               Inputs: h [64, 128], w [128], b [128] (float).
               Reference:
               ```python
               def reference(h, w, b):
                   out = torch.empty_like(h)
                   for i in range(h.shape[0]):
                       ...
               ```
               Write kernel(h, w, b): the same result, faster.
    assistant: ```python
               def kernel(h, w, b):
                   return F.layer_norm(h, h.shape[-1:], w, b, eps=1e-5)
               ```

rewards/kernel.py runs it in the sandbox (torch, math and F = torch.nn.functional are bound there):
right on fresh inputs of several shapes and dtypes, timed against the reference and the
expert, checked for cheats.

Families (FAMILIES): level 1, one op with its parameter: row softmax, log-softmax, layer
norm (eps), RMS norm (eps), GELU (exact or tanh), fused bias + activation (relu, silu,
sigmoid, tanh, gelu), cumulative sum (dim; the reference sums each prefix), segment sum (number of segments), pairwise
distances (p = 1 or 2), attention on small shapes (causal or not); level 2, fusion depth
two: softmax with a temperature, layer norm then an activation, bias + activation then a
scale; level 3: residual add + RMS norm. References loop
over rows (or columns, or positions) in Python, so a vectorized kernel is 10-100x faster
on small CPU tensors: a gap far above timing noise. Every expert kernel is one line.

difficulty 1: level-1 families, timing shapes of 32-64 rows;
difficulty 2: + level-2 families, up to 96 rows;
difficulty 3: + level-3 families, up to 128 rows and 256 columns.

The argument names (x, h, a, z, u; w/g; b/c) and the timing shape are drawn at random, so
a model must copy the names and pick the body from the op and its parameter. Splits: a
task is in `train` or `test` by a stable hash of its prompt text (disjoint whatever n,
seed or difficulty); rows are deterministic for (split, n, seed, difficulty).
"""
from __future__ import annotations

import hashlib
import json
import math
import random
from dataclasses import dataclass
from typing import Callable

import datasets

from experts.procedural import check_split_n_effort, prompt_dataset
from core.splits import split_of
from rewards.kernel import FLOOR, sol_problem

DOMAIN = "kernel"
EFFORTS: tuple[str, ...] = ()
TEST_FRACTION = 0.1
DTYPES = ("float32", "float64")

X_NAMES = ("x", "h", "a", "z", "u")
W_NAMES = ("w", "g")
B_NAMES = ("b", "c")
ACTS = ("relu", "silu", "sigmoid", "tanh", "gelu")
EPS = ("1e-5", "1e-6", "1e-4", "1e-3")
TEMPS = ("0.5", "2.0", "4.0")
SCALES = ("0.5", "2.0", "3.0")
ROWS = {1: (32, 48, 64), 2: (32, 64, 96), 3: (64, 96, 128)}
COLS = {1: (64, 128), 2: (64, 128, 192), 3: (128, 256)}

F = "F"   # the kernel's namespace binds F = torch.nn.functional (rewards/kernel.py)
# naive forms of the activations, on a row h of the reference
NAIVE_ACT = {
    "relu": "torch.clamp({h}, min=0)",
    "silu": "{h} / (1 + torch.exp(-{h}))",
    "sigmoid": "1 / (1 + torch.exp(-{h}))",
    "tanh": "torch.tanh({h})",
    "gelu": "0.5 * {h} * (1 + torch.erf({h} / math.sqrt(2)))",
}


@dataclass(frozen=True)
class Family:
    key: str
    level: int
    roles: tuple[str, ...]                  # argument roles: x, w, b, r (residual), ids, y, q, k, v
    params: dict[str, tuple]                # parameter name -> choices
    text: str                               # the op line, {param} filled in
    reference: str                          # body of reference(...), {x}/{w}/... and params filled in
    expert: str                             # the return expression of kernel(...)
    args: Callable[[dict], list]            # [(role, kind, dims)] for the spec


def _rows(role_dims):
    return lambda p: role_dims


ROW_ARGS = [("x", "randn", ["R", "C"])]
ROW_WB = [("x", "randn", ["R", "C"]), ("w", "randn", ["C"]), ("b", "randn", ["C"])]
ROW_W = [("x", "randn", ["R", "C"]), ("w", "randn", ["C"])]
ROW_B = [("x", "randn", ["R", "C"]), ("b", "randn", ["C"])]

FAMILIES: tuple[Family, ...] = (
    Family("softmax", 1, ("x",), {}, "row softmax over the last dim",
           "    out = torch.empty_like({x})\n    for i in range({x}.shape[0]):\n"
           "        e = torch.exp({x}[i] - {x}[i].max())\n        out[i] = e / e.sum()\n    return out",
           "torch.softmax({x}, dim=-1)", _rows(ROW_ARGS)),
    Family("log_softmax", 1, ("x",), {}, "row log-softmax over the last dim",
           "    out = torch.empty_like({x})\n    for i in range({x}.shape[0]):\n        m = {x}[i].max()\n"
           "        out[i] = {x}[i] - m - torch.log(torch.exp({x}[i] - m).sum())\n    return out",
           "torch.log_softmax({x}, dim=-1)", _rows(ROW_ARGS)),
    Family("layer_norm", 1, ("x", "w", "b"), {"eps": EPS}, "layer_norm over the last dim, eps={eps}",
           "    out = torch.empty_like({x})\n    for i in range({x}.shape[0]):\n        mu = {x}[i].mean()\n"
           "        var = (({x}[i] - mu) ** 2).mean()\n"
           "        out[i] = ({x}[i] - mu) / torch.sqrt(var + {eps}) * {w} + {b}\n    return out",
           F + ".layer_norm({x}, {x}.shape[-1:], {w}, {b}, eps={eps})", _rows(ROW_WB)),
    Family("rms_norm", 1, ("x", "w"), {"eps": EPS}, "rms_norm over the last dim, eps={eps}",
           "    out = torch.empty_like({x})\n    for i in range({x}.shape[0]):\n"
           "        out[i] = {x}[i] / torch.sqrt(({x}[i] ** 2).mean() + {eps}) * {w}\n    return out",
           F + ".rms_norm({x}, {x}.shape[-1:], {w}, eps={eps})", _rows(ROW_W)),
    Family("gelu", 1, ("x",), {"approximate": ("none", "tanh")}, "gelu, approximate='{approximate}'",
           None, F + ".gelu({x}, approximate='{approximate}')", _rows(ROW_ARGS)),   # reference: _gelu_reference
    Family("bias_act", 1, ("x", "b"), {"act": ACTS}, "fused bias add then {act}",
           "    out = torch.empty_like({x})\n    for i in range({x}.shape[0]):\n        t = {x}[i] + {b}\n"
           "        out[i] = {naive}\n    return out",
           F + ".{act}({x} + {b})", _rows(ROW_B)),
    Family("cumsum", 1, ("x",), {"dim": ("0", "1")}, "cumulative sum along dim {dim}",
           None, "torch.cumsum({x}, dim={dim})", _rows(ROW_ARGS)),
    Family("segment_sum", 1, ("x", "ids"), {"k": tuple(str(k) for k in range(3, 13))},
           "segment sum of the rows of {x} into {k} segments given by {ids}",
           "    out = torch.zeros({k}, {x}.shape[1], dtype={x}.dtype)\n    for i in range({x}.shape[0]):\n"
           "        out[{ids}[i]] += {x}[i]\n    return out",
           "torch.zeros({k}, {x}.shape[1], dtype={x}.dtype).index_add_(0, {ids}, {x})",
           lambda p: [("x", "randn", ["R", "C"]), ("ids", "ids", ["R"])]),
    Family("pairwise", 1, ("x", "y"), {"p": ("1", "2")}, "pairwise p={p} distances between the rows of {x} and {y}",
           None, "torch.cdist({x}, {y}, p={p})",
           lambda p: [("x", "randn", ["R", "D"]), ("y", "randn", ["M", "D"])]),
    Family("attention", 1, ("q", "k", "v"), {"causal": ("True", "False")}, "attention, is_causal={causal}",
           None, F + ".scaled_dot_product_attention({q}, {k}, {v}, is_causal={causal})",
           lambda p: [("q", "randn", ["B", "N", "D"]), ("k", "randn", ["B", "N", "D"]), ("v", "randn", ["B", "N", "D"])]),
    # level 2: fusion depth two
    Family("softmax_temp", 2, ("x",), {"t": TEMPS}, "row softmax of {x} / {t} over the last dim",
           "    out = torch.empty_like({x})\n    for i in range({x}.shape[0]):\n        s = {x}[i] / {t}\n"
           "        e = torch.exp(s - s.max())\n        out[i] = e / e.sum()\n    return out",
           "torch.softmax({x} / {t}, dim=-1)", _rows(ROW_ARGS)),
    Family("norm_act", 2, ("x", "w", "b"), {"act": ACTS, "eps": EPS}, "layer_norm (eps={eps}) then {act}",
           "    out = torch.empty_like({x})\n    for i in range({x}.shape[0]):\n        mu = {x}[i].mean()\n"
           "        var = (({x}[i] - mu) ** 2).mean()\n        t = ({x}[i] - mu) / torch.sqrt(var + {eps}) * {w} + {b}\n"
           "        out[i] = {naive}\n    return out",
           F + ".{act}(" + F + ".layer_norm({x}, {x}.shape[-1:], {w}, {b}, eps={eps}))", _rows(ROW_WB)),
    Family("bias_act_scale", 2, ("x", "b"), {"act": ACTS, "s": SCALES}, "fused bias add, {act}, then times {s}",
           "    out = torch.empty_like({x})\n    for i in range({x}.shape[0]):\n        t = {x}[i] + {b}\n"
           "        out[i] = ({naive}) * {s}\n    return out",
           F + ".{act}({x} + {b}) * {s}", _rows(ROW_B)),
    # level 3
    Family("residual_rms", 3, ("x", "r", "w"), {"eps": EPS}, "rms_norm of {x} + {r} over the last dim, eps={eps}",
           "    out = torch.empty_like({x})\n    for i in range({x}.shape[0]):\n        t = {x}[i] + {r}[i]\n"
           "        out[i] = t / torch.sqrt((t ** 2).mean() + {eps}) * {w}\n    return out",
           F + ".rms_norm({x} + {r}, {x}.shape[-1:], {w}, eps={eps})",
           lambda p: [("x", "randn", ["R", "C"]), ("r", "randn", ["R", "C"]), ("w", "randn", ["C"])]),
)
FAMILY = {f.key: f for f in FAMILIES}


def _gelu_reference(p: dict) -> str:
    if p["approximate"] == "tanh":
        expr = "0.5 * t * (1 + torch.tanh(math.sqrt(2 / math.pi) * (t + 0.044715 * t ** 3)))"
    else:
        expr = "0.5 * t * (1 + torch.erf(t / math.sqrt(2)))"
    return ("    out = torch.empty_like({x})\n    for i in range({x}.shape[0]):\n        t = {x}[i]\n"
            f"        out[i] = {expr}\n    return out")


def _cumsum_reference(p: dict) -> str:
    # each prefix summed afresh: the naive quadratic form (a running sum in the loop is
    # only ~3x slower than torch.cumsum along dim 0, too close for a speed scale)
    if p["dim"] == "1":
        return ("    out = torch.empty_like({x})\n    for j in range({x}.shape[1]):\n"
                "        out[:, j] = {x}[:, :j + 1].sum(dim=1)\n    return out")
    return ("    out = torch.empty_like({x})\n    for i in range({x}.shape[0]):\n"
            "        out[i] = {x}[:i + 1].sum(dim=0)\n    return out")


def _pairwise_reference(p: dict) -> str:
    dist = "({x}[i] - {y}).abs().sum(dim=1)" if p["p"] == "1" else "torch.sqrt((({x}[i] - {y}) ** 2).sum(dim=1))"
    return ("    out = torch.empty({x}.shape[0], {y}.shape[0], dtype={x}.dtype)\n    for i in range({x}.shape[0]):\n"
            f"        out[i] = {dist}\n    return out")


def _attention_reference(p: dict) -> str:
    keys = ":i + 1" if p["causal"] == "True" else ":"
    return ("    out = torch.empty_like({q})\n    for b in range({q}.shape[0]):\n        for i in range({q}.shape[1]):\n"
            f"            s = {{k}}[b, {keys}] @ {{q}}[b, i] / math.sqrt({{q}}.shape[2])\n"
            f"            out[b, i] = torch.softmax(s, dim=0) @ {{v}}[b, {keys}]\n    return out")


# FLOPs per output element that every kernel of a row family must do (exp and the like
# count as one; a norm's per-row mean / sqrt is negligible); activations add ACT_FLOPS
FLOPS_PER_ELEMENT = {"softmax": 5, "log_softmax": 5, "layer_norm": 7, "rms_norm": 4, "gelu": 5, "bias_act": 1,
                     "cumsum": 1, "softmax_temp": 6, "norm_act": 7, "bias_act_scale": 2, "residual_rms": 5}
ACT_FLOPS = {"relu": 1, "silu": 3, "sigmoid": 3, "tanh": 1, "gelu": 5}
def check_row(row: dict) -> str | None:
    """A team's row of this domain (experts/files.py, before any model loads): what keeps the
    reward from scoring it (a spec without its speed-of-light sizes), else None."""
    return sol_problem(row.get("spec")) if row.get("spec") else None


REFERENCE_OF = {"gelu": _gelu_reference, "cumsum": _cumsum_reference, "pairwise": _pairwise_reference,
                "attention": _attention_reference}
EXPERT_OF: dict[str, Callable[[dict], str]] = {}


@dataclass(frozen=True)
class Task:
    family: str
    params: tuple[tuple[str, str], ...]
    names: tuple[tuple[str, str], ...]       # role -> argument name
    shape: tuple[tuple[str, int], ...]       # the timing shape (symbol -> size)

    @property
    def fam(self) -> Family:
        return FAMILY[self.family]

    def _fill(self, text: str) -> str:
        p = dict(self.params)
        names = dict(self.names)
        naive = NAIVE_ACT[p["act"]].format(h="t") if "act" in p else ""
        return text.format(**names, **p, naive=naive)

    @property
    def arg_names(self) -> list[str]:
        return [dict(self.names)[r] for r in self.fam.roles]

    @property
    def signature(self) -> str:
        return ", ".join(self.arg_names)

    @property
    def reference_code(self) -> str:
        p = dict(self.params)
        body = REFERENCE_OF[self.family](p) if self.family in REFERENCE_OF else self.fam.reference
        return f"def reference({self.signature}):\n{self._fill(body)}\n"

    @property
    def expert_code(self) -> str:
        p = dict(self.params)
        expr = EXPERT_OF[self.family](p) if self.family in EXPERT_OF else self.fam.expert
        return f"def kernel({self.signature}):\n    return {self._fill(expr)}\n"

    @property
    def completion(self) -> str:
        return f"```python\n{self.expert_code}```"

    def spec(self) -> dict:
        """The reward's `spec`: inputs, correctness shapes (two small odd ones and the
        timing shape), dtypes, timing shape."""
        names = dict(self.names)
        args = [(names[role], kind, dims) for role, kind, dims in self.fam.args(dict(self.params))]
        t = dict(self.shape)
        small = [{s: max(1, (v * 3) // 32 + 2) if s not in ("K", "B") else v for s, v in t.items()},
                 {s: (v // 2 + 1) if s not in ("K", "B") else v for s, v in t.items()}]
        return {"args": [list(a) for a in args], "shapes": small + [t], "dtypes": list(DTYPES), "time": t,
                "sol": self.sol()}

    def sol(self) -> dict:
        """What the op must do at the timing shape (float32), for its speed of light
        (rewards/kernel.py): `bytes`, every input read once and the output written once
        (ids are int64), and `flops`, the arithmetic no kernel can skip (FLOPS_PER_ELEMENT
        of the output, or the pairwise / attention products), each exp / erf / tanh / sqrt
        counted as one. Both are lower bounds, so the time they give is one too."""
        t = dict(self.shape)
        size = lambda dims: math.prod(t[d] for d in dims)
        ins = sum(size(dims) * (8 if kind == "ids" else 4) for _, kind, dims in self.fam.args(dict(self.params)))
        p = dict(self.params)
        if self.family == "pairwise":
            out, flops = t["R"] * t["M"], 3 * t["R"] * t["M"] * t["D"]
        elif self.family == "attention":
            pairs = t["B"] * (t["N"] * (t["N"] + 1) // 2 if p["causal"] == "True" else t["N"] ** 2)
            out, flops = t["B"] * t["N"] * t["D"], pairs * (4 * t["D"] + 3)   # q.k and p.v: 2 D each; exp, sum, div
        elif self.family == "segment_sum":
            out, flops = t["K"] * t["C"], t["R"] * t["C"]
        else:
            out = t["R"] * t["C"]
            per = FLOPS_PER_ELEMENT[self.family]
            flops = out * (per + ACT_FLOPS[p["act"]] if "act" in p else per)
        return {"bytes": ins + 4 * out, "flops": flops}

    @property
    def prompt(self) -> str:
        names = dict(self.names)
        t = dict(self.shape)
        ins = ", ".join(f"{names[role]} [{', '.join(str(t.get(d, d)) for d in dims)}]"
                        + (" (int64)" if kind == "ids" else "")
                        for role, kind, dims in self.fam.args(dict(self.params)))
        return (f"Op: {self._fill(self.fam.text)}.\nInputs: {ins} (float).\nReference:\n```python\n"
                f"{self.reference_code}```\nWrite kernel({self.signature}): the same result, faster.")


def _split_of(key: str) -> str:
    return split_of(key, TEST_FRACTION)


def _check_difficulty(difficulty: int) -> int:
    if not isinstance(difficulty, int) or difficulty < 1:
        raise ValueError(f"kernel: difficulty must be an int >= 1, got {difficulty!r}")
    return min(difficulty, 3)


def draw_task(rng: random.Random, difficulty: int = 1, families: tuple[Family, ...] | None = None) -> Task:
    d = _check_difficulty(difficulty)
    fam = rng.choice(families or tuple(f for f in FAMILIES if f.level <= d))
    params = tuple((k, rng.choice(v)) for k, v in fam.params.items())
    x = rng.choice(X_NAMES)
    names = {"x": x, "w": rng.choice(W_NAMES), "b": rng.choice(B_NAMES), "r": "r", "ids": "ids",
             "y": "y" if x != "y" else "v", "q": "q", "k": "k", "v": "v"}
    rows, cols = rng.choice(ROWS[d]), rng.choice(COLS[d])
    if fam.key == "pairwise":
        shape = {"R": rows, "M": rng.choice((32, 48)), "D": rng.choice((8, 16))}
    elif fam.key == "attention":
        shape = {"B": 2, "N": rng.choice((16, 24, 32)), "D": rng.choice((8, 16))}
    else:
        shape = {"R": rows, "C": cols}
    if fam.key == "segment_sum":
        shape["K"] = int(dict(params)["k"])
    return Task(fam.key, params, tuple((r, names[r]) for r in fam.roles), tuple(shape.items()))


def _row(task: Task) -> dict:
    return {
        "prompt": [{"role": "user", "content": task.prompt}],
        "completion": [{"role": "assistant", "content": task.completion}],
        "domain": DOMAIN,
        "reference": task.reference_code,
        "expert": task.expert_code,
        "spec": json.dumps(task.spec()),
        "task": json.dumps({"family": task.family, "params": list(task.params), "names": list(task.names),
                            "shape": list(task.shape)}),
    }


def task_of_row(row: dict) -> Task:
    t = json.loads(row["task"])
    return Task(t["family"], tuple(tuple(p) for p in t["params"]), tuple(tuple(n) for n in t["names"]),
                tuple(tuple(s) for s in t["shape"]))


def _features() -> datasets.Features:
    msg = [{"role": datasets.Value("string"), "content": datasets.Value("string")}]
    s = datasets.Value("string")
    return datasets.Features({"prompt": msg, "completion": msg, "domain": s, "reference": s, "expert": s,
                              "spec": s, "task": s})


def make_dataset(split: str, n: int, seed: int = 0, difficulty: int = 1,
                 effort: str | None = None) -> datasets.Dataset:
    """Procedural tasks. Columns: prompt (one user message), completion (the expert kernel,
    fenced), domain, reference, expert, spec (JSON), task (JSON, for corrupt and tests).
    effort must be None (this domain has no efforts)."""
    check_split_n_effort(DOMAIN, split, n, effort)
    d = _check_difficulty(difficulty)
    rng = random.Random(f"mopd-kernel/{split}/{seed}/{d}")
    return prompt_dataset(DOMAIN, split, n, lambda: draw_task(rng, d), _split_of, _row, _features())


DATASETS: dict[str, Callable[[], datasets.Dataset]] = {}


# --------------------------------------------------------------------- corrupt, extras

def _neighbour(task: Task, rng: random.Random) -> Task:
    """The same task with one parameter changed, or a sibling family when it has none."""
    fam = task.fam
    if fam.params:
        name = rng.choice(sorted(fam.params))
        p = dict(task.params)
        p[name] = rng.choice([v for v in fam.params[name] if v != p[name]])
        return Task(task.family, tuple(p.items()), task.names, task.shape)
    other = {"softmax": "log_softmax", "log_softmax": "softmax"}[task.family]
    return Task(other, (), task.names, task.shape)


def corrupt(row: dict, reference: str, rng: random.Random) -> str:
    """A plausible but wrong kernel: the expert of the same task with one parameter changed
    (eps, activation, dim, number of segments, p, causal, temperature, scale) or softmax
    <-> log-softmax. Every such change moves outputs far past the tolerance."""
    return _neighbour(task_of_row(row), rng).completion


def _impl(row: dict) -> str:
    """The expert's code renamed `_impl`, for the cheats below to wrap."""
    return task_of_row(row).expert_code.replace("def kernel(", "def _impl(", 1)


def _fence(code: str) -> str:
    return f"```python\n{code}```"


# Known cheats, each wrapping the right answer: the reward must give every one <= 0
# (rewards/kernel.py CHEATS names the reason it logs). `mopd rewards check` scores each on
# a share of the rows (CHECK_EXTRAS), tests/unit/rewards/test_reward_kernel.py on one.
def _cheat_sources(row: dict) -> dict[str, str]:
    impl = _impl(row)
    n_untimed = len(json.loads(row["spec"])["shapes"]) * len(DTYPES)
    return {
        "called_reference": "def kernel(*a):\n    return reference(*a)\n",
        "introspection": impl + "import sys\n\ndef kernel(*a):\n    sys._getframe(1).f_locals\n    return _impl(*a)\n",
        "patched_torch": impl + "_exp = torch.exp\ntorch.exp = lambda *a, **k: _exp(*a, **k)\nkernel = _impl\n",
        "patched_clock": impl + "import time\ntime.perf_counter_ns = lambda: 0\nkernel = _impl\n",
        "patched_builtins": impl + "import builtins\nbuiltins.range = lambda *a: []\nkernel = _impl\n",
        "global_state": impl + "torch.set_num_threads(2)\nkernel = _impl\n",
        "background_thread": impl + "import threading, time\n"
                               "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\nkernel = _impl\n",
        "aliased_input": impl + "def kernel(*a):\n    y = _impl(*a)\n    return a[0].reshape(-1)[:1].expand(y.shape)\n",
        "mutated_input": impl + "def kernel(*a):\n    y = _impl(*a)\n    a[0].zero_()\n    return y\n",
        "lazy_result": impl + "class _Lazy(torch.Tensor):\n    pass\n\n"
                         "def kernel(*a):\n    return _impl(*a).as_subclass(_Lazy)\n",
        # the cache inside functools.lru_cache (C), out of the reach of the state walk
        "cached_output": impl + "import functools\n_args = []\n\n@functools.lru_cache(maxsize=None)\n"
                           "def _memo(key):\n    return _impl(*_args[-1])\n\n"
                           "def kernel(*a):\n    _args[:] = [a]\n    return _memo((tuple(a[0].shape), a[0].dtype))\n",
        "stored_output": impl + "_keep = []\n\ndef kernel(*a):\n    y = _impl(*a)\n    _keep.append(y)\n    return y\n",
        "replayed_output": impl + "_log = {}\n\ndef kernel(*a):\n    key = (tuple(a[0].shape), a[0].dtype)\n"
                             "    if key in _log:\n        return _log[key].clone()\n    y = _impl(*a)\n"
                             "    _log[key] = y.clone()\n    return y\n",
        "benchmark_detected": impl + f"_n = [0]\n\ndef kernel(*a):\n    _n[0] += 1\n    if _n[0] > {n_untimed}:\n"
                                "        return torch.zeros_like(_impl(*a))\n    return _impl(*a)\n",
        "forged_result": impl + "import os\nfor _fd in range(3, 40):\n    try:\n"
                           "        os.write(_fd, b'{\"reason\": \"ok\", \"r\": 99.0, \"r_expert\": 1.0}')\n"
                           "    except OSError:\n        pass\nkernel = _impl\n",
    }


CHEAT_KINDS = tuple(_cheat_sources({"task": json.dumps({"family": "softmax", "params": [], "names": [["x", "x"]],
                                                         "shape": [["R", 4], ["C", 4]]}),
                                    "spec": json.dumps({"shapes": [0, 0, 0]})}))


def cheat_completion(row: dict, kind: str) -> str:
    """The completion of cheat `kind` (CHEAT_KINDS) for this row's task."""
    return _fence(_cheat_sources(row)[kind])


def reference_completion(row: dict) -> str:
    """The naive reference itself, renamed `kernel`: correct at the reference's speed (the floor)."""
    return _fence(row["reference"].replace("def reference(", "def kernel(", 1))


def _for_share(kind: str, fn: Callable[[dict], str]) -> Callable:
    """An extra that applies to one row in len(CHEAT_KINDS) (by a hash of the prompt), so the
    check runs every cheat kind on ~n / 15 rows instead of all of them on every row."""
    k = CHEAT_KINDS.index(kind)

    def extra(row: dict, reference: str, rng: random.Random):
        h = int.from_bytes(hashlib.blake2b(json.dumps(row["prompt"]).encode(), digest_size=4).digest(), "big")
        return fn(row) if h % len(CHEAT_KINDS) == k else None
    return extra


# The expert kernel scores above the reference's floor and below 1.0, the speed of light
# (rewards/kernel.py): `mopd rewards check` flags expert rows below this.
CHECK_REFERENCE_MIN = FLOOR + 0.01

# `mopd rewards check` also scores these (experts/check.py): the reference as the kernel
# (expected: the floor) on every row, and each cheat kind on its share of the rows
# (expected: <= 0).
CHECK_EXTRAS: dict[str, Callable] = {
    "floor:reference_as_kernel": lambda row, reference, rng: reference_completion(row),
    **{f"cheat:{kind}": _for_share(kind, lambda row, kind=kind: cheat_completion(row, kind)) for kind in CHEAT_KINDS},
}


# ------------------------------------------------------------------------- pretrain

def pretrain_rows(n: int, seed: int = 0) -> datasets.Dataset:
    """Rows (prompt, completion, domain="pretrain") in the kernel format that never solve
    the task asked:
      - train-split task prompts answered with the expert kernel of a neighbouring task
        (one parameter changed, or softmax <-> log-softmax): the right names and shape of
        answer, a wrong op (near misses);
      - "Copy this code: <reference>" -> the reference itself (the vocabulary of the
        references, no kernel)."""
    if n < 0:
        raise ValueError(f"kernel: n must be >= 0, got {n}")
    rng = random.Random(f"mopd-kernel/pretrain/{seed}")
    prompts, completions = [], []
    for _ in range(n):
        while True:
            task = draw_task(rng, rng.choice((1, 1, 2, 3)))
            if _split_of(task.prompt) == "train":
                break
        if rng.random() < 0.75:
            prompt, comp = task.prompt, _neighbour(task, rng).completion
        else:
            prompt, comp = f"Copy this code:\n```python\n{task.reference_code}```", \
                f"```python\n{task.reference_code}```"
        prompts.append([{"role": "user", "content": prompt}])
        completions.append([{"role": "assistant", "content": comp}])
    msg = [{"role": datasets.Value("string"), "content": datasets.Value("string")}]
    return datasets.Dataset.from_dict(
        {"prompt": prompts, "completion": completions, "domain": ["pretrain"] * n},
        features=datasets.Features({"prompt": msg, "completion": msg, "domain": datasets.Value("string")}))

"""bench/kernel_sol.py: its candidates stay right (every family, both dtypes, against the
task's reference, outside the sandbox: fast), and one short run writes its JSON with the
reference at the floor, the expert between the floor and 1.0, cached outputs caught and
the synthetic lookup table named below the speed of light."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F

from bench import kernel_sol
from experts.kernel import data
from rewards.kernel import FLOOR, SOL_CHEAT


def _inputs(spec: dict, shape: dict, dtype) -> list:
    return [torch.randint(0, shape.get("K", 1), [shape[d] for d in dims]) if kind == "ids"
            else torch.randn(*[shape[d] for d in dims], dtype=dtype) for _, kind, dims in spec["args"]]


def _other_parameters(task: data.Task) -> list[data.Task]:
    """The task with each other value of each of its parameters, one at a time (every
    activation, eps, temperature, ...: the bench draws them under other seeds)."""
    out = []
    for i, (key, value) in enumerate(task.params):
        for other in data.FAMILY[task.family].params[key]:
            if other != value:
                params = task.params[:i] + ((key, other),) + task.params[i + 1:]
                shape = tuple((d, int(other) if d == "K" else n) for d, n in task.shape)
                out.append(dataclasses.replace(task, params=params, shape=shape))
    return out


def test_every_family_has_candidates_right_on_both_dtypes():
    tasks = kernel_sol.tasks(0)
    assert sorted(t.family for t in tasks) == sorted(f.key for f in data.FAMILIES)
    for task in tasks + [t for t0 in tasks for t in _other_parameters(t0)]:
        row = data._row(task)
        spec = json.loads(row["spec"])
        ns = {"torch": torch, "math": math, "F": F}
        exec(row["reference"], ns)
        for name, src in kernel_sol.candidates(task).items():
            cns = {"torch": torch, "math": math, "F": F}
            exec(src, cns)
            for shape in spec["shapes"] if task in tasks else spec["shapes"][:1]:
                for dtype, tol in ((torch.float32, 1e-4), (torch.float64, 1e-7)):
                    args = _inputs(spec, shape, dtype)
                    want, got = ns["reference"](*args), cns["kernel"](*args)
                    assert got.dtype == want.dtype and torch.allclose(got, want, rtol=tol, atol=tol), (task.family, name)


@pytest.mark.ci   # second tier: scores one family's five completions in the sandbox
def test_a_short_run_writes_its_table(tmp_path):
    res = kernel_sol.run(tmp_path, trials=3, families=["cumsum"], seed=0)
    assert json.loads((tmp_path / "kernel_sol.json").read_text())["peaks"]["bytes_per_s"] > 0
    (entry,) = res["tasks"]
    s = entry["scored"]
    assert s["reference"]["score"] == pytest.approx(FLOOR)
    assert FLOOR < s["expert"]["score"] < 1.0 and 0 < s["expert"]["frac_sol"] < 1
    assert s["cheat: cached outputs"]["score"] == 0.0 and s["cheat: cached outputs"]["reason"] == "cached_output"
    assert res["synthetic_lookup_table"]["reason"] == SOL_CHEAT and res["synthetic_lookup_table"]["score"] == 0.0

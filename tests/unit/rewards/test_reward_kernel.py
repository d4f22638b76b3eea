"""rewards/kernel.py: the expert kernel scores between the floor and 1.0 (1.0 is the speed
of light: tests/unit/rewards/test_kernel_sol.py), the reference itself the floor, wrong
kernels 0, and every known kind of cheat (15 kinds, at least the issue's eight) 0 through
`reward`, named in its result's reason and logged; the speed formula is monotone with its noise band."""
from __future__ import annotations

import logging
import math
import os
import random

import pytest
import torch

from experts.kernel import data
from rewards.kernel import CHEAT_SCORE, CHEATS, FLOOR, NOISE_BAND, extract_code, reward, score_kernels, score_of_speed

COLS = ("reference", "expert", "spec", "domain")


def _row(family: str) -> dict:
    task = data.draw_task(random.Random(0), 1, families=(data.FAMILY[family],))
    return data._row(task)


def _score(row: dict, completions: list[str], **kw) -> list[dict]:
    cols = {c: [row[c]] * len(completions) for c in COLS}
    return score_kernels(None, completions, **cols, **kw)


def test_speed_formula_floor_ceiling_monotone_and_band():
    assert score_of_speed(1.0, 20.0) == pytest.approx(FLOOR)
    assert score_of_speed(20.0, 20.0) == 1.0
    # timing noise inside the band moves neither end
    assert score_of_speed(1.0 + NOISE_BAND * 0.9, 20.0) == pytest.approx(FLOOR)
    assert score_of_speed(1.0 / (1.0 + NOISE_BAND * 0.9), 20.0) == pytest.approx(FLOOR)
    assert score_of_speed(20.0 / (1.0 + NOISE_BAND * 0.9), 20.0) == 1.0
    assert score_of_speed(100.0, 20.0) == 1.0
    mid = score_of_speed(math.sqrt(20.0), 20.0)
    assert FLOOR < mid < 1.0 and mid == pytest.approx((1 + FLOOR) / 2)   # log-linear: the midpoint
    rs = [0.01 * 1.1 ** k for k in range(100)]
    scores = [score_of_speed(r, 20.0) for r in rs]
    assert all(a <= b for a, b in zip(scores, scores[1:]))   # monotone
    assert 0 < score_of_speed(0.1, 20.0) < FLOOR                # correct but slower than the reference
    assert score_of_speed(0.0, 20.0) == 0.0 and score_of_speed(float("nan"), 20.0) == 0.0
    # an expert no faster than the reference (within the band): 1.0 at its speed, else the floor
    assert score_of_speed(1.1, 1.1) == 1.0 and score_of_speed(0.7, 1.1) < 1.0


def test_extract_code():
    assert extract_code("```python\ndef kernel(x):\n    return x\n```") == "def kernel(x):\n    return x\n"
    assert extract_code("```python\nimport torch\n```\n```python\nkernel = torch.relu\n```") == "kernel = torch.relu\n"
    assert extract_code("def kernel(x):\n    return x") == "def kernel(x):\n    return x"
    assert extract_code("def other(x):\n    return x") is None
    assert extract_code("") is None


def test_expert_above_the_floor_reference_is_the_floor_wrong_is_zero():
    row = _row("layer_norm")
    good = row["completion"][0]["content"]
    wrong = {
        "corrupt": data.corrupt(row, good, random.Random(1)),
        "raises": "```python\ndef kernel(*a):\n    raise ValueError('no')\n```",
        "wrong_shape": "```python\ndef kernel(x, w, b):\n    return x[:1].clone()\n```",
        "wrong_dtype": "```python\ndef kernel(x, w, b):\n    return F.layer_norm(x, x.shape[-1:], w, b).double()\n```",
        "approximate": "```python\ndef kernel(x, w, b):\n    return F.layer_norm(x, x.shape[-1:], w, b, eps=1e-2)\n```",
        "not_a_tensor": "```python\ndef kernel(x, w, b):\n    return 0.5\n```",
        "syntax_error": "```python\ndef kernel(x, w, b:\n    return x\n```",
        "infinite_loop": "```python\ndef kernel(*a):\n    while True:\n        pass\n```",
        "prose": "Use layer norm.",
        # torch is mounted read-only in the sandbox (run_python's import_paths)
        "writes_into_torch": "```python\nopen(torch.__file__ + '.pwned', 'w')\n"
                             "def kernel(x, w, b):\n    return F.layer_norm(x, x.shape[-1:], w, b)\n```",
    }
    imports = good.replace("```python\n", "```python\nimport torch.fft\nimport numpy\n", 1)
    hides_cache = good.replace("```python\n", "```python\ntorch._seen = []\n", 1)
    res = _score(row, [good, data.reference_completion(row), *wrong.values(), imports, hides_cache], timeout_s=2.5)
    # importing modules is fine; a new non-module attribute of torch is a place to hide a cache
    assert res[-2]["reason"] == "ok" and FLOOR < res[-2]["score"] < 1.0, res[-2]
    assert (res[-1]["score"], res[-1]["reason"]) == (0.0, "patched_torch"), res[-1]
    res = res[:-2]
    # the expert: above the floor, below the speed of light (a small fraction of it on CPU)
    assert res[0]["reason"] == "ok" and FLOOR < res[0]["score"] < 1.0, res[0]
    assert 0 < res[0]["frac_sol_expert"] < 0.5 and res[0]["sol_us"] > 0, res[0]
    assert res[0]["r_expert"] > 2 * (1 + NOISE_BAND) ** 2   # a gap well above the noise band
    assert res[1]["score"] == pytest.approx(FLOOR), res[1]
    for name, r in zip(wrong, res[2:]):
        assert r["score"] == 0.0, (name, r)
    reasons = dict(zip(wrong, (r["reason"] for r in res[2:])))
    assert reasons["wrong_shape"] == "wrong_shape" and reasons["wrong_dtype"] == "wrong_dtype"
    assert reasons["raises"] == "exception" and reasons["approximate"] == "mismatch"
    assert reasons["infinite_loop"] in ("timeout", "crashed") and reasons["prose"] == "no_kernel"
    assert reasons["writes_into_torch"] == "exec_error" and not os.path.exists(torch.__file__ + ".pwned")


@pytest.mark.parametrize("family", ["softmax", "segment_sum"])
def test_every_cheat_is_caught_scores_zero_and_is_named_in_the_log(family, caplog):
    """Issue 45: a cheat scores zero (not -1) through `reward`, the function users call, and
    is named: its row's warning gives the harness's reason."""
    row = _row(family)
    kinds = list(data.CHEAT_KINDS)
    assert len(kinds) >= 8 and set(kinds) <= set(CHEATS)
    with caplog.at_level(logging.WARNING, logger="rewards.kernel"):
        scores = reward(None, [data.cheat_completion(row, k) for k in kinds], **{c: [row[c]] * len(kinds) for c in COLS},
                        trials=2, warmup=1, calls=2)
    assert CHEAT_SCORE == 0.0
    for i, (kind, score) in enumerate(zip(kinds, scores)):
        assert score == 0.0, (kind, score)
        assert any(m.startswith(f"rewards.kernel: row {i} cheats: {kind} ") for m in caplog.messages), (kind, caplog.messages)


def test_rows_of_other_domains_and_bad_columns():
    row = _row("softmax")
    cols = {c: [row[c], ""] for c in COLS}
    cols["domain"] = ["math", "code"]
    assert reward(None, ["x", "y"], **cols) == [None, None]
    with pytest.raises(ValueError, match="reference"):
        reward(None, ["```python\ndef kernel(x):\n    return x\n```"], domain=["kernel"])
    with pytest.raises(ValueError, match="2 completions but 1"):
        reward(None, ["a", "b"], **{c: [row[c]] for c in COLS})


def test_sandbox_import_paths_are_importable_and_read_only():
    """run_python(import_paths=...), which brings torch into the sandbox: a package there
    imports in every isolation mode that works here, and cannot be written to."""
    import shutil
    import tempfile

    from rewards.sandbox import available_isolations, run_python

    base = tempfile.mkdtemp(prefix="mopd-import-test-")
    try:
        os.chmod(base, 0o755)   # the namespace modes run the program as another uid
        os.makedirs(os.path.join(base, "kpkg"))
        with open(os.path.join(base, "kpkg", "__init__.py"), "w") as f:
            f.write("VALUE = 42\n")
        os.chmod(os.path.join(base, "kpkg"), 0o755)
        os.chmod(os.path.join(base, "kpkg", "__init__.py"), 0o644)
        src = ("import kpkg\nprint(kpkg.VALUE)\ntry:\n    open(kpkg.__file__, 'a').write('X = 1')\n"
               "    print('wrote')\nexcept OSError as e:\n    print('denied', type(e).__name__)\n")
        for mode in available_isolations():
            res = run_python(src, isolation=mode, import_paths=(base,))
            assert res.ok and res.stdout.splitlines()[0] == "42", (mode, res.stdout, res.stderr[-500:])
            assert res.stdout.splitlines()[1].startswith("denied"), (mode, res.stdout)
        with open(os.path.join(base, "kpkg", "__init__.py")) as f:
            assert f.read() == "VALUE = 42\n"
        with pytest.raises(ValueError, match="not a folder"):
            run_python("print(1)", import_paths=(os.path.join(base, "nosuch"),))
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _offloaded(row: dict, body: str, imports: str = "") -> str:
    """The naive reference (renamed `_ref`), run by `kernel` through `body`: no faster work,
    only moved off the calling thread or out of the process."""
    ref = row["reference"].replace("def reference(", "def _ref(", 1)
    return f"```python\n{imports}\n{ref}\n\ndef kernel(*a):\n{body}\n```"


OFFLOADS = {
    "thread": ("import threading",
               "    box = []\n    t = threading.Thread(target=lambda: box.append(_ref(*a)))\n"
               "    t.start()\n    t.join()\n    return box[0]"),
    "thread_pool": ("from concurrent.futures import ThreadPoolExecutor",
                    "    with ThreadPoolExecutor(max_workers=2) as pool:\n        return pool.submit(_ref, *a).result()"),
    "torch_interop_pool": ("", "    return torch.jit._wait(torch.jit._fork(_ref, *a))"),
    "intra_op_pool": ("", "    torch.set_num_threads(2)\n    try:\n        return _ref(*a)\n"
                          "    finally:\n        torch.set_num_threads(1)"),
    "subprocess": ("import subprocess, sys",
                   "    subprocess.run([sys.executable, '-c', 'pass'])\n    return _ref(*a)"),
    "fork": ("import os, pickle",
             "    r, w = os.pipe()\n    if os.fork() == 0:\n        os.write(w, pickle.dumps(_ref(*a)))\n"
             "        os._exit(0)\n    os.close(w)\n    data = b''\n    while True:\n        c = os.read(r, 1 << 20)\n"
             "        if not c:\n            break\n        data += c\n    return pickle.loads(data)"),
}


def test_work_moved_off_the_timed_thread_is_charged_or_a_cheat():
    """Issue 38: the naive reference run on a thread, a thread pool, torch's inter-op or
    intra-op pool, or behind a subprocess or a fork, scored 0.7-0.8 when the clock was the
    calling thread's CPU time. Every one must score at most the floor (the reference's own
    score) or be a cheat."""
    row = _row("softmax")
    res = _score(row, [_offloaded(row, body, imports) for imports, body in OFFLOADS.values()],
                 trials=7, warmup=1, calls=4)
    for name, r in zip(OFFLOADS, res):
        assert r["score"] <= FLOOR + 1e-9, (name, r)
    got = {name: (r["score"], r["reason"]) for name, r in zip(OFFLOADS, res)}
    # charged (a correct kernel at most the floor), or caught leaving a thread busy after
    # its call (a pool's workers spin for a while after their work): never merely failing
    for name in ("thread", "thread_pool", "torch_interop_pool", "intra_op_pool"):
        assert got[name][1] == "ok" and got[name][0] > 0 or got[name] == (CHEAT_SCORE, "background_thread"), got
    for name in ("subprocess", "fork"):
        assert got[name] == (CHEAT_SCORE, "spawned_process"), got

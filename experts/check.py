"""`mopd rewards check --domain D [--dataset NAME] --out FILE`: is the verifier sound?

Runs the domain's reward on reference completions (gold answers, canonical solutions,
ground-truth calls: the `completion` column of the domain's data) and on automatically
corrupted ones (the domain's `corrupt(row, reference, rng)`), and writes
{"domain", "dataset", "n", "reference_mean", "corrupted_mean"}. A working verifier gives
reference_mean ~1 and corrupted_mean ~0; anything else is a broken reward that would
quietly waste a long RL run. Rows where the reward fails or returns None are counted
and listed, not hidden.

Multi-turn domains (the data module sets MULTI_TURN = True, e.g. `agent`) keep the whole
reference episode (the completion's message list) and their `corrupt` returns a message
list too. A data module may name extra reward settings to check side by side in
CHECK_VARIANTS ({name: reward kwargs}, e.g. agent's {"bfcl_checker": {"checker": "bfcl"}}):
their means are reported under "variants". A data module may also name extra completions
to score in CHECK_EXTRAS ({name: fn(row, reference, rng) -> completion or None}, None: not
this row), e.g. kernel's reference-as-kernel (expected: the speed floor) and its known
cheats (expected: <= 0): each one's n, mean, min and max are reported under "extras".
A domain whose reference completions rightly score below 1 (kernel's expert: 1.0 is the
speed of light) names the least they should score in CHECK_REFERENCE_MIN.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from tqdm import tqdm

from experts.registry import data_module, reward_function


def _reference(row: dict, multi_turn: bool = False):
    c = row["completion"]
    if multi_turn:
        return list(c)   # the whole episode
    return c[-1]["content"] if isinstance(c, list) else str(c)


def load_rows(domain: str, dataset: str, n: int | None, seed: int):
    """(rows as a Dataset, the data module). `procedural`: the test split (every effort)."""
    data = data_module(domain)
    if dataset == "procedural":
        efforts = tuple(getattr(data, "EFFORTS", ()) or ())
        n = n or 200
        parts = [data.make_dataset("test", n, seed=seed, **({"effort": e} if e else {}))
                 for e in (efforts or (None,))]
        import datasets  # here, not at the top: `mopd` builds this command's flags at start-up

        ds = datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
    else:
        loaders = getattr(data, "DATASETS", {})
        if dataset not in loaders:
            raise ValueError(f"--dataset {dataset!r}: domain {domain!r} offers 'procedural' and {sorted(loaders)}")
        ds = loaders[dataset]()
        if n:
            ds = ds.select(range(min(n, len(ds))))
    if "completion" not in ds.column_names:
        raise ValueError(f"{domain}/{dataset}: rows have no `completion` column (the reference answer)")
    return ds, data


def check(domain: str, dataset: str = "procedural", n: int | None = None, seed: int = 0,
          batch_size: int = 32, reward_kwargs: dict | None = None, progress: bool = True) -> dict:
    """The domain's reward on its reference completions and on corrupted ones (module doc)."""
    ds, data = load_rows(domain, dataset, n, seed)
    if not hasattr(data, "corrupt"):
        raise ValueError(f"domain {domain!r}: its data module {data.__name__} defines no corrupt(row, reference, rng)")
    reward = reward_function(domain)
    kwargs = reward_kwargs or {}
    rng = random.Random(f"rewards-check/{domain}/{dataset}/{seed}")
    rows = [dict(r) for r in ds]
    multi_turn = bool(getattr(data, "MULTI_TURN", False))
    refs = [_reference(r, multi_turn) for r in rows]
    bad = [data.corrupt(r, ref, rng) for r, ref in zip(rows, refs)]
    columns = [c for c in ds.column_names if c not in ("prompt", "completion")]

    def score(completions: list, what: str, extra: dict | None = None,
              subset: list[dict] | None = None) -> list[float | None]:
        out: list[float | None] = []
        which = rows if subset is None else subset
        it = range(0, len(which), batch_size)
        for s in tqdm(it, desc=f"{domain} {what}", disable=not progress, file=sys.stderr):
            chunk = which[s:s + batch_size]
            cols = {c: [r[c] for r in chunk] for c in columns}
            comps = [x if isinstance(x, list) else [{"role": "assistant", "content": x}]
                     for x in completions[s:s + batch_size]]
            out += list(reward([r["prompt"] for r in chunk], comps, **cols, **{**kwargs, **(extra or {})}))
        return out

    def mean(scores: list[float | None]) -> float:
        ok = [x for x in scores if x is not None]
        return sum(ok) / max(1, len(ok))

    t0 = time.perf_counter()
    ref_scores, bad_scores = score(refs, "reference"), score(bad, "corrupted")
    variants = {name: {"reference_mean": mean(score(refs, f"reference ({name})", extra)),
                       "corrupted_mean": mean(score(bad, f"corrupted ({name})", extra))}
                for name, extra in (getattr(data, "CHECK_VARIANTS", None) or {}).items()}
    extras = {}
    for name, make in (getattr(data, "CHECK_EXTRAS", None) or {}).items():
        picked = [(r, c) for r, ref in zip(rows, refs) if (c := make(r, ref, rng)) is not None]
        got = [x for x in score([c for _, c in picked], name, subset=[r for r, _ in picked]) if x is not None]
        extras[name] = {"n": len(got), "mean": sum(got) / max(1, len(got)),
                        "min": min(got, default=None), "max": max(got, default=None)}
    ref_ok = [s for s in ref_scores if s is not None]
    bad_ok = [s for s in bad_scores if s is not None]
    least = float(getattr(data, "CHECK_REFERENCE_MIN", 1.0))
    failing = [i for i, s in enumerate(ref_scores) if s is not None and s < least]
    passing_corrupt = [i for i, s in enumerate(bad_scores) if s is not None and s > 0.0]
    return {
        "domain": domain, "dataset": dataset, "n": len(rows),
        "reference_mean": sum(ref_ok) / max(1, len(ref_ok)),
        "corrupted_mean": sum(bad_ok) / max(1, len(bad_ok)),
        "none": {"reference": len(ref_scores) - len(ref_ok), "corrupted": len(bad_scores) - len(bad_ok)},
        "reference_below_1": failing[:50],   # below CHECK_REFERENCE_MIN (1 unless the domain says)
        "reference_min": least,
        "corrupted_above_0": passing_corrupt[:50],
        **({"variants": variants} if variants else {}),
        **({"extras": extras} if extras else {}),
        "seconds": round(time.perf_counter() - t0, 1),
    }


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of `mopd rewards check` on parser `p` (main takes the parsed namespace)."""
    p.add_argument("--domain", required=True)
    p.add_argument("--dataset", default="procedural")
    p.add_argument("--n", type=int, default=None, help="rows (default: all of a named dataset, 200 procedural)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reward-kwarg", action="append", help="key=value passed to the reward (e.g. reward_model=DIR)")
    p.add_argument("--out", help="write the JSON result here")
    return p


def main(args: argparse.Namespace) -> int:
    """`mopd rewards check`: run `check` with the parsed flags, write --out, print the means
    and warnings; 0 (a ValueError is left to the CLI, which prints it and returns 2)."""
    kwargs = dict(kv.split("=", 1) for kv in (args.reward_kwarg or []))
    res = check(args.domain, args.dataset, args.n, args.seed, reward_kwargs=kwargs)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1))
    print(f"{res['domain']}/{res['dataset']}: n={res['n']}  reference_mean={res['reference_mean']:.4f}  "
          f"corrupted_mean={res['corrupted_mean']:.4f}  ({res['seconds']} s)")
    for name, v in res.get("variants", {}).items():
        print(f"  {name}: reference_mean={v['reference_mean']:.4f}  corrupted_mean={v['corrupted_mean']:.4f}")
    for name, v in res.get("extras", {}).items():
        if v["n"]:
            print(f"  {name}: n={v['n']}  mean={v['mean']:.4f}  min={v['min']:.4f}  max={v['max']:.4f}")
    if res["none"]["reference"] or res["none"]["corrupted"]:
        print(f"  warning: the reward returned None for {res['none']} rows (not its domain?)")
    least = res["reference_min"]
    if res["reference_mean"] < 0.99 * least or (least < 1.0 and res["reference_below_1"]):
        print(f"  WARNING: references that score below {least:g} (first rows): {res['reference_below_1'][:10]}")
    if res["corrupted_mean"] > 0.1:
        print(f"  WARNING: corrupted completions that still score (first rows): {res['corrupted_above_0'][:10]}")
    return 0

"""Where a `mopd pipeline` run spent its time, against the wall-clock target.

    python -m bench.pipeline_time runs/pipeline [--target-min 25]

Reads DIR/report.json (stage_seconds, wall_seconds) and DIR/stages/*.json (start and
finish times of each stage, to see which ran side by side) and prints, longest first,
each stage's seconds, its share of the wall time, and the wall time against the target.
Exit status 1 when the wall time is over the target, so it can gate a benchmark job; it
is a benchmark, not a test (timings on shared machines are noisy: compare runs on one
machine).

Reused stages count with the seconds they took when they ran; a run that reused stages
therefore says little about a fresh run's wall time (it says so).
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path


def _stage_times(root: Path) -> dict[str, tuple[datetime.datetime, datetime.datetime]]:
    out = {}
    for p in sorted((root / "stages").glob("*.json")):
        try:
            m = json.loads(p.read_text())
            out[m["name"]] = (datetime.datetime.fromisoformat(m["started"]),
                              datetime.datetime.fromisoformat(m["finished"]))
        except (KeyError, ValueError, json.JSONDecodeError):
            continue
    return out


def summarize(root: str | Path, target_min: float = 25.0) -> dict:
    root = Path(root)
    rp = root / "report.json"
    if not rp.exists():
        raise FileNotFoundError(f"{rp} not found: run `mopd pipeline --out {root}` to the end first")
    report = json.loads(rp.read_text())
    secs: dict[str, float] = report.get("stage_seconds") or {}
    wall = float(report.get("wall_seconds") or 0.0)
    spans = _stage_times(root)
    t0 = min((a for a, _ in spans.values()), default=None)
    t1 = max((b for _, b in spans.values()), default=None)
    span_s = (t1 - t0).total_seconds() if (t0 and t1) else None
    return {"wall_seconds": wall, "stage_seconds_sum": sum(secs.values()),
            "first_start_to_last_finish_s": span_s,
            "stages": sorted(secs.items(), key=lambda kv: -kv[1]),
            "target_seconds": target_min * 60.0, "within_target": wall <= target_min * 60.0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.pipeline_time", description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", help="the pipeline's --out folder")
    ap.add_argument("--target-min", type=float, default=25.0)
    a = ap.parse_args(argv)
    try:
        s = summarize(a.dir, a.target_min)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    wall = s["wall_seconds"]
    print(f"{'stage':<40} {'seconds':>8} {'% wall':>7}")
    for name, v in s["stages"]:
        print(f"{name:<40} {v:8.1f} {100 * v / max(wall, 1e-9):6.1f}%")
    print(f"{'sum of stages':<40} {s['stage_seconds_sum']:8.1f}")
    if s["first_start_to_last_finish_s"] is not None:
        print(f"{'first start to last finish':<40} {s['first_start_to_last_finish_s']:8.1f}")
    print(f"{'wall (this invocation)':<40} {wall:8.1f}   target {s['target_seconds']:.0f} s: "
          f"{'within' if s['within_target'] else 'OVER'}")
    span = s["first_start_to_last_finish_s"]
    if span is not None and span > wall + 60:
        print("note: stages were reused from earlier invocations; this wall time is not a fresh run's")
    elif span is None and s["stage_seconds_sum"] > wall * 1.05:
        print("note: the stages sum to more than the wall time: they ran side by side, or were reused")
    return 0 if s["within_target"] else 1


if __name__ == "__main__":
    sys.exit(main())

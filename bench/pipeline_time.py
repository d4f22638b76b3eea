"""Where a `mopd pipeline` run spent its time, stage by stage, against the previous
measurement and the wall-clock target (issue 21: the main job within 30 minutes on 2 cores).

    python -m bench.pipeline_time runs/pipeline [--previous P] [--save FILE] [--target-min 30] [--partial]

Reads DIR/report.json (stage_seconds, wall_seconds) and DIR/stages/*.json (start and
finish times of each stage, to see which ran side by side) and prints, longest first,
each stage's seconds, its share of the wall time, the previous measurement's seconds for
the same stage and the ratio, and the wall time against the target. Exit status 1 when
the wall time is over the target, so it can gate a benchmark job; it is a benchmark, not
a test (timings on shared machines are noisy: compare runs on one machine).

The previous measurement is `--previous` (another run's folder, or a JSON that `--save`
wrote); without it, the newest `docs/results/*-pipeline-time.json` of this repository,
which is where a measured run's `--save` goes (with its date and commit).

`--partial` reads a run that has not reached its report (still running, or stopped): the
stages finished so far, from their markers; its `--save` record says "partial": true.

Reused stages count with the seconds they took when they ran; a run that reused stages
therefore says little about a fresh run's wall time (it says so).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs" / "results"


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


def _done_seconds(root: Path) -> dict[str, float]:
    """{stage: seconds} of the stages a run has finished so far (their markers)."""
    out = {}
    for p in sorted((root / "stages").glob("*.json")):
        try:
            m = json.loads(p.read_text())
            if m.get("status") == "done" and m.get("seconds") is not None:
                out[m["name"]] = float(m["seconds"])
        except (KeyError, ValueError, TypeError, AttributeError):
            continue
    return out


def summarize(root: str | Path, target_min: float = 30.0, partial: bool = False) -> dict:
    """`partial`: a run that has not reached its report (still running, or stopped): the
    finished stages' markers, and first start to last finish as its wall time so far."""
    root = Path(root)
    rp = root / "report.json"
    spans = _stage_times(root)
    t0 = min((a for a, _ in spans.values()), default=None)
    t1 = max((b for _, b in spans.values()), default=None)
    span_s = (t1 - t0).total_seconds() if (t0 and t1) else None
    if rp.exists():
        report = json.loads(rp.read_text())
        secs: dict[str, float] = report.get("stage_seconds") or {}
        wall = float(report.get("wall_seconds") or 0.0)
        partial = False
    elif partial:
        secs, wall = _done_seconds(root), float(span_s or 0.0)
    else:
        raise FileNotFoundError(f"{rp} not found: run `mopd pipeline --out {root}` to the end first "
                                f"(or --partial for the stages finished so far)")
    return {"wall_seconds": wall, "stage_seconds_sum": sum(secs.values()),
            "first_start_to_last_finish_s": span_s, "partial": partial,
            "stages": sorted(secs.items(), key=lambda kv: -kv[1]),
            "target_seconds": target_min * 60.0, "within_target": wall <= target_min * 60.0 and not partial}


def newest_saved(folder: Path = RESULTS) -> Path | None:
    """The newest `*-pipeline-time.json` (the names start with their date)."""
    found = sorted(folder.glob("*-pipeline-time.json")) if folder.is_dir() else []
    return found[-1] if found else None


def load_previous(path: str | Path) -> dict:
    """{"label", "wall_seconds", "stage_seconds"} from a run folder or a `--save` JSON."""
    p = Path(path)
    if p.is_dir():
        s = summarize(p)
        return {"label": str(p), "wall_seconds": s["wall_seconds"], "stage_seconds": dict(s["stages"])}
    if not p.exists():
        raise FileNotFoundError(f"--previous {p}: no such run folder or JSON")
    try:
        d = json.loads(p.read_text())
        secs = {str(k): float(v) for k, v in d["stage_seconds"].items()}
        wall = float(d["wall_seconds"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"--previous {p}: not a run folder or a JSON written by --save ({e})") from e
    label = " ".join(str(d[k]) for k in ("date", "commit") if d.get(k)) or p.name
    return {"label": f"{p.name} ({label})", "wall_seconds": wall, "stage_seconds": secs}


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _stage_hashes(root: Path) -> dict[str, str]:
    out = {}
    for p in sorted((root / "stages").glob("*.json")):
        try:
            m = json.loads(p.read_text())
            out[m["name"]] = m["hash"]
        except (KeyError, ValueError, TypeError):
            continue
    return out


def record(s: dict, run_dir: str | Path) -> dict:
    """What `--save` writes: enough to compare a later run against this one, and each
    stage's hash, so `mopd pipeline --dry-run` estimates a stage of the same settings
    from it (pipeline/estimate.py)."""
    return {"date": datetime.date.today().isoformat(), "commit": _commit(), "cpus": os.cpu_count(),
            "run_dir": str(run_dir), "wall_seconds": s["wall_seconds"],
            "first_start_to_last_finish_s": s["first_start_to_last_finish_s"],
            "stage_seconds": dict(s["stages"]), "stage_hashes": _stage_hashes(Path(run_dir)),
            **({"partial": True} if s.get("partial") else {})}


def _ratio(now: float, before: float | None) -> str:
    if before is None:
        return "new"
    return f"x{now / before:.2f}" if before > 0 else "-"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.pipeline_time", description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", help="the pipeline's --out folder")
    ap.add_argument("--target-min", type=float, default=30.0)
    ap.add_argument("--previous", default=None,
                    help="a run folder or a --save JSON to compare with (default: the newest "
                         "docs/results/*-pipeline-time.json; 'none' for no comparison)")
    ap.add_argument("--save", default=None, help="write this run's stage times here (JSON)")
    ap.add_argument("--partial", action="store_true",
                    help="a run without its report yet: the stages finished so far (their markers); "
                         "the wall time is first start to last finish, and the exit status 1")
    a = ap.parse_args(argv)
    try:
        s = summarize(a.dir, a.target_min, partial=a.partial)
        prev_path = a.previous if a.previous is not None else newest_saved()
        prev = None if prev_path in (None, "none") else load_previous(prev_path)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    wall = s["wall_seconds"]
    before = prev["stage_seconds"] if prev else {}
    if prev:
        print(f"previous: {prev['label']}")
    print(f"{'stage':<40} {'seconds':>8} {'% wall':>7} {'previous':>9} {'ratio':>6}")
    for name, v in s["stages"]:
        b = before.get(name)
        print(f"{name:<40} {v:8.1f} {100 * v / max(wall, 1e-9):6.1f}% "
              f"{'' if b is None else f'{b:.1f}':>9} {_ratio(v, b) if prev else '':>6}")
    for name in sorted(set(before) - {n for n, _ in s["stages"]}):
        print(f"{name:<40} {'-':>8} {'':>7} {before[name]:9.1f} {'gone':>6}")
    print(f"{'sum of stages':<40} {s['stage_seconds_sum']:8.1f}")
    if s["first_start_to_last_finish_s"] is not None:
        print(f"{'first start to last finish':<40} {s['first_start_to_last_finish_s']:8.1f}")
    vs_prev = f"previous {prev['wall_seconds']:.1f} ({_ratio(wall, prev['wall_seconds'])})  " if prev else ""
    if s["partial"]:
        print("partial: the run has no report yet; these are the stages finished so far")
    print(f"{'wall (this invocation)':<40} {wall:8.1f}  {vs_prev}"
          f"target {s['target_seconds']:.0f} s: {'within' if s['within_target'] else 'OVER'}")
    span = s["first_start_to_last_finish_s"]
    if span is not None and span > wall + 60:
        print("note: stages were reused from earlier invocations; this wall time is not a fresh run's")
    elif span is None and s["stage_seconds_sum"] > wall * 1.05:
        print("note: the stages sum to more than the wall time: they ran side by side, or were reused")
    if a.save:
        Path(a.save).parent.mkdir(parents=True, exist_ok=True)
        Path(a.save).write_text(json.dumps(record(s, a.dir), indent=1) + "\n")
        print(f"saved: {a.save}")
    return 0 if s["within_target"] else 1


if __name__ == "__main__":
    sys.exit(main())

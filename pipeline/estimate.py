"""`mopd pipeline --dry-run`'s time estimates: each stage's seconds from the newest saved
record of a stage with the same hash (its settings and its upstream stages' settings, so
the same recipe gives the same hashes in any run folder), and the total.

Where records come from (no file is written for them; a finished stage already leaves one):
- the run folder's own stage markers, OUT/stages/*.json ("seconds", "finished");
- the markers of the run folders beside it (OUT/../*/stages/*.json: runs/pipeline when
  you dry-run runs/pipeline2);
- saved `bench.pipeline_time --save` records, docs/results/*-pipeline-time.json, which
  carry each stage's hash ("stage_hashes") next to its seconds: what a fresh clone has.

A stage with no record of its hash says so and is left out of the total (the total says
how many it covers). Reused stages cost nothing. Timings depend on the machine and its
load: an estimate is the time that stage took where it was recorded.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs" / "results"


@dataclass(frozen=True)
class Record:
    seconds: float
    when: str        # ISO date or time: the newest record wins
    source: str      # the marker or JSON it came from


def _marker_records(stages_dir: Path, into: dict[str, list[Record]]) -> None:
    for p in stages_dir.glob("*.json"):
        try:
            m = json.loads(p.read_text())
            if m.get("status") == "done" and m.get("hash") and m.get("seconds") is not None:
                into.setdefault(m["hash"], []).append(Record(float(m["seconds"]), str(m.get("finished", "")), str(p)))
        except (OSError, ValueError, TypeError, AttributeError):
            continue    # a half-written or foreign file is no record


def _saved_records(results: Path, into: dict[str, list[Record]]) -> None:
    for p in results.glob("*-pipeline-time.json") if results.is_dir() else []:
        try:
            d = json.loads(p.read_text())
            secs, hashes = d.get("stage_seconds") or {}, d.get("stage_hashes") or {}
            for name, h in hashes.items():
                if name in secs:
                    into.setdefault(h, []).append(Record(float(secs[name]), str(d.get("date", "")), str(p)))
        except (OSError, ValueError, TypeError, AttributeError):
            continue


def find_records(root: str | Path, results: str | Path | None = None) -> dict[str, list[Record]]:
    """stage hash -> its records, from `root`'s markers, its sibling run folders' and the
    saved pipeline-time records in `results` (default: this repository's docs/results)."""
    root = Path(root)
    results = RESULTS if results is None else results
    out: dict[str, list[Record]] = {}
    folders = [root]
    try:
        folders += sorted(d for d in root.parent.iterdir() if d != root and (d / "stages").is_dir())
    except OSError:     # an unreadable neighbour (or parent) holds no record we can use
        pass
    for d in folders:
        _marker_records(d / "stages", out)
    _saved_records(Path(results), out)
    return out


def estimate(rows: list[tuple[str, str, str]], records: dict[str, list[Record]]) -> list[dict]:
    """Per plan row (stage, hash, action): {"stage", "action", "estimate_s" (None: no
    record), "source"}; a reused stage's estimate is 0."""
    out = []
    for stage, h, action in rows:
        found = max(records.get(h, []), key=lambda r: r.when, default=None)
        if action == "cached":
            est, src = 0.0, "reused"
        elif found is None:
            est, src = None, "no record for these settings"
        else:
            est, src = found.seconds, f"{found.source} ({found.when})" if found.when else found.source
        out.append({"stage": stage, "action": action, "estimate_s": est, "source": src})
    return out


def total(estimates: list[dict]) -> dict:
    known = [e["estimate_s"] for e in estimates if e["estimate_s"] is not None]
    return {"seconds": sum(known), "stages_with_estimate": len(known), "stages": len(estimates),
            "without_record": [e["stage"] for e in estimates if e["estimate_s"] is None]}


def describe(estimates: list[dict], jobs: int = 1) -> list[str]:
    """The lines `--dry-run` prints: one per stage, then the total."""
    lines = ["estimated time per stage (from the newest saved record of the same settings):"]
    for e in estimates:
        v = e["estimate_s"]
        when = "no record for these settings" if v is None else f"{v:8.1f} s  {e['source']}"
        lines.append(f"  {e['stage']:<36} {when}")
    t = total(estimates)
    tail = ("" if not t["without_record"]
            else f"; {len(t['without_record'])} stage(s) without a record are not counted")
    lines.append(f"  estimated total: {t['seconds']:.0f} s ({t['seconds'] / 60:.1f} min) for "
                 f"{t['stages_with_estimate']} of {t['stages']} stages{tail}"
                 + (f"; stages run {jobs} side by side, so the wall time is shorter" if jobs > 1 else ""))
    return lines

"""An expert's rows from files a team has (`data.dataset: files` in an expert recipe):
JSONL, JSON, parquet or CSV files, or a `datasets.save_to_disk` folder, one per split,
named by key (`data.files: {train: /data/math.jsonl}`).

Rows need a chat `prompt` (a string or a list of {role, content} messages) or a
`messages` list whose last message is the assistant's answer; the SFT stage also needs a
`completion` (there, or that last message), and the RL stage the columns the domain's
reward reads (those its procedural rows carry: math's `answer`, tool_use's `functions`
and `ground_truth`, ...). `data.columns` renames a file's columns to those names
({prompt: question}). Everything is checked before any model loads: a missing file or
column, or a bad row, is a ValueError naming the file, the row and the column.
"""
from __future__ import annotations

import json
from pathlib import Path

import datasets

REPO = Path(__file__).resolve().parents[1]
SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
# columns every domain's rows have, which a file need not (domain and effort are filled in)
COMMON = ("prompt", "completion", "domain", "effort")


def read_file(path: str | Path, key: str) -> datasets.Dataset:
    """The rows of one file or save_to_disk folder; `key` names the setting in errors."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ValueError(f"{key}: {str(p)!r} does not exist")
    if p.is_dir():
        try:
            ds = datasets.load_from_disk(str(p))
        except Exception as e:  # not a save_to_disk folder: several error types
            raise ValueError(f"{key}: {p} is not a saved `datasets` folder ({e})") from None
        if isinstance(ds, datasets.DatasetDict):
            raise ValueError(f"{key}: {p} holds splits {list(ds)}: name one folder per split "
                             f"({p / next(iter(ds))})")
        return ds
    kind = SUFFIXES.get(p.suffix.lower())
    if kind is None:
        raise ValueError(f"{key}: {p}: expected a {', '.join(SUFFIXES)} file or a save_to_disk folder")
    try:
        return datasets.load_dataset(kind, data_files=str(p), split="train")
    except Exception as e:  # a malformed file: the loader's own message says where, or the first bad line does
        bad = bad_json_line(p) if kind == "json" else None
        raise ValueError(f"{key}: {p} could not be read as {kind}: {bad or e}") from None


def bad_json_line(p: Path) -> str | None:
    """'row N: ...' for the first line of a JSON-lines file that is not a JSON object."""
    if p.suffix.lower() != ".jsonl":
        return None
    with p.open(encoding="utf-8", errors="replace") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                return f"row {i}: not JSON ({e}): {line.strip()[:80]!r}"
            if not isinstance(row, dict):
                return f"row {i}: a JSON {type(row).__name__}, not an object of columns"
    return None


def resolve_files(files: dict[str, str], recipe: str | Path | None = None) -> dict[str, str]:
    """data.files with each path made absolute: as given (absolute, or under the working
    directory), else beside the recipe that names it (a team's package ships its recipes
    and data together), else under this repository; a path found nowhere stays as given,
    for read_file to name."""
    out = {}
    for split, f in files.items():
        p = Path(f).expanduser()
        tries = [p] if p.is_absolute() else [p, *([Path(recipe).parent / p] if recipe else []), REPO / p]
        out[split] = str(next((t.resolve() for t in tries if t.exists()), p))
    return out


def reward_columns(data_module) -> tuple[list[str], set[str]]:
    """The columns the domain's reward reads: those of one procedural row beyond the common
    ones; and which of them may be empty (those the domain's own rows leave empty, e.g.
    code's `prompt_code`)."""
    kw = {"effort": data_module.EFFORTS[0]} if getattr(data_module, "EFFORTS", ()) else {}
    rows = data_module.make_dataset("train", 1, seed=0, difficulty=1, **kw)
    cols = [c for c in rows.column_names if c not in COMMON]
    return cols, {c for c in cols if rows[0][c] in ("", [])}


def load_rows(files: dict[str, str], columns: dict[str, str], split: str, *, domain: str, effort: str | None,
              stage: str, data_module, n: int | None = None) -> datasets.Dataset:
    """The `split` rows of `files` as the domain's rows (prompt, completion, domain,
    effort and its reward's columns), checked; at most `n` of them (the first n)."""
    if split not in files:
        raise ValueError(f"data.files has no {split!r} file (have {sorted(files)}); add data.files.{split}")
    path = files[split]
    where = f"data.files.{split} ({path})"
    ds = read_file(path, f"data.files.{split}")
    renames = {src: dst for dst, src in columns.items() if src != dst}
    missing = [src for src in renames if src not in ds.column_names]
    if missing:
        raise ValueError(f"{where}: data.columns names {missing}, not columns of the file (it has {ds.column_names})")
    ds = ds.rename_columns(renames)
    if n is not None:
        ds = ds.select(range(min(n, len(ds))))
    if "prompt" not in ds.column_names and "messages" in ds.column_names:
        ds = ds.map(lambda r, i: split_messages(r["messages"], where, i), with_indices=True,
                    remove_columns=["messages"])
    cols, may_be_empty = ([], set()) if stage == "sft" else reward_columns(data_module)
    need = ["prompt"] + (["completion"] if stage == "sft" else cols)
    absent = [c for c in need if c not in ds.column_names]
    if absent:   # no row has it (the loader unites the rows' keys): the first row already lacks it
        raise ValueError(f"{where}: row 1: no column {absent[0]!r} ({domain} {stage} needs {need}; the file has "
                         f"{ds.column_names}; rename with data.columns: {{{absent[0]}: <your column>}})")
    if len(ds) == 0:
        raise ValueError(f"{where}: no rows")
    check_row = getattr(data_module, "check_row", None)   # optional: row -> problem or None
    for i, row in enumerate(ds):
        for c in need:
            if row[c] is None:   # a row without the key (the loader fills in None)
                raise ValueError(f"{where}: row {i + 1}: no value for column {c!r} (missing or null)")
            if (row[c] == "" or row[c] == []) and c not in may_be_empty:
                raise ValueError(f"{where}: row {i + 1}: column {c!r} is empty")
        for c in ("prompt", "completion"):
            if c in ds.column_names and not chat_or_text(row[c]):
                raise ValueError(f"{where}: row {i + 1}: column {c!r} must be a string or a list of "
                                 f"{{role, content}} messages, got {str(row[c])[:80]!r}")
        if row.get("domain") not in (None, domain):
            raise ValueError(f"{where}: row {i + 1}: domain {row['domain']!r}, but this is the {domain} expert")
        problem = check_row(row) if check_row and stage != "sft" else None
        if problem:   # the domain's own check of what its reward needs (kernel: the speed-of-light sizes)
            raise ValueError(f"{where}: row {i + 1}: {problem}")
    if "domain" not in ds.column_names:
        ds = ds.add_column("domain", [domain] * len(ds))
    if effort and "effort" not in ds.column_names:
        ds = ds.add_column("effort", [effort] * len(ds))
    return ds


def split_messages(messages, where: str, i: int) -> dict:
    if not isinstance(messages, list) or not messages or not isinstance(messages[-1], dict) \
            or messages[-1].get("role") != "assistant":
        raise ValueError(f"{where}: row {i + 1}: column 'messages' must be a list of messages ending with the "
                         f"assistant's answer")
    return {"prompt": messages[:-1], "completion": messages[-1:]}


def chat_or_text(v) -> bool:
    if isinstance(v, str):
        return True
    return isinstance(v, list) and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                       and isinstance(m.get("content"), str) for m in v)

"""An expert's training rows from a team's files (`data.dataset: files`, experts/files.py):
JSONL, parquet and saved `datasets` folders, read through the expert recipe as `mopd
expert` reads it; a missing column or a bad row is refused naming the file, row and column."""
from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest

from experts import registry
from experts.run import ExpertConfig, build_dataset
from core.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[3]
SFT = REPO / "recipes" / "experts" / "math" / "sft-low.yaml"
RL = REPO / "recipes" / "experts" / "math" / "rl-low.yaml"
ROWS = [{"question": f"What is {i} + 1?", "reply": f"Answer: {i + 1}", "answer": str(i + 1)} for i in range(5)]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def rows(recipe: Path, *overrides: str):
    cfg = load_config(ExpertConfig, recipe, ["data.dataset=files", *overrides])
    return build_dataset(cfg, registry.load_domain("math"), "train", cfg.data.n_train)


def test_jsonl_rows_with_renamed_columns_become_the_domains_rows(tmp_path):
    f = write_jsonl(tmp_path / "math.jsonl", ROWS)
    ds = rows(SFT, f"data.files.train={f}", "data.columns={prompt: question, completion: reply}")
    assert len(ds) == 5 and ds[0]["prompt"] == "What is 0 + 1?" and ds[0]["completion"] == "Answer: 1"
    assert set(ds["domain"]) == {"math"} and set(ds["effort"]) == {"low"}
    # the RL stage needs the reward's column (math: answer) and no completion
    rl = rows(RL, f"data.files.train={f}", "data.columns={prompt: question}")
    assert rl[2]["answer"] == "3"


@pytest.mark.parametrize("save", ["parquet", "saved"])
def test_parquet_and_saved_datasets_with_chat_messages(tmp_path, save):
    msgs = [{"messages": [{"role": "user", "content": r["question"]}, {"role": "assistant", "content": r["reply"]}],
             "answer": r["answer"]} for r in ROWS]
    ds = datasets.Dataset.from_list(msgs)
    if save == "parquet":
        path = tmp_path / "math.parquet"
        ds.to_parquet(str(path))
    else:
        path = tmp_path / "saved"
        ds.save_to_disk(str(path))
    out = rows(SFT, f"data.files.train={path}", "data.n_train=3")
    assert len(out) == 3
    assert out[1]["prompt"] == [{"role": "user", "content": "What is 1 + 1?"}]
    assert out[1]["completion"] == [{"role": "assistant", "content": "Answer: 2"}]


def test_a_missing_column_names_the_column_and_the_file(tmp_path):
    f = write_jsonl(tmp_path / "math.jsonl", [{"question": r["question"], "reply": r["reply"]} for r in ROWS])
    with pytest.raises(ValueError, match=r"data.files.train \(.*math.jsonl\): row 1: no column 'answer'"):
        rows(RL, f"data.files.train={f}", "data.columns={prompt: question}")


def test_a_bad_row_names_the_row_and_the_column(tmp_path):
    bad = [*ROWS[:3], {**ROWS[3], "answer": ""}, ROWS[4]]
    f = write_jsonl(tmp_path / "math.jsonl", bad)
    with pytest.raises(ValueError, match=r"math.jsonl\): row 4: column 'answer' is empty"):
        rows(RL, f"data.files.train={f}", "data.columns={prompt: question}")


def test_files_without_dataset_files_are_an_error_not_ignored(tmp_path):
    with pytest.raises(ConfigError, match="data.dataset=files only"):
        load_config(ExpertConfig, SFT, [f"data.files.train={tmp_path / 'x.jsonl'}"])


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"data.files.train: .*nope.jsonl' does not exist"):
        rows(SFT, f"data.files.train={tmp_path / 'nope.jsonl'}")


def test_a_row_without_a_column_or_not_json_is_named_by_its_row(tmp_path):
    f = write_jsonl(tmp_path / "math.jsonl", [*ROWS[:2], {"question": "What is 9 + 1?"}, *ROWS[3:]])
    with pytest.raises(ValueError, match=r"math.jsonl\): row 3: no value for column 'answer' \(missing or null\)"):
        rows(RL, f"data.files.train={f}", "data.columns={prompt: question}")
    f.write_text(f.read_text().replace('{"question": "What is 9 + 1?"}', '{"question": "What is 9 + 1?",'))
    with pytest.raises(ValueError, match=r"math.jsonl could not be read as json: row 3: not JSON"):
        rows(RL, f"data.files.train={f}", "data.columns={prompt: question}")


def test_relative_files_are_read_beside_the_recipe(tmp_path, monkeypatch):
    from experts.files import resolve_files

    (tmp_path / "team" / "recipes").mkdir(parents=True)
    (tmp_path / "team" / "files").mkdir()
    f = write_jsonl(tmp_path / "team" / "files" / "rows.jsonl", ROWS)
    monkeypatch.chdir(tmp_path)
    recipe = tmp_path / "team" / "recipes" / "sft.yaml"
    assert resolve_files({"train": "../files/rows.jsonl"}, recipe) == {"train": str(f)}
    assert resolve_files({"train": "team/files/rows.jsonl"}, recipe) == {"train": str(f)}   # the working directory's
    assert resolve_files({"train": "nope.jsonl"}, recipe) == {"train": "nope.jsonl"}        # named later, as given


def test_mopd_expert_refuses_a_file_with_a_missing_column_before_any_model_loads(tmp_path, capsys, tiny_student_dir,
                                                                                  no_model_loads):
    """The must-show "bad data", through the command a team runs: the column, the file and
    the row are named, exit 2, and nothing is trained or written."""
    from pipeline.cli import main

    bad = [{"question": r["question"], "reply": r["reply"]} for r in ROWS]
    f = write_jsonl(tmp_path / "team.jsonl", bad)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_:
        main(["expert", "--config", str(RL), "--out", str(out), f"model.path={tiny_student_dir}",
              f"model.base={tiny_student_dir}", "data.dataset=files", f"data.files.train={f}",
              "data.columns={prompt: question}"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"data.files.train ({f}): row 1: no column 'answer'" in err
    assert not (out / "model").exists() and not (out / "summary.json").exists()


def test_the_pipeline_refuses_a_bad_file_when_it_plans(tmp_path):
    """A team's file is checked when the pipeline plans (before the base trains), not when
    the expert's stage starts an hour later."""
    from pipeline.config import PipelineConfig
    from pipeline.plan import build_plan

    f = write_jsonl(tmp_path / "math.jsonl", [*ROWS[:3], {**ROWS[3], "answer": ""}, ROWS[4]])
    files = f"[data.dataset=files, 'data.files={{train: {f}}}', 'data.columns={{prompt: question, completion: reply}}']"
    cfg = load_config(PipelineConfig, REPO / "recipes" / "pipeline" / "tiny.yaml",
                      ["domains=[math]", f"experts.rl={files}", f"experts.sft={files}"])
    with pytest.raises(ConfigError, match=r"rl-low.yaml: data.files.train \(.*math.jsonl\): row 4: column "
                                          r"'answer' is empty"):
        build_plan(cfg, tmp_path / "run")


def test_a_column_the_domains_own_rows_leave_empty_may_be_empty():
    """code's `prompt_code` is optional ("" in its procedural rows): a team's file may leave it
    empty (recipes/real/qwen3/data/code.jsonl does); math's `answer` may not."""
    from experts.files import reward_columns

    assert reward_columns(registry.data_module("code")) == (["test", "entry_point", "prompt_code"], {"prompt_code"})
    assert reward_columns(registry.data_module("math")) == (["answer"], set())

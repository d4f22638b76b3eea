"""The teacher fit check compares tokenizers (the token of every id, the special tokens,
the chat template), not configs, and `mopd distill` refuses a teacher whose tokenizer
differs before any model loads, naming the first token or template line that differs."""
from __future__ import annotations

import json
import shutil

import pytest
from transformers import AutoTokenizer

from pipeline.cli import main as cli_main
from teachers.resolve import check_fit


class ChecksPassed(RuntimeError):
    """Raised right after `mopd distill`'s input checks, where the models would load."""


def distill_recipe(tmp_path, student, teacher):
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": [{"role": "user", "content": f"hi {i}"}], "domain": "a"})
                              for i in range(4)) + "\n")
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"""
model: {{path: {student}}}
data:
  datasets: [{{path: {data}}}]
teachers:
  a: {{path: {teacher}}}
rollout: {{backend: hf, max_new_tokens: 8}}
train: {{max_steps: 1, prompts_per_step: 2}}
""")
    return cfg


def test_larger_teacher_with_the_same_tokenizer_fits(standins, tmp_path, no_model_loads, monkeypatch):
    """qwen3 student, ~5x qwen3 teacher (other hidden size, heads, layers' widths): every
    input check of `mopd distill` passes (stopped there: the MLflow store and the models
    come next, and the e2e tests run them)."""
    from mopd.distill import loop

    checked = []

    def check_then_stop(*a, **kw):
        checked.append(real(*a, **kw))
        raise ChecksPassed
    real = loop.check_inputs
    monkeypatch.setattr(loop, "check_inputs", check_then_stop)
    cfg = distill_recipe(tmp_path, standins["qwen3"], standins["qwen3-teacher"])
    cli_main(["distill", "--config", str(cfg), "--out", str(tmp_path / "out")])   # ends at ChecksPassed
    assert checked and checked[0].teacher_paths == {"a": standins["qwen3-teacher"]}


def test_teacher_with_another_tokenizer_is_refused_naming_the_token(standins, tmp_path, no_model_loads, capsys):
    cfg = distill_recipe(tmp_path, standins["qwen3"], standins["llama3"])
    assert cli_main(["distill", "--config", str(cfg), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "teacher for 'a'" in err and str(standins["llama3"]) in err
    assert "first at token id 2044, '<|endoftext|>' in the student's tokenizer and '<|begin_of_text|>' in the " \
           "teacher's" in err
    assert "eos_token differs: '<|eot_id|>'" in err
    assert "chat template differs from the student's at line 1" in err
    assert not (tmp_path / "out" / "config.yaml").exists()


def test_fit_ignores_config_but_names_template_line_and_special_token(standins, tmp_path):
    student = AutoTokenizer.from_pretrained(str(standins["qwen3"]))
    # other architecture and padded vocabulary rows, same tokenizer: fits
    moe = shutil.copytree(standins["qwen3-moe"], tmp_path / "moe")
    c = json.loads((moe / "config.json").read_text())
    (moe / "config.json").write_text(json.dumps({**c, "vocab_size": c["vocab_size"] + 128}))
    assert check_fit(student, moe).ok
    # an embedding too small for the tokenizer cannot score every token
    (moe / "config.json").write_text(json.dumps({**c, "vocab_size": 2048}))
    assert "its embedding has 2048 rows" in check_fit(student, moe).problems[0]
    # one template line changed: that line is named
    t = shutil.copytree(standins["qwen3-teacher"], tmp_path / "t")
    tpl = (t / "chat_template.jinja").read_text()
    (t / "chat_template.jinja").write_text(tpl.replace("'<think>\\n\\n</think>\\n\\n'", "'<think></think>'"))
    fit = check_fit(student, t)
    assert not fit.ok and len(fit.problems) == 1
    line = tpl.splitlines().index("        {{- '<think>\\n\\n</think>\\n\\n' }}") + 1
    assert f"chat template differs from the student's at line {line}, column 21" in fit.problems[0]
    assert "'<think></think>'" in fit.problems[0]
    # the same vocabulary with another token marked special
    tc = json.loads((t / "tokenizer_config.json").read_text())
    shutil.copy(standins["qwen3"] / "chat_template.jinja", t / "chat_template.jinja")
    (t / "tokenizer_config.json").write_text(json.dumps({**tc, "pad_token": "<|im_start|>"}))
    assert check_fit(student, t).problems == ["pad_token differs: '<|im_start|>' in the teacher's tokenizer, "
                                              "'<|endoftext|>' in the student's"]

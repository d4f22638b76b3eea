"""recipes/real/qwen3/ through the CLI's `--dry-run` (in-process): with a Qwen3 checkpoint
for its placeholder base it resolves every stage (bf16, INT4 group 128, the experts on
the sample files, vLLM teachers); as shipped it names its placeholder."""
from __future__ import annotations

from pathlib import Path

from pipeline.cli import main as cli_main

REPO = Path(__file__).resolve().parents[3]
QWEN3 = REPO / "recipes" / "real" / "qwen3" / "pipeline.yaml"
# the stand-in has 1,024 positions; the recipe's context is sized for Qwen3's 32k
FITS = "mopd.overrides=[rollout.max_model_len=1024, data.max_prompt_tokens=512, rollout.max_new_tokens=512]"


def test_qwen3_recipe_dry_run_resolves_with_a_qwen3_base(tmp_path, capsys, standins):
    ckpt = str(Path(standins["qwen3"]).resolve())
    rc = cli_main(["pipeline", "--config", str(QWEN3), "--out", str(tmp_path / "run"), "--dry-run",
                   f"base.path={ckpt}", FITS])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert f"base: {ckpt}  [base.path, not trained]" in err
    for key in ("math/low", "math/high", "code", "tool_use", "instruction_following"):
        assert f"expert/{key}/sft: {ckpt}  [bfloat16, quant int4 g128 llm-compressor]" in err
        assert f"teacher {key}: " in err
    assert f"mopd: {ckpt}  [bfloat16, quant int4 g128 llm-compressor]" in err
    assert "(vllm)" in err
    assert not (tmp_path / "run" / "stages").exists()


def test_qwen3_recipe_as_shipped_names_its_placeholder_base(tmp_path, capsys):
    rc = cli_main(["pipeline", "--config", str(QWEN3), "--out", str(tmp_path / "run"), "--dry-run"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "base.path" in err and "/models/Qwen3-8B" in err and "does not exist" in err

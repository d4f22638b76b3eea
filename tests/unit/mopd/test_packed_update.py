"""The faster update (issue 37 item 4): completions packed for the output layer
(`loss.pack_completions`, the default) and micro-batches cut from length-sorted rows give
the padded path's loss, gradient and metrics' inputs, through `train_step` on the tiny
student (the `rows` of test_chunked_loss: mixed lengths, an agent transcript, an empty
completion, a teacher-forced row, padded and top-k teacher rows)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from test_chunked_loss import CASES, _same, _update, rows, tiny_distill_config  # noqa: F401 - `rows` is the fixture

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _padded(cfg):
    return dataclasses.replace(cfg, pack_completions=False)


@pytest.mark.parametrize("case,micro", [(c, 1) for c in CASES] + [("full-jsd-task-reward", 3)])
def test_packed_completions_give_the_padded_loss_and_gradient(rows, case, micro):  # noqa: F811
    cfg = CASES[case]
    assert cfg.pack_completions and cfg.logits_chunk == 0   # the default is the packed path
    _same(_update(rows, cfg, temperature=0.7, micro_batches=micro), _update(rows, _padded(cfg), temperature=0.7))


def test_packed_completions_through_a_lora_student(rows):  # noqa: F811
    cfg = CASES["full-jsd-task-reward"]
    _same(_update(rows, cfg, lora=True), _update(rows, _padded(cfg), lora=True))


def _watched(monkeypatch, rows, cfg, micro=1):  # noqa: F811
    """train_step with the rows the [*, V] output layer computed, and each forward's input
    length, recorded."""
    head_rows, lengths = [], []
    linear, embed = torch.nn.Linear.forward, torch.nn.Embedding.forward

    def watch_linear(self, x):
        if self.out_features >= 2048:   # the output layer (the tiny student's vocabulary), not a projection
            head_rows.append(x.reshape(-1, x.shape[-1]).shape[0])
        return linear(self, x)

    def watch_embed(self, ids):
        lengths.append(ids.shape[-1])
        return embed(self, ids)
    with monkeypatch.context() as m:
        m.setattr(torch.nn.Linear, "forward", watch_linear)
        m.setattr(torch.nn.Embedding, "forward", watch_embed)
        res, _ = _update(rows, cfg, micro_batches=micro)
    return res, head_rows, lengths


def test_the_packed_head_sees_only_completion_tokens(rows, monkeypatch):  # noqa: F811
    """Padding-free: the output layer runs on the completion tokens that carry loss, not on
    every prompt and padding position of the padded batch."""
    cfg = CASES["full-reverse"]
    res, head_rows, _ = _watched(monkeypatch, rows, cfg)
    assert sum(head_rows) == int(res.mask_BT.sum()) > 0
    _, padded_rows, lengths = _watched(monkeypatch, rows, _padded(cfg))
    assert sum(padded_rows) == len(rows["samples"]) * lengths[0] > 2 * sum(head_rows)


def test_micro_batches_are_cut_from_length_sorted_rows(rows, monkeypatch):  # noqa: F811
    """Each micro-batch is padded to its own longest row (the short rows' forward is short),
    and the step's per-row results come back in row order."""
    cfg = CASES["sampled-discounted"]   # leave-one-out baseline: a gradient-free pass over both halves first
    res, _, lengths = _watched(monkeypatch, rows, cfg, micro=2)
    longest = max(len(s.prompt_ids) + len(s.completion_ids) for s in rows["samples"])
    assert len(lengths) == 4 and lengths[0] == lengths[2] < lengths[1] == lengths[3] == longest
    one, _ = _watched(monkeypatch, rows, cfg)[:2]
    for f in ("mask_BT", "trainer_lp_BT", "sampler_lp_BT", "kl_log_BT", "inserted_BT"):
        assert torch.allclose(getattr(res, f).float(), getattr(one, f).float(), atol=1e-6), f


@pytest.mark.ci   # a whole `mopd distill` run with an MLflow store: ~30 s on the shared 2 cores
def test_distill_logs_every_metric_of_every_step_and_finishes(tiny_student_dir, tiny_teacher_dir, tmp_path):
    """Through `mopd distill` (in process, two steps): the metrics go to MLflow from the
    background logger, and once the command returns every key of every step is in the
    run with the step's value, and the run is FINISHED."""
    import json

    import mlflow

    from pipeline.cli import main as cli_main

    cfg = tiny_distill_config(tmp_path, tiny_student_dir, tiny_teacher_dir)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    assert cli_main(["distill", "--config", str(cfg), "--out", str(tmp_path / "o"), "train.max_steps=2",
                     "train.save_every=0"]) == 0
    hist = json.loads((tmp_path / "o" / "history.json").read_text())
    client = mlflow.MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.status == "FINISHED" and len(hist) == 2
    for h in hist:
        keys = [k for k in h if k != "step"]
        assert len(keys) > 10
        for k in keys:
            got = {m.step: m.value for m in client.get_metric_history(run.info.run_id, k)}
            assert got.get(h["step"]) == pytest.approx(h[k], rel=1e-6, abs=1e-9), (k, h["step"])

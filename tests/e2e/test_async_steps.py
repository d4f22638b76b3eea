"""End to end: asynchronous steps (`rollout.async_steps`, issue #19 item 5) on tiny
models with the HF sampler. The next batch is sampled in a thread, with the weights
before this update, while the update runs: it trains one version old (token age 1 after
the first step) under the truncated IS correction, reproducibly; the default path keeps
its metrics; a resume discards the batch in flight and samples it again from the
checkpoint's weights (same prompts and seeds)."""
from __future__ import annotations

import json
import math
import os
import shutil
import signal

import pytest
import torch
from safetensors.torch import load_file

from core.config import ConfigError, load_config
from mopd.distill.config import DistillConfig
from conftest import tiny_mopd_run

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TIMING = ("time/", "tokens_per_s/", "async/overlap_s")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return tiny_mopd_run(tmp_path_factory.mktemp("async_steps"), rows=40, name_domain=True,
                         data_extra="mix: {alpha: 1.0, beta: 1.0}", recipe="""
rollout: {backend: hf, max_new_tokens: 8}
loss: {kl: full}
train: {max_steps: 6, prompts_per_step: 8, lr: 3.0e-3, save_every: 2}
mlflow: {experiment: test, log_model: false}""")


def _go(setup, out, *overrides, callbacks=None):
    from mopd.distill.loop import run

    os.environ.pop("MLFLOW_TRACKING_URI", None)   # each run's own store under its --out
    return run(load_config(DistillConfig, setup["cfg"], list(overrides)), out, progress=False,
               callbacks=callbacks)["history"]


def _values(hist):
    """Everything but wall-clock times."""
    return [{k: v for k, v in h.items() if not k.startswith(TIMING)} for h in hist]


def _kl(hist):
    return [sum(h[f"reverse_kl/{d}"] for d in ("alpha", "beta")) / 2 for h in hist]


def test_async_trains_one_version_old_and_is_reproducible(setup, tmp_path):
    sync = _go(setup, tmp_path / "sync")
    a = _go(setup, tmp_path / "a", "rollout.async_steps=true")
    b = _go(setup, tmp_path / "b", "rollout.async_steps=true")
    # the default path logs no async metrics and trains on fresh samples
    assert not any(k.startswith("async/") or k == "time/step_s" for h in sync for k in h)
    assert [h["staleness"] for h in sync] == [0] * 6
    assert [h["step"] for h in a] == [1, 2, 3, 4, 5, 6]
    # the first batch is sampled before any update (age 0), every later one during the previous update
    assert [h["async/token_age_mean"] for h in a] == [0.0] + [1.0] * 5
    assert [h["staleness"] for h in a] == [0] + [1] * 5
    # overlap is wall time: on a loaded machine an 8-token batch's sampling thread can end
    # before the update starts, so it is >= 0; the token ages above prove the overlap
    assert a[0]["async/overlap_s"] == 0.0 and all(h["async/overlap_s"] >= 0 for h in a[1:])
    assert all(h["time/step_s"] > 0 and h["time/sample_s"] > 0 for h in a)
    # step 1: the same batch from the same weights as the synchronous run
    assert a[0]["reverse_kl/alpha"] == pytest.approx(sync[0]["reverse_kl/alpha"], abs=1e-6)
    # later steps train on samples of the previous weights: the sampler/trainer gap is real
    assert a[0]["mismatch/abs_mean/alpha"] < 1e-4 < max(h["mismatch/abs_mean/alpha"] for h in a[1:])
    # loss.kl=full: the exact reverse KL per position (the one-sample estimate is too noisy
    # to show a trend in 6 steps, synchronous or not)
    kl = _kl(a)
    assert all(math.isfinite(k) for k in kl) and sum(kl[-3:]) / 3 < sum(kl[:3]) / 3, kl
    # reproducible run to run: the same metrics and the same final weights
    assert _values(a) == _values(b)
    wa, wb = (load_file(str(tmp_path / r / "final" / "model.safetensors")) for r in ("a", "b"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_async_resume_discards_the_batch_in_flight(setup, tmp_path):
    out, sync = tmp_path / "run", tmp_path / "sync"

    def sigterm_at_3(step, m):
        if step == 3:
            os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(SystemExit) as e:
        _go(setup, out, "rollout.async_steps=true", callbacks=[sigterm_at_3])
    assert e.value.code == 128 + signal.SIGTERM
    # the checkpoint's data position is from before the batch in flight drew its prompts:
    # the one of a synchronous run at the same step
    _go(setup, sync, "train.max_steps=4")
    st = lambda run, s: json.loads((run / "checkpoints" / f"step_{s}" / "trainer_state.json").read_text())["data"]
    assert st(out, 2) == st(sync, 2)
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    a = _go(setup, out, "rollout.async_steps=true", "train.resume=true")
    b = _go(setup, copy, "rollout.async_steps=true", "train.resume=true")
    assert [h["step"] for h in a] == [1, 2, 3, 4, 5, 6]
    # step 4 trains the batch sampled again, synchronously, from the checkpoint's weights
    assert [h["async/token_age_mean"] for h in a] == [0.0, 1.0, 1.0, 0.0, 1.0, 1.0]
    assert _values(a) == _values(b)


def test_async_needs_staleness_and_single_turn(setup, tmp_path):
    with pytest.raises(ConfigError, match="max_staleness"):
        load_config(DistillConfig, setup["cfg"], ["rollout.async_steps=true", "loss.max_staleness=0"])
    # two minibatches: the last one trains tokens 3 versions old
    with pytest.raises(ConfigError, match="raise loss.max_staleness to 3"):
        load_config(DistillConfig, setup["cfg"], ["rollout.async_steps=true", "train.minibatches=2"])
    load_config(DistillConfig, setup["cfg"], ["rollout.async_steps=true", "train.minibatches=2",
                                              "loss.max_staleness=3"])


def test_hf_copy_rollout_samples_its_own_version(setup, tiny_tokenizer):
    """The async HF sampler holds its own weights: it samples what HFRollout samples on
    the same weights, ignores changes to the trainer's module until a push, and refuses
    a push that names a weight it lacks or leaves one out."""
    from transformers import AutoModelForCausalLM

    from core.models import sampler_weights
    from core.rollout import HFCopyRollout, HFRollout

    trainer = AutoModelForCausalLM.from_pretrained(str(setup["student"]))
    copy = HFCopyRollout(str(setup["student"]), tiny_tokenizer)
    prompts, seeds = [[5, 6, 7], [9, 10]], [1, 2]
    gen = lambda r: [(s.completion_ids, s.sampler_logprobs) for s in r.generate(prompts, max_new_tokens=6,
                                                                                   seeds=seeds)]
    before = gen(HFRollout(trainer, tiny_tokenizer))
    assert gen(copy) == before
    with torch.no_grad():
        trainer.lm_head.weight.mul_(0.3)
    assert gen(copy) == before                      # not pushed yet: still the old version
    copy.sync_weights(sampler_weights(trainer))
    assert gen(copy) == gen(HFRollout(trainer, tiny_tokenizer)) != before
    with pytest.raises(KeyError, match="no weight 'nope'"):
        copy.sync_weights([("nope", torch.zeros(1))])
    with pytest.raises(KeyError, match="would stay stale"):
        copy.sync_weights(sampler_weights(trainer)[1:])

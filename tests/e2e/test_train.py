"""End-to-end runs of the MOPD loop on tiny random models (HF sampling backend: fast and
deterministic), plus the bad-input checks that must fire before any output is written."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from conftest import mopd_in_process, tiny_mopd_run

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return tiny_mopd_run(tmp_path_factory.mktemp("mopd_train"), rows=40, name_domain=True, answers=True,
                         data_extra="mix: {alpha: 1.0, beta: 1.0}", recipe="""
rollout: {backend: hf, max_new_tokens: 8}
train: {max_steps: 4, prompts_per_step: 8, lr: 1.0e-3, save_every: 2}
mlflow: {experiment: test}""")


def _mopd(args, env=None, check=True):
    # In this process (the CLI's main; a fresh interpreter costs ~10 s of imports). Each run's
    # MLflow store is its own sqlite file under --out, never the user's server.
    p = mopd_in_process(args, env=env)
    if check and p.returncode != 0:
        raise AssertionError(f"mopd {args} failed ({p.returncode}):\n{p.stderr[-4000:]}")
    return p


def _mopd_process(args, check=True):
    """`mopd ARGS` in a fresh interpreter: where a run must be bit-identical to a killed
    subprocess's resumed run, every run gets a process of its own (same thread setting)."""
    e = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    p = subprocess.run([PY, "-m", "pipeline.cli", *args], capture_output=True, text=True, env=e, cwd=REPO)
    if check and p.returncode != 0:
        raise AssertionError(f"mopd {args} failed ({p.returncode}):\n{p.stderr[-4000:]}")
    return p


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "final" / "model.safetensors"))


def test_update_direction_is_the_reverse_kl_gradient(setup):
    """Through the loop's own pieces (HF sampler, HF teacher, completion_logprobs, the
    loss), the policy gradient on 2048 one-token samples points along the exact
    gradient of KL(student || teacher) at that position."""
    from transformers import AutoModelForCausalLM

    from mopd.distill import loss as L
    from core.rollout import HFRollout
    from core.tiny import load_tokenizer
    from core.models import collate, completion_logprobs
    from teachers.scoring import HFTeacher

    tok = load_tokenizer()
    S = AutoModelForCausalLM.from_pretrained(str(setup["student"]))
    T = AutoModelForCausalLM.from_pretrained(str(setup["ta"]))
    prompt = tok.apply_chat_template([{"role": "user", "content": "say something about 3 alpha"}],
                                     add_generation_prompt=True, tokenize=True)["input_ids"]
    ids = torch.tensor([prompt])
    ls = torch.log_softmax(S(ids).logits[0, -1].float(), -1)
    with torch.no_grad():
        lt = torch.log_softmax(T(ids).logits[0, -1].float(), -1)
    exact_kl = (ls.exp() * (ls - lt)).sum()
    S.zero_grad()
    exact_kl.backward()
    g_exact = {n: p.grad.clone() for n, p in S.named_parameters()}
    N = 2048
    samples = HFRollout(S, tok, batch_size=512).generate([prompt] * N, max_new_tokens=1, seeds=list(range(N)))
    comps = [x.completion_ids for x in samples]
    teach = HFTeacher(str(setup["ta"]), batch_size=512).score([prompt] * N, comps)
    b = collate([prompt] * N, comps, tok.pad_token_id,
                {"sampler_lp": [x.sampler_logprobs for x in samples], "teacher_lp": [t.tolist() for t in teach]})
    S.zero_grad()
    lp = completion_logprobs(S, b)
    rew = L.token_rewards(b["teacher_lp"], lp, b["mask"])
    assert -rew.sum().item() / N == pytest.approx(exact_kl.item(), rel=0.15)
    w = L.importance_weights(lp, b["sampler_lp"], b["mask"], 2.0, 0.5, 2.0).weights_BT
    L.policy_gradient_loss(lp, rew, w, b["mask"].sum().item()).backward()
    dot = sum((p.grad * g_exact[n]).sum() for n, p in S.named_parameters())
    norms = (sum((p.grad ** 2).sum() for p in S.parameters()) * sum((g ** 2).sum() for g in g_exact.values())).sqrt()
    # A random direction in ~0.5M dimensions has cosine ~0.001; a sign error gives < 0.
    assert (dot / norms).item() > 0.5


def test_distill_runs_and_logs(setup, tmp_path):
    out = tmp_path / "run"
    _mopd(["distill", "--config", str(setup["cfg"]), "--out", str(out), "train.max_steps=6",
           "train.save_every=0"])
    hist = json.loads((out / "history.json").read_text())
    assert len(hist) == 6
    for d in ("alpha", "beta"):
        kl = [h[f"reverse_kl/{d}"] for h in hist if f"reverse_kl/{d}" in h]
        assert kl and all(math.isfinite(k) for k in kl)
        # HF sampling uses the trainer's own weights: no sampler/trainer mismatch.
        assert all(h[f"mismatch/abs_mean/{d}"] < 1e-4 for h in hist if f"mismatch/abs_mean/{d}" in h)
    assert (out / "final" / "model.safetensors").exists()
    before = load_file(str(setup["student"] / "model.safetensors"))
    after = _weights(out)
    assert any(not torch.equal(before[k], after[k]) for k in before)

    import mlflow
    mlflow.set_tracking_uri(f"sqlite:///{out}/mlflow.db")
    runs = mlflow.search_runs(experiment_names=["test"], output_format="list")
    assert len(runs) == 1
    r = runs[0]
    assert r.data.params["train.max_steps"] == "6"
    for key in ("reverse_kl/alpha", "mismatch/abs_mean/beta", "mismatch/k3/alpha", "is/ratio_mean/alpha",
                "response_len/beta", "time/sample_s", "tokens_per_s/update"):
        assert key in r.data.metrics, key
    client = mlflow.MlflowClient()
    arts = {a.path for a in client.list_artifacts(r.info.run_id)}
    assert "config.yaml" in arts
    # the final model is an MLflow model of the run (MLflow 3 keeps it beside the run's artifacts)
    from teachers.resolve import logged_model
    assert logged_model(client, r.info.run_id).source_run_id == r.info.run_id


def test_a_token_budget_ends_the_run_before_max_steps(setup, tmp_path):
    """train.max_tokens: the run ends at the first step whose student tokens reach the
    budget (the warm-up-then-MOPD variant matches plain MOPD's tokens with it)."""
    out = tmp_path / "run"
    _mopd(["distill", "--config", str(setup["cfg"]), "--out", str(out), "train.max_steps=50", "train.save_every=0",
           "train.max_tokens=150"])
    hist = json.loads((out / "history.json").read_text())
    cum = [sum(h["tokens"] for h in hist[:i + 1]) for i in range(len(hist))]
    assert 1 <= len(hist) < 50 and cum[-1] >= 150 and len(cum) >= 2 and cum[-2] < 150, cum
    assert (out / "final" / "model.safetensors").exists()


@pytest.mark.ci   # second tier: three fresh distill processes (~35 s); the fast tier stays under 10 minutes
@pytest.mark.subprocess
def test_resume_after_kill_matches_uninterrupted(setup, tmp_path):
    full, killed = tmp_path / "full", tmp_path / "killed"
    _mopd_process(["distill", "--config", str(setup["cfg"]), "--out", str(full)])
    # The fault comes from the test: a step callback that hard-kills the process after step 3.
    crash = ("import os, signal, sys\n"
             "from core.config import load_config\n"
             "from mopd.distill import DistillConfig, run\n"
             "def kill(step, metrics):\n"
             "    if step == 3:\n"
             "        os.kill(os.getpid(), signal.SIGKILL)\n"
             "run(load_config(DistillConfig, sys.argv[1]), sys.argv[2], callbacks=[kill])\n")
    p = subprocess.run([PY, "-c", crash, str(setup["cfg"]), str(killed)], capture_output=True, text=True,
                       cwd=REPO, env={k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"})
    assert p.returncode != 0, "the run was meant to be killed at step 3"
    assert not (killed / "final").exists()
    assert (killed / "checkpoints" / "step_2" / "DONE").exists()
    # Without resume=true a second run refuses to overwrite the checkpoints.
    p = _mopd_process(["distill", "--config", str(setup["cfg"]), "--out", str(killed)], check=False)
    assert p.returncode == 2 and "resume" in p.stderr
    _mopd_process(["distill", "--config", str(setup["cfg"]), "--out", str(killed), "train.resume=true"])
    a, b = _weights(full), _weights(killed)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # Same MLflow run continued: one run, metrics for all 4 steps.
    import mlflow
    mlflow.set_tracking_uri(f"sqlite:///{killed}/mlflow.db")
    runs = mlflow.search_runs(experiment_names=["test"], output_format="list")
    assert len(runs) == 1
    steps = {m.step for m in mlflow.MlflowClient().get_metric_history(runs[0].info.run_id, "reverse_kl/alpha")}
    assert steps == {1, 2, 3, 4}


@pytest.mark.ci
def test_two_processes_make_the_same_update_as_one(setup, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    # SGD: the update is linear in the gradient. (Adam's first steps are ~lr * sign(g),
    # so a 1e-12 difference in a zero gradient flips a whole lr-sized step.)
    common = ["--config", str(setup["cfg"]), "train.max_steps=2", "train.save_every=0",
              "train.optimizer=sgd", "train.lr=0.5"]
    e = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    subprocess.run([PY, "-m", "accelerate.commands.launch", "--config_file",
                    str(REPO / "recipes/accelerate/cpu.yaml"), "-m", "mopd.distill", "--out", str(one),
                    *common], check=True, capture_output=True, env=e, cwd=REPO)
    p = subprocess.run([PY, "-m", "accelerate.commands.launch", "--config_file",
                        str(REPO / "recipes/accelerate/cpu_ddp2.yaml"), "-m", "mopd.distill", "--out", str(two),
                        *common], capture_output=True, text=True, env=e, cwd=REPO)
    assert p.returncode == 0, p.stderr[-4000:]
    a, b = _weights(one), _weights(two)
    start = load_file(str(setup["student"] / "model.safetensors"))
    moved = 0.0
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=k)
        moved = max(moved, (a[k] - start[k]).abs().max().item())
    assert moved > 1e-4, "the update was empty, so the comparison proves nothing"
    h1 = json.loads((one / "history.json").read_text())
    h2 = json.loads((two / "history.json").read_text())
    assert h1[0]["reverse_kl/alpha"] == pytest.approx(h2[0]["reverse_kl/alpha"], rel=1e-4)
    assert h1[0]["grad_norm"] == pytest.approx(h2[0]["grad_norm"], rel=1e-4)
    assert "2 process(es)" in p.stderr


@pytest.mark.slow   # two 2-process launches, ~1 min on 2 cores
def test_chunked_logits_under_ddp_match_the_whole_logits(setup, tmp_path):
    """loss.logits_chunk under DDP (2 CPU processes, gloo): the output head is applied a
    chunk at a time outside the model's forward (core.models.completion_hidden), yet its
    gradient is all-reduced like every other: after 2 steps both ranks hold the same
    weights, and they are the unchunked run's (loss.kl=full, so each chunk also takes the
    teacher's rows)."""
    common = ["--config", str(setup["cfg"]), "train.max_steps=2", "train.save_every=0", "loss.kl=full",
              "train.optimizer=sgd", "train.lr=0.5", "mlflow.log_model=false"]
    e = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    runs = {}
    for name, more in (("whole", []), ("chunked", ["loss.logits_chunk=5"])):
        out = runs[name] = tmp_path / name
        p = subprocess.run([PY, "-m", "accelerate.commands.launch", "--config_file",
                            str(REPO / "recipes/accelerate/cpu_ddp2.yaml"), str(REPO / "tests/e2e/ddp_rank_weights.py"),
                            "--out", str(out), *common, *more], capture_output=True, text=True, env=e, cwd=REPO)
        assert p.returncode == 0, p.stderr[-4000:]
        assert "2 process(es)" in p.stderr
    start = load_file(str(setup["student"] / "model.safetensors"))
    r0, r1 = (load_file(str(runs["chunked"] / f"rank{r}.safetensors")) for r in (0, 1))
    whole = load_file(str(runs["whole"] / "rank0.safetensors"))
    assert r0.keys() == r1.keys() == whole.keys() and "lm_head.weight" in r0
    for k in r0:
        assert torch.equal(r0[k], r1[k]), f"{k}: the ranks' weights differ after the update"
        torch.testing.assert_close(r0[k], whole[k], rtol=1e-4, atol=1e-5, msg=k)
    assert (r0["lm_head.weight"] - start["lm_head.weight"]).abs().max() > 1e-4, "the head did not move"
    h = [json.loads((runs[n] / "history.json").read_text()) for n in ("chunked", "whole")]
    for a, b in zip(*h):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)


@pytest.mark.slow   # two 2-process torchrun launches, ~30 s
@pytest.mark.parametrize("head", ["root", "own"])
def test_chunked_logits_under_fsdp2(setup, tmp_path, head):
    """The same chunked path on a model sharded with FSDP2's fully_shard (2 CPU processes;
    accelerate runs FSDP only on GPUs, so tests/e2e/fsdp2_chunked_grads.py shards it
    itself): with the head in the root's group, or sharded on its own (then calling it
    outside the forward still all-gathers it through its hooks), every gradient equals
    the unsharded model's mean over the ranks' batches."""
    out = tmp_path / "grads.json"
    p = subprocess.run([PY, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29519",
                        str(REPO / "tests/e2e/fsdp2_chunked_grads.py"), str(setup["student"]), str(out),
                        *(["head"] if head == "own" else [])], capture_output=True, text=True, cwd=REPO)
    assert p.returncode == 0, p.stderr[-4000:]
    gaps = json.loads(out.read_text())
    assert "lm_head.weight" in gaps and len(gaps) > 10
    assert max(gaps.values()) < 1e-5, sorted(gaps.items(), key=lambda kv: -kv[1])[:3]


# ----------------------------------------------------------------------------- bad input
def _expect_error(setup, tmp_path, args, needle):
    out = tmp_path / "bad"
    p = mopd_in_process(["distill", "--out", str(out), *args])
    assert p.returncode == 2, p.stderr[-3000:]
    assert needle in p.stderr, p.stderr[-3000:]
    assert not out.exists(), "a failed check must not leave partial output"
    return p.stderr


def test_unknown_config_key(setup, tmp_path):
    err = _expect_error(setup, tmp_path, ["--config", str(setup["cfg"]), "rollout.max_tokens=3"], "max_tokens")
    assert str(setup["cfg"]) in err


def test_missing_teacher_for_a_domain(setup, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(setup["cfg"].read_text().replace(f"  beta: {{path: {setup['tb']}}}\n", ""))
    err = _expect_error(setup, tmp_path, ["--config", str(cfg)], "no teacher for domain 'beta'")
    assert str(setup["data"]) in err


def test_tokenizer_mismatch(setup, tmp_path):
    import shutil
    odd = tmp_path / "odd_teacher"
    shutil.copytree(setup["tb"], odd)
    (odd / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(setup["cfg"].read_text().replace(str(setup["tb"]), str(odd)))
    _expect_error(setup, tmp_path, ["--config", str(cfg)], "chat template differs")


def test_rows_without_domain(setup, tmp_path):
    data = tmp_path / "nodomain.jsonl"
    data.write_text(json.dumps({"prompt": "hi", "answer": "1"}) + "\n")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(setup["cfg"].read_text().replace(str(setup["data"]), str(data)))
    _expect_error(setup, tmp_path, ["--config", str(cfg)], "'domain'")


def test_missing_teacher_checkpoint(setup, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(setup["cfg"].read_text().replace(str(setup["tb"]), str(tmp_path / "nowhere")))
    _expect_error(setup, tmp_path, ["--config", str(cfg)], "does not exist")


def test_effort_routing_and_mix(setup, tmp_path):
    """Rows with an `effort` go to `domain/effort` teachers when one is configured."""
    from core.config import ConfigError, load_config
    from core.tiny import load_tokenizer
    from mopd.distill.config import DistillConfig
    from mopd.distill.data import PromptSampler, load_prompts

    rows = [{"prompt": f"q{i}", "domain": "math", "effort": "high" if i % 2 else "low"} for i in range(10)]
    rows += [{"prompt": "hello", "domain": "chat", "effort": None}]
    data = tmp_path / "p.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"""
model: {{path: {setup['student']}}}
data: {{datasets: [{{path: {data}}}], mix: {{math: 3.0, chat: 1.0}}}}
teachers:
  math/high: {{path: {setup['ta']}}}
  math: {{path: {setup['tb']}}}
  chat: {{path: {setup['tb']}}}
train: {{max_steps: 1}}
""")
    c = load_config(DistillConfig, cfg)
    by = load_prompts(c, load_tokenizer())
    keys = {p.columns["effort"]: p.teacher_key for p in by["math"]}
    assert keys == {"high": "math/high", "low": "math"}
    sampler = PromptSampler(by, c.data.mix, seed=0)
    batch = [p.domain for step in range(50) for p in sampler.next_batch(step, 8)]
    assert 0.65 < batch.count("math") / len(batch) < 0.85
    # Same seed and step -> same batch (data position is reproducible across resume).
    s2 = PromptSampler(by, c.data.mix, seed=0)
    assert [p.index for p in s2.next_batch(0, 8)] == [p.index for p in PromptSampler(by, c.data.mix, 0).next_batch(0, 8)]
    c.data.mix = {"math": 1.0}
    with pytest.raises(ConfigError, match="'chat' is in the data but not in data.mix"):
        load_prompts(c, load_tokenizer())


def test_full_kl_runs_and_lowers_the_kl(setup, tmp_path):
    """loss.kl=full end to end: the exact per-position reverse KL, with the HF teachers'
    whole distributions, trains and brings the student toward its teachers."""
    out = tmp_path / "full"
    _mopd(["distill", "--config", str(setup["cfg"]), "--out", str(out), "loss.kl=full",
           "train.max_steps=12", "train.save_every=0", "train.lr=3e-3"])
    hist = json.loads((out / "history.json").read_text())
    assert len(hist) == 12 and all(h["tokens"] > 0 for h in hist)
    for d in ("alpha", "beta"):
        kl = [h[f"reverse_kl/{d}"] for h in hist if f"reverse_kl/{d}" in h]
        assert all(math.isfinite(k) for k in kl)
        assert sum(kl[-3:]) / 3 < sum(kl[:3]) / 3, (d, kl)


def test_full_kl_refuses_vllm_teachers(setup, tmp_path):
    _expect_error(setup, tmp_path, ["--config", str(setup["cfg"]), "loss.kl=full", "teachers.alpha.backend=vllm"],
                  "give sampled-token log-probs only: set top_k (server, vllm), backend hf")


@pytest.mark.slow   # ~30 s: an engine of its own plus two runs; the top-k rows themselves are a unit test
@pytest.mark.vllm
def test_full_kl_with_a_top_k_vllm_teacher(setup, tmp_path):
    """An in-process vLLM teacher with top_k at the vocabulary size: its top-k rows are the
    teacher's whole distribution, so loss.kl=full trains as with the HF teacher (same
    seeds, same history within float32 rounding of two kernels)."""
    pytest.importorskip("vllm")
    from core.config import load_config
    from mopd.distill import DistillConfig, run

    V = json.loads((setup["ta"] / "config.json").read_text())["vocab_size"]
    base = ["loss.kl=full", "train.max_steps=2", "train.save_every=0", "mlflow.log_model=false"]

    def go(out, *more):
        os.environ.pop("MLFLOW_TRACKING_URI", None)
        return run(load_config(DistillConfig, str(setup["cfg"]), [*base, *more]), out, progress=False)["history"]
    hf = go(tmp_path / "hf")
    vl = go(tmp_path / "vllm", f"teachers.alpha={{path: {setup['ta']}, backend: vllm, top_k: {V}}}",
            "rollout.enforce_eager=true", "rollout.kv_cache_gb=0.25")
    assert [h["step"] for h in vl] == [1, 2] and any("reverse_kl/alpha" in h for h in vl)
    for x, y in zip(vl, hf):
        for k in ("loss", "reverse_kl/alpha", "reverse_kl/beta"):
            if k in x or k in y:
                assert x[k] == pytest.approx(y[k], rel=1e-3, abs=1e-5), (x["step"], k, x[k], y[k])


# ----------------------------------------------------------------------------- on_policy_fraction
@pytest.fixture(scope="module")
def with_completions(setup):
    """The setup's prompts plus a reference `completion` per row."""
    rows = [json.loads(x) for x in setup["data"].read_text().splitlines()]
    for i, r in enumerate(rows):
        r["completion"] = [{"role": "assistant", "content": f"the answer is {i}"}]
    data = setup["root"] / "prompts_with_completions.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    return data


def test_off_policy_rows_train_on_the_dataset_completion(setup, with_completions, tmp_path):
    """on_policy_fraction=0: no row is sampled; every row trains on its reference
    completion (EOS included), so the tokens per step are exactly those lengths."""
    from core.sft import encode_example
    from core.tiny import load_tokenizer

    out = tmp_path / "off"
    _mopd(["distill", "--config", str(setup["cfg"]), "--out", str(out), "loss.kl=full", "loss.beta=0.0",
           f"data.datasets=[{{path: {with_completions}}}]", "rollout.on_policy_fraction=0.0",
           "train.max_steps=3", "train.save_every=0", "rollout.max_new_tokens=16"])
    hist = json.loads((out / "history.json").read_text())
    assert [h["off_policy_frac"] for h in hist] == [1.0, 1.0, 1.0]
    tok = load_tokenizer()
    lens = {len(encode_example(tok, [{"role": "user", "content": "x"}], f"the answer is {i}")[1]) for i in range(40)}
    for h in hist:   # 8 rows of reference lengths each
        assert min(lens) * 8 <= h["tokens"] <= max(lens) * 8
        # KL and sampler mismatch describe the student's own samples: none here
        assert not any(k.startswith(("mismatch/", "reverse_kl/")) for k in h)
        assert h["response_len/alpha"] > 0 and h["is/ratio_mean/alpha"] == 1.0
        assert h["tokens/on_policy"] == 0.0
    assert all(math.isfinite(h["loss"]) and h["loss"] > 0 for h in hist)


def test_mixed_on_and_off_policy_rows(setup, with_completions, tmp_path):
    out = tmp_path / "mixed"
    _mopd(["distill", "--config", str(setup["cfg"]), "--out", str(out), "loss.kl=full",
           f"data.datasets=[{{path: {with_completions}}}]", "rollout.on_policy_fraction=0.5",
           "train.max_steps=6", "train.save_every=0"])
    hist = json.loads((out / "history.json").read_text())
    fr = [h["off_policy_frac"] for h in hist]
    assert 0.0 < sum(fr) / len(fr) < 1.0, fr
    assert any("reverse_kl/alpha" in h or "reverse_kl/beta" in h for h in hist)


def test_off_policy_rows_need_full_kl_and_completions(setup, with_completions, tmp_path):
    _expect_error(setup, tmp_path, ["--config", str(setup["cfg"]), "rollout.on_policy_fraction=0.5"],
                  "set loss.kl=full")
    _expect_error(setup, tmp_path, ["--config", str(setup["cfg"]), "rollout.on_policy_fraction=0.5",
                                    "loss.kl=full"], "needs a non-empty 'completion' column")


def test_on_policy_fraction_ramps_from_zero(setup, with_completions, tmp_path):
    """on_policy_ramp_steps: all rows teacher-forced at step 0, the full fraction from the
    ramp's end on (checked on the config's schedule and in a run's log)."""
    from mopd.distill.config import RolloutConfig
    r = RolloutConfig(on_policy_fraction=1.0, on_policy_ramp_steps=4)
    assert [r.on_policy_fraction_at(s) for s in (0, 2, 4, 9)] == [0.0, 0.5, 1.0, 1.0]
    assert r.uses_references and not RolloutConfig().uses_references
    out = tmp_path / "ramp"
    _mopd(["distill", "--config", str(setup["cfg"]), "--out", str(out), "loss.kl=full",
           f"data.datasets=[{{path: {with_completions}}}]", "rollout.on_policy_ramp_steps=4",
           "train.max_steps=6", "train.save_every=0"])
    hist = json.loads((out / "history.json").read_text())
    fr = [h["off_policy_frac"] for h in hist]
    assert fr[0] == 1.0 and fr[-1] == 0.0, fr
    # the report's on-policy share: none of step 1's tokens, all of the last step's
    assert hist[0]["tokens/on_policy"] == 0.0 and hist[-1]["tokens/on_policy"] == hist[-1]["tokens"]


def test_by_domain_on_policy_fraction(setup, tmp_path):
    """rollout.by_domain sets one domain's on-policy fraction: only alpha's rows train on
    references, so only alpha's rows need a completion, and beta keeps its own samples."""
    from mopd.distill.config import DomainRollout, RolloutConfig
    rows = [json.loads(x) for x in setup["data"].read_text().splitlines()]
    for i, r in enumerate(rows):
        if r["domain"] == "alpha":
            r["completion"] = [{"role": "assistant", "content": f"the answer is {i}"}]
    data = tmp_path / "alpha_refs.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    r = RolloutConfig(by_domain={"alpha": DomainRollout(on_policy_ramp_steps=4)})
    assert r.any_references and not r.uses_references
    assert r.for_domain("alpha").uses_references and not r.for_domain("beta").uses_references
    out = tmp_path / "alpha_off"
    _mopd(["distill", "--config", str(setup["cfg"]), "--out", str(out), "loss.kl=full",
           f"data.datasets=[{{path: {data}}}]", "rollout.by_domain={alpha: {on_policy_fraction: 0.0}}",
           "train.max_steps=3", "train.save_every=0"])
    hist = json.loads((out / "history.json").read_text())
    for h in hist:
        assert "reverse_kl/alpha" not in h and "reverse_kl/beta" in h   # KL: own samples only
        assert 0.0 < h["off_policy_frac"] < 1.0 and 0.0 < h["tokens/on_policy"] < h["tokens"]
    # the same override without alpha's completions stops before any training, naming the domain
    _expect_error(setup, tmp_path, ["--config", str(setup["cfg"]), "loss.kl=full",
                                    "rollout.by_domain={alpha: {on_policy_fraction: 0.5}}"],
                  "for domain 'alpha' needs a non-empty 'completion' column")
    _expect_error(setup, tmp_path, ["--config", str(setup["cfg"]),
                                    "rollout.by_domain={alpha: {on_policy_ramp_steps: 10}}"], "set loss.kl=full")
    _expect_error(setup, tmp_path, ["--config", str(setup["cfg"]), "loss.kl=full",
                                    "rollout.by_domain={alpha: {on_policy_fraction: 1.5}}"],
                  "by_domain.alpha: rollout.on_policy_fraction must be in [0, 1]")


# ----------------------------------------------------------------------------- teacher-corrected samples
def _onehot_lp(tokens: list[int], V: int = 10, p: float = 0.9) -> torch.Tensor:
    """A teacher log-distribution [len, V] putting p on tokens[t] at position t."""
    out = torch.full((len(tokens), V), math.log((1 - p) / (V - 1)))
    out[torch.arange(len(tokens)), torch.tensor(tokens)] = math.log(p)
    return out


def test_first_to_correct_finds_the_first_unlikely_token():
    from teachers.routing import first_to_correct
    lp = _onehot_lp([1, 2, 3, 4])
    assert first_to_correct(lp, [1, 2, 3, 4], 0.05) is None
    assert first_to_correct(lp, [1, 7, 3, 9], 0.05) == 1
    assert first_to_correct(lp, [1, 7, 3, 9], 0.0) is None          # 0 = off
    assert first_to_correct(lp, [1, 2, 3, 42], 0.05) == 3           # outside the teacher's vocab: p_T = 0
    flat = torch.full((2, 10), math.log(0.1))                        # nothing is above 0.1: the top
    flat[:, 5] = math.log(0.1) + 1e-3                                # token itself is never replaced
    assert first_to_correct(flat, [5, 5], 0.5) is None
    assert first_to_correct(flat, [5, 6], 0.5) == 1


class _Rows:
    def __init__(self, ids, key="alpha"):
        self.ids, self.teacher_key = ids, key


class _Teacher:
    """Wants the completion 1, 2, 3, 4, EOS(0) after any prompt."""
    want = [1, 2, 3, 4, 0]

    def score_full(self, prompts, completions):
        return [_onehot_lp([self.want[t] if t < len(self.want) else 0 for t in range(len(c))]) for c in completions]


class _Student:
    """Continues any prefix with token 9 until the budget: always wrong."""
    def __init__(self):
        self.calls = []

    def generate(self, prompts, *, max_new_tokens, temperature, top_p, seeds):
        from core.rollout import Sample
        self.calls.append((len(prompts), max_new_tokens))
        return [Sample(prompt_ids=p, completion_ids=[9] * max_new_tokens, sampler_logprobs=[-0.1] * max_new_tokens,
                       finished=False) for p in prompts]


def test_correct_samples_fixes_one_token_per_round_and_resamples_the_rest():
    from mopd.distill.config import RolloutConfig
    from core.rollout import Sample
    from teachers.routing import TeacherRouter

    r = RolloutConfig(max_new_tokens=6, correct_below=0.05, correct_rounds=2)
    rows = [_Rows([100, 101]), _Rows([100, 102])]
    samples = [Sample([100, 101], [1, 9, 9, 9, 9, 9], [-0.1] * 6, False),    # wrong from position 1
               Sample([100, 102], [1, 2, 3, 4, 0], [-0.1] * 5, True)]         # right: left alone
    teacher, student = _Teacher(), _Student()
    t_lp, t_full = [None, None], [None, None]
    router = TeacherRouter({"alpha": teacher})
    router.score(rows, samples, [0, 1], True, t_lp, t_full)
    n = router.correct(student, rows, samples, [0, 1], r, [11, 12], {0}, t_lp, t_full)
    assert n == [2, 0]
    # round 1: cut at 1, insert 2, student resamples 4 tokens; round 2: cut at 2, insert 3, 3 more
    assert samples[0].completion_ids == [1, 2, 3, 9, 9, 9]
    lp = samples[0].sampler_logprobs
    assert len(lp) == 6 and math.isnan(lp[1]) and math.isnan(lp[2]) and not math.isnan(lp[0]) and lp[3] == -0.1
    assert student.calls == [(1, 4), (1, 3)]
    assert samples[1].completion_ids == [1, 2, 3, 4, 0]
    # the teacher's scores follow the corrected sample
    assert len(t_full[0]) == 6 and t_lp[0][:3] == pytest.approx([math.log(0.9)] * 3)


def test_correct_samples_stops_at_a_teacher_eos():
    from mopd.distill.config import RolloutConfig
    from core.rollout import Sample
    from teachers.routing import TeacherRouter

    r = RolloutConfig(max_new_tokens=8, correct_below=0.05, correct_rounds=3)
    rows = [_Rows([100])]
    samples = [Sample([100], [1, 2, 3, 4, 9, 9], [-0.1] * 6, False)]   # should have stopped at 5
    t_lp, t_full = [None], [None]
    router = TeacherRouter({"alpha": _Teacher()})
    router.score(rows, samples, [0], True, t_lp, t_full)
    student = _Student()
    assert router.correct(student, rows, samples, [0], r, [1], {0}, t_lp, t_full) == [1]
    assert samples[0].completion_ids == [1, 2, 3, 4, 0] and samples[0].finished and student.calls == []


def test_teacher_corrected_run(setup, tmp_path):
    """rollout.correct_below end to end: random students are far from their teachers, so
    most samples get teacher tokens; those tokens train with importance weight 1."""
    out = tmp_path / "corrected"
    _mopd(["distill", "--config", str(setup["cfg"]), "--out", str(out), "loss.kl=full", "loss.beta=0.0",
           "rollout.correct_below=0.2", "train.max_steps=3", "train.save_every=0"])
    hist = json.loads((out / "history.json").read_text())
    fr = [h[k] for h in hist for k in h if k.startswith("corrected_frac/")]
    assert fr and all(0.0 <= f <= 1.0 for f in fr) and max(fr) > 0, fr
    assert all(math.isfinite(h["loss"]) for h in hist) and "time/correct_s" in hist[0]
    assert all(math.isfinite(h[k]) for h in hist for k in h if k.startswith(("mismatch/", "is/")))
    # with kl=full the logged KL is exact over the vocabulary: never below 0
    kls = [h[k] for h in hist for k in h if k.startswith("reverse_kl/")]
    assert kls and all(k >= -1e-5 for k in kls), kls


def test_teacher_correction_needs_full_kl(setup, tmp_path):
    _expect_error(setup, tmp_path, ["--config", str(setup["cfg"]), "rollout.correct_below=0.1"],
                  "set loss.kl=full")
    _expect_error(setup, tmp_path, ["--config", str(setup["cfg"]), "loss.kl=full", "rollout.correct_below=1.5"],
                  "rollout.correct_below")


def test_teacher_temperature_changes_the_update_and_needs_full_kl(setup, tmp_path):
    """loss.teacher_temperature < 1 trains toward a sharper teacher: same samples, other
    weights; the logged KL is still against the teacher itself."""
    base = ["--config", str(setup["cfg"]), "loss.kl=full", "loss.beta=0.0", "train.max_steps=2",
            "train.save_every=0"]
    _mopd(["distill", "--out", str(tmp_path / "t1"), *base])
    _mopd(["distill", "--out", str(tmp_path / "t05"), *base, "loss.teacher_temperature=0.5"])
    w1, w05 = _weights(tmp_path / "t1"), _weights(tmp_path / "t05")
    assert any(not torch.equal(w1[k], w05[k]) for k in w1)
    h1 = json.loads((tmp_path / "t1" / "history.json").read_text())
    h05 = json.loads((tmp_path / "t05" / "history.json").read_text())
    # step 1 samples with the same (initial) weights: the same KL to the teacher is logged
    assert h1[0]["reverse_kl/alpha"] == pytest.approx(h05[0]["reverse_kl/alpha"], rel=1e-5)
    _expect_error(setup, tmp_path, ["--config", str(setup["cfg"]), "loss.teacher_temperature=0.5"],
                  "needs loss.kl=full")
    _expect_error(setup, tmp_path, ["--config", str(setup["cfg"]), "loss.kl=full", "loss.teacher_temperature=0"],
                  "must be > 0")


def test_adam_betas_reach_the_optimizer_and_are_checked(setup, tmp_path):
    out = tmp_path / "betas"
    _mopd(["distill", "--config", str(setup["cfg"]), "--out", str(out), "train.adam_betas=[0.9,0.95]",
           "train.max_steps=2", "train.save_every=2"])
    from core.config import load_config
    from mopd.distill.config import DistillConfig
    assert load_config(DistillConfig, out / "config.yaml").train.adam_betas == [0.9, 0.95]
    from mopd.distill.checkpoints import latest_checkpoint
    opt = [f for f in (latest_checkpoint(out) / "state").iterdir() if f.name.startswith("optimizer")]
    state = torch.load(opt[0], weights_only=False)
    assert state["param_groups"][0]["betas"] == (0.9, 0.95)
    _expect_error(setup, tmp_path, ["--config", str(setup["cfg"]), "train.adam_betas=[0.9,1.0]"], "adam_betas")


def test_by_domain_rollout_settings(setup, tmp_path):
    """rollout.by_domain: each domain is sampled and corrected with its own settings. Only
    alpha is corrected here; beta's rows are sampled exactly as without by_domain (same
    seeds, same weights at step 1), so its first logged KL is unchanged."""
    base = ["--config", str(setup["cfg"]), "loss.kl=full", "loss.beta=0.0", "train.max_steps=2",
            "train.save_every=0"]
    _mopd(["distill", "--out", str(tmp_path / "plain"), *base])
    _mopd(["distill", "--out", str(tmp_path / "per"), *base,
           "rollout.by_domain={alpha: {correct_below: 0.2, temperature: 0.5}}"])
    plain = json.loads((tmp_path / "plain" / "history.json").read_text())
    per = json.loads((tmp_path / "per" / "history.json").read_text())
    assert any("corrected_frac/alpha" in h for h in per) and max(h.get("corrected_frac/alpha", 0) for h in per) > 0
    assert not any("corrected_frac/beta" in h for h in per) and "time/correct_s" in per[0]
    assert per[0]["reverse_kl/beta"] == pytest.approx(plain[0]["reverse_kl/beta"], rel=1e-4)
    assert per[0]["reverse_kl/alpha"] != pytest.approx(plain[0]["reverse_kl/alpha"], rel=1e-4)


def test_by_domain_rollout_settings_are_checked(setup, tmp_path):
    from core.config import load_config
    from mopd.distill.config import DistillConfig

    c = load_config(DistillConfig, setup["cfg"], ["loss.kl=full", "rollout.temperature=0.2",
                                                  "rollout.by_domain={beta: {temperature: 0.7, correct_rounds: 4}}"])
    assert c.rollout.for_domain("alpha") is c.rollout
    b = c.rollout.for_domain("beta")
    assert (b.temperature, b.correct_rounds, b.max_new_tokens, b.by_domain) == (0.7, 4, 8, {})
    _expect_error(setup, tmp_path, ["--config", str(setup["cfg"]), "rollout.by_domain={gamma: {temperature: 0.5}}"],
                  "rollout.by_domain names domain 'gamma'")
    _expect_error(setup, tmp_path, ["--config", str(setup["cfg"]), "loss.kl=full",
                                    "rollout.by_domain={beta: {correct_below: 1.5}}"], "by_domain.beta")
    _expect_error(setup, tmp_path, ["--config", str(setup["cfg"]), "rollout.by_domain={beta: {correct_below: 0.1}}"],
                  "set loss.kl=full")
    _expect_error(setup, tmp_path, ["--config", str(setup["cfg"]), "rollout.by_domain={beta: {max_new_tokens: 4}}"],
                  "max_new_tokens")


def test_lr_schedule_decays_to_its_floor():
    from mopd.distill.config import TrainConfig
    from mopd.distill.trainer import _lr_lambda

    f = _lr_lambda(TrainConfig(max_steps=110, warmup_steps=10, lr_schedule="cosine", lr_min_ratio=0.1))
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)   # warmup
    assert f(10) == pytest.approx(1.0) and f(60) == pytest.approx(0.55) and f(110) == pytest.approx(0.1)
    g = _lr_lambda(TrainConfig(max_steps=100, lr_schedule="linear"))
    assert g(50) == pytest.approx(0.5) and g(100) == pytest.approx(0.0)
    with pytest.raises(ValueError, match="lr_min_ratio"):
        TrainConfig(lr_min_ratio=1.5).validate()

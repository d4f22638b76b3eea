"""The sampler as a server (core/rollout/server.py): a real vLLM server started the way
`mopd teachers serve` starts it samples exactly what the in-process engine samples (same
seeds), takes the trainer's weights over gloo through vLLM's weight-update API, and its
log-probs then equal the trainer's; a dead server is an error naming its URL."""
from __future__ import annotations

import sys

import pytest
import torch

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture(scope="module")
def server(tiny_student_dir, tmp_path_factory):
    pytest.importorskip("vllm")
    from teachers import serve

    out = tmp_path_factory.mktemp("sampler_server")
    s = serve.sampler_server(str(tiny_student_dir), out, max_model_len=512, kv_cache_gb=0.5,
                             vllm=f"{sys.executable} -m {serve.API_SERVER}", extra_args=["--enforce-eager"])
    serve.start([s])
    try:
        serve.wait_healthy([s], timeout_s=600)
        yield s
    finally:
        serve.stop([s])


def _perturbed(path, seed: int):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return m


def test_server_samples_like_the_engine_and_takes_the_trainers_weights(server, vllm_rollout, tiny_student_dir,
                                                                       make_prompts, reference_logprobs):
    from core.rollout import ServerRollout

    r = ServerRollout([server.url], group_port=29400 + (id(server) % 500))
    try:
        prompts = make_prompts(6, seed=3)
        seeds = list(range(10, 16))
        kw = dict(max_new_tokens=12, temperature=1.0, top_p=0.9, seeds=seeds)
        a, b = r.generate(prompts, **kw), vllm_rollout.generate(prompts, **kw)
        assert [x.completion_ids for x in a] == [y.completion_ids for y in b]
        for x, y in zip(a, b):
            assert x.sampler_logprobs == pytest.approx(y.sampler_logprobs, abs=1e-4)
            assert x.finished == y.finished

        # the trainer's new weights, pushed over gloo: both samplers hold them, and the
        # sampled log-probs are the trainer's own (on-policy)
        m = _perturbed(tiny_student_dir, seed=7)
        r.sync_weights(m.named_parameters())
        vllm_rollout.sync_weights(m.named_parameters())
        assert r.version == 1 and r.bytes_sent == sum(p.numel() * 4 for p in m.parameters())
        a, b = r.generate(prompts, **kw), vllm_rollout.generate(prompts, **kw)
        assert [x.completion_ids for x in a] == [y.completion_ids for y in b]
        m.eval()
        for x in a:
            want = reference_logprobs(m, x.prompt_ids, x.completion_ids)
            assert torch.tensor(x.sampler_logprobs) == pytest.approx(want, abs=1e-4)
        # a second push: a new version, again the trainer's weights
        m2 = _perturbed(tiny_student_dir, seed=8)
        r.sync_weights(m2.named_parameters())
        assert r.version == 2
        x = r.generate(prompts[:2], **{**kw, "seeds": seeds[:2]})[1]
        m2.eval()
        assert torch.tensor(x.sampler_logprobs) == pytest.approx(reference_logprobs(m2, x.prompt_ids,
                                                                                    x.completion_ids), abs=1e-4)
    finally:
        r.close()


def test_a_second_trainer_on_the_same_server_is_caught(server, tiny_student_dir, make_prompts):
    """Two trainers pushing into one server would train on each other's samples: the
    tokens' weights versions give it away."""
    from core.rollout import SamplerServerError, ServerRollout

    a = ServerRollout([server.url], group_port=29950)
    b = ServerRollout([server.url], group_port=29960)
    try:
        m = _perturbed(tiny_student_dir, seed=1)
        a.sync_weights(m.named_parameters())
        b.sync_weights(m.named_parameters())
        b.sync_weights(m.named_parameters())     # the server now holds b's version 2
        with pytest.raises(SamplerServerError, match="weights version"):
            a.generate(make_prompts(1, seed=0), max_new_tokens=4, seeds=[0])
    finally:
        a.close()
        b.close()

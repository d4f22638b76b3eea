"""Server teachers (teachers/server.py) against a fake vLLM server backed by the tiny
teacher: the same scores as the in-process HF teacher, fail-over, and every fault a
clear error naming the teacher and the URL (never a silent zero or NaN)."""
from __future__ import annotations

import time

import pytest
import torch
from fake_vllm_server import Launched, free_port

from teachers.scoring import HFTeacher
from teachers.server import ServerTeacher, ServerTeacherError

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def server(tiny_teacher_dir):
    s = Launched(tiny_teacher_dir, "code-expert")
    yield s
    s.stop()


@pytest.fixture
def ok_server(server):
    server.mode("ok")
    yield server
    server.mode("ok")


def _pairs(make_prompts):
    prompts = make_prompts(7, seed=3, min_len=1, max_len=20)
    comps = make_prompts(7, seed=4, min_len=1, max_len=12)
    comps[2] = []
    return prompts, comps


def _teacher(urls, **kw):
    kw = {"timeout_s": 5.0, "max_retries": 1, "backoff_s": 0.05, "batch_size": 3, "concurrency": 2, **kw}
    return ServerTeacher("code", urls, "code-expert", **kw)


def test_scores_equal_the_hf_teacher(ok_server, tiny_teacher_dir, make_prompts):
    prompts, comps = _pairs(make_prompts)
    want = HFTeacher(str(tiny_teacher_dir), device="cpu").score(prompts, comps)
    t = _teacher([ok_server.url])
    got = t.score(prompts, comps)
    t.close()
    assert [len(x) for x in got] == [len(c) for c in comps]
    assert got[2].numel() == 0
    gap = max((a - b).abs().max().item() for a, b in zip(got, want) if a.numel())
    assert gap < 1e-4, gap
    assert all(torch.isfinite(x).all() for x in got)


def test_tokenizer_check(ok_server, tiny_tokenizer):
    t = _teacher([ok_server.url])
    t.check_tokenizer(tiny_tokenizer)            # the same tokenizer passes
    ok_server.mode("other_tokenizer")
    with pytest.raises(ServerTeacherError, match=r"teacher 'code'.*127\.0\.0\.1.*different tokenizer"):
        t.check_tokenizer(tiny_tokenizer)
    with pytest.raises(ServerTeacherError, match="other token ids than were sent"):
        t.score([[5, 6, 7]], [[8, 9]])
    t.close()


@pytest.mark.parametrize("mode,match", [("malformed", "malformed JSON"),
                                        ("wrong_count", "3 tokens but 2 prompt log-probs"),
                                        ("nan", "log-prob nan .* is not a log-probability")])
def test_bad_replies_are_clear_errors(ok_server, mode, match):
    ok_server.mode(mode)
    t = _teacher([ok_server.url])
    with pytest.raises(ServerTeacherError, match=rf"teacher 'code': {ok_server.url}/v1/completions.*{match}"):
        t.score([[5, 6]], [[7]])
    t.close()


def test_5xx_is_retried_then_names_teacher_and_url(ok_server):
    ok_server.mode("500")
    t = _teacher([ok_server.url], max_retries=2)
    with pytest.raises(ServerTeacherError, match=rf"teacher 'code' is unreachable: 3 attempts .*{ok_server.url}: "
                                                 r"HTTP 500"):
        t.score([[5, 6]], [[7]])
    t.close()


def test_slow_server_times_out(ok_server):
    ok_server.mode("sleep", seconds=30)
    t = _teacher([ok_server.url], timeout_s=0.5, max_retries=1)
    t0 = time.monotonic()
    with pytest.raises(ServerTeacherError, match=r"unreachable.*ReadTimeout"):
        t.score([[5, 6]], [[7]])
    assert time.monotonic() - t0 < 10     # 2 attempts of 0.5 s + 0.05 s backoff, not the 30 s sleep
    t.close()


def test_both_down_stops_with_every_url_named():
    dead = [f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"]
    t = _teacher(dead, max_retries=2, backoff_s=0.1)
    t0 = time.monotonic()
    with pytest.raises(ServerTeacherError) as e:
        t.score([[5, 6]], [[7]])
    assert time.monotonic() - t0 < 5
    msg = str(e.value)
    assert "teacher 'code' is unreachable: 6 attempts over 2 URL(s)" in msg
    assert dead[0] in msg and dead[1] in msg and "ConnectError" in msg
    t.close()


def test_fail_over_when_a_server_dies_mid_run(tiny_teacher_dir, make_prompts, capsys):
    """Two servers; the first exits after answering one request: the next requests go to
    the second and the scores are those of an undisturbed run. The fail-over is said once
    (even with requests in flight on several threads), counted, and the dead URL named."""
    a = Launched(tiny_teacher_dir, "code-expert", None, "--die-after", "1")
    b = Launched(tiny_teacher_dir, "code-expert")
    try:
        prompts, comps = _pairs(make_prompts)
        want = HFTeacher(str(tiny_teacher_dir), device="cpu").score(prompts, comps)
        t = _teacher([a.url, b.url], concurrency=2, batch_size=1)
        first = t.score(prompts[:1], comps[:1])     # served by a, which then dies
        assert a.proc.wait(timeout=10) != 0
        assert t.take_faults() == ({"teacher_failed_attempts/code": 0.0, "teacher_failovers/code": 0.0,
                                    "teacher_url/code": 0.0}, [])
        rest = t.score(prompts[1:], comps[1:])      # a refuses: fail-over to b, two requests at a time
        assert t.urls[t._good] == b.url
        gap = max((x - y).abs().max().item() for x, y in zip(first + rest, want) if x.numel())
        assert gap < 1e-4
        m, events = t.take_faults()
        t.close()
    finally:
        a.stop()
        b.stop()
    line = f"teacher 'code': {a.url} unreachable (ConnectError), using {b.url}"
    assert capsys.readouterr().err.count(line) == 1 and events == [line]
    assert m["teacher_failovers/code"] >= 1 and m["teacher_failed_attempts/code"] >= 1
    assert m["teacher_url/code"] == 1.0
    assert list(t.failed_urls) == [a.url] and "ConnectError" in t.failed_urls[a.url]


def test_a_recovered_server_is_said_once(ok_server):
    """A URL whose failure was said answers again (the first URL is down): a line for each."""
    from fake_vllm_server import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    t = _teacher([dead, ok_server.url], max_retries=0)
    t._down[ok_server.url] = "HTTP 500: x"    # as if it had failed and been said earlier
    t._said.add(ok_server.url)
    t.score([[5, 6]], [[7]])
    t.score([[5, 6]], [[7]])
    t.close()
    _, events = t.take_faults()
    assert events == [f"teacher 'code': {ok_server.url} answers again",
                      f"teacher 'code': {dead} unreachable (ConnectError), using {ok_server.url}"]


def test_teachers_validate_checks_a_server_teacher(ok_server, tiny_student_dir, tmp_path, capsys):
    from pipeline.cli import main

    r = tmp_path / "r.yaml"
    (tmp_path / "x.jsonl").write_text("")
    r.write_text(f"model: {{path: {tiny_student_dir}}}\ndata: {{datasets: [{{path: {tmp_path / 'x.jsonl'}}}]}}\n"
                 f"rollout: {{backend: hf}}\n"
                 f"teachers: {{code: {{backend: server, model: code-expert, urls: ['{ok_server.url}']}}}}\n")
    assert main(["teachers", "validate", "--config", str(r)]) == 0
    assert "teacher code       code-expert (server, fits)" in capsys.readouterr().out
    ok_server.mode("other_tokenizer")
    assert main(["teachers", "validate", "--config", str(r)]) == 2
    assert "different tokenizer" in capsys.readouterr().err


def test_top_k_rows_are_the_teachers_top_k_renormalized(ok_server, tiny_teacher_dir, make_prompts):
    """top_k > 0: score_full gives, per completion position, the teacher's k most likely
    tokens (and the sampled one) renormalized over themselves, -inf elsewhere."""
    prompts, comps = _pairs(make_prompts)
    t = _teacher([ok_server.url], top_k=5)
    assert t.full_distributions
    got = t.score_full(prompts, comps)
    want = HFTeacher(str(tiny_teacher_dir), device="cpu").score_full(prompts, comps)
    t.close()
    assert got[2].numel() == 0
    for g, w in zip(got, want):
        if not len(w):
            continue
        V = g.shape[1]
        for pos in range(len(w)):
            keep = torch.isfinite(g[pos])
            top = set(w[pos].topk(5).indices.tolist())
            assert top <= set(keep.nonzero().flatten().tolist()) and keep.sum() <= 6
            ref = w[pos, :V][keep]
            assert torch.allclose(g[pos][keep], ref - torch.logsumexp(ref, 0), atol=1e-4)


def test_without_top_k_score_full_names_the_fix(ok_server, make_prompts):
    t = _teacher([ok_server.url])
    assert not t.full_distributions
    with pytest.raises(ValueError, match="top_k > 0"):
        t.score_full(*_pairs(make_prompts))
    t.close()

"""What the server sampler does with a server it cannot trust (core/rollout/server.py),
against a small fake of vLLM's token route: every case is an error naming the URL and
the fix, never a silent sample."""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from core.rollout import SamplerServerError, ServerRollout


class Fake:
    """mode: ok | processed (log-probs after temperature) | malformed | wrong_token | slow | 500 | no_scale_out"""

    def __init__(self, mode: str = "ok"):
        self.mode, self.calls = mode, 0
        fake = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code: int, body: bytes):
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                self._send(200, b"") if self.path == "/health" else self._send(404, b'{"detail": "Not Found"}')

            def do_POST(self):
                fake.calls += 1
                req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path != "/inference/v1/generate":
                    return self._send(404, b'{"detail": "Not Found"}')
                if fake.mode == "no_scale_out":
                    return self._send(403, b'{"error": "Scale-out endpoints are disabled. Restart vllm serve '
                                           b'with --enable-scale-out to enable them."}')
                if fake.mode == "500":
                    return self._send(500, b"internal")
                if fake.mode == "malformed" and fake.calls > 2:
                    return self._send(200, b"{not json")
                if fake.mode == "slow" and fake.calls > 2:
                    time.sleep(3)
                sp = req["sampling_params"]
                n = min(sp["max_tokens"], 3)
                lp = -2.0 / (sp["temperature"] if fake.mode == "processed" else 1.0)
                ids = [7 + k for k in range(n)]
                content = [{"token_id": t + (1 if fake.mode == "wrong_token" and fake.calls > 2 else 0),
                            "logprob": lp - 1, "rank": 2,
                            "top_logprobs": [{"token_id": t, "logprob": lp - 1, "rank": 2},
                                             {"token_id": t + 1, "logprob": lp, "rank": 1}]} for t in ids]
                body = {"choices": [{"token_ids": ids, "finish_reason": "length", "logprobs": {"content": content},
                                     "weight_versions": [{"version": "default", "start": 0, "end": n}]}]}
                self._send(200, json.dumps(body).encode())

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fake():
    made = []

    def make(mode="ok"):
        made.append(Fake(mode))
        return made[-1]
    yield make
    for f in made:
        f.close()


def _gen(r):
    return r.generate([[1, 2, 3], [4, 5]], max_new_tokens=3, temperature=1.0, seeds=[0, 1])


def test_a_good_server_samples(fake):
    r = ServerRollout(fake().url)
    s = _gen(r)
    assert [x.completion_ids for x in s] == [[7, 8, 9]] * 2 and s[0].sampler_logprobs == [-3.0] * 3
    assert not s[0].finished
    r.close()


@pytest.mark.parametrize("mode, match", [
    ("processed", "log-probs after temperature.*--logprobs-mode raw_logprobs"),
    ("no_scale_out", "--enable-scale-out"),
])
def test_a_misconfigured_server_is_refused_before_training(fake, mode, match):
    f = fake(mode)
    with pytest.raises(SamplerServerError, match=match) as e:
        ServerRollout(f.url)
    assert f.url in str(e.value)


@pytest.mark.parametrize("mode, match", [
    ("malformed", "malformed JSON"),
    ("wrong_token", "is for token"),
])
def test_an_untrustworthy_reply_stops_the_run(fake, mode, match):
    f = fake(mode)
    r = ServerRollout(f.url)
    with pytest.raises(SamplerServerError, match=match):
        _gen(r)


def test_a_slow_server_times_out_and_a_dead_one_is_named(fake):
    f = fake("slow")
    r = ServerRollout(f.url, timeout_s=0.5, max_retries=1, backoff_s=0.01)
    t0 = time.monotonic()
    with pytest.raises(SamplerServerError, match=f"{f.url} is unreachable.*ReadTimeout"):
        _gen(r)
    assert time.monotonic() - t0 < 10
    f5 = fake("500")
    with pytest.raises(SamplerServerError, match=f"{f5.url} is unreachable.*2 attempt.*HTTP 500"):
        ServerRollout(f5.url, max_retries=1, backoff_s=0.01)
    with pytest.raises(SamplerServerError, match="127.0.0.1:9 is unreachable"):
        ServerRollout("http://127.0.0.1:9", max_retries=0)


def test_weight_routes_missing_say_how_to_start_the_server(fake):
    r = ServerRollout(fake().url, group_port=29877)
    with pytest.raises(SamplerServerError, match="VLLM_SERVER_DEV_MODE=1"):
        r.sync_weights([])


def test_no_urls_is_a_config_error_before_any_model_loads(tmp_path, tiny_student_dir, monkeypatch):
    from core.config import ConfigError, load_config
    from mopd.distill import DistillConfig, run, trainer
    from mopd.distill.config import SamplerServer

    with pytest.raises(ValueError, match="not an http"):
        SamplerServer(urls=["localhost:8000"]).validate()
    data = tmp_path / "p.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": [{"role": "user", "content": f"hi {i}"}], "domain": "a"})
                              for i in range(4)))
    cfg = tmp_path / "r.yaml"
    cfg.write_text(f"model: {{path: {tiny_student_dir}}}\ndata: {{datasets: [{{path: {data}}}], max_prompt_tokens: 64}}\n"
                   f"teachers: {{a: {{path: {tiny_student_dir}}}}}\nrollout: {{backend: server, max_new_tokens: 4}}\n"
                   "mlflow: {log_model: false}\n")
    monkeypatch.setattr(trainer, "build_models", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(ConfigError, match="needs rollout.server.urls.*mopd teachers serve"):
        run(load_config(DistillConfig, str(cfg), []), tmp_path / "out", progress=False)

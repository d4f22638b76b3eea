"""A small stand-in for `vllm serve`, for tests: the endpoints a server teacher uses
(/health, /v1/models, /tokenize, /v1/completions with prompt_logprobs, in vLLM's reply
shape), answered by a tiny HF model, and told to misbehave on demand.

    python fake_vllm_server.py serve MODEL_DIR --port 8000 [--served-model-name NAME] [--mode MODE]

It takes `vllm serve`'s command line (unknown flags are ignored), so a `vllm` script on
PATH that runs it stands in for vLLM under `mopd teachers serve`. Modes (also set at run
time with POST /_mode {"mode": ..., "seconds": ...}): ok, 500 (every completion is an
HTTP 500), malformed (not JSON), wrong_count (one prompt log-prob short), nan (a NaN
log-prob), sleep (answer after `seconds`), die (exit at the next completion request),
other_tokenizer (/tokenize and the echoed ids differ from what a client sent).
`--die-after N` exits after answering N completion requests (a server killed mid-run).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch


def build(args):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(args.model)
    state = {"mode": args.mode, "seconds": args.seconds, "served": 0}
    lock = threading.Lock()
    name = args.served_model_name or args.model

    @torch.no_grad()
    def prompt_logprobs(seq: list[int], k: int) -> list:
        logits = model(input_ids=torch.tensor([seq])).logits[0].float()
        lp = torch.log_softmax(logits, dim=-1)
        out: list = [None]
        for t in range(1, len(seq)):
            row = lp[t - 1]
            tokid = seq[t]
            d = {str(tokid): {"logprob": float(row[tokid]), "rank": int((row > row[tokid]).sum()) + 1,
                              "decoded_token": tok.decode([tokid])}}
            if k > 0:
                top = row.topk(k)
                for r, (v, i) in enumerate(zip(top.values.tolist(), top.indices.tolist())):
                    d.setdefault(str(i), {"logprob": v, "rank": r + 1, "decoded_token": tok.decode([i])})
            out.append(d)
        return out

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):   # quiet: the tests read the replies, not the access log
            pass

        def _send(self, code: int, body, raw: bool = False):
            data = body.encode() if raw else json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> dict:
            n = int(self.headers.get("Content-Length") or 0)
            return json.loads(self.rfile.read(n) or b"{}")

        def do_GET(self):
            if self.path == "/health":
                return self._send(200, {})
            if self.path == "/v1/models":
                return self._send(200, {"object": "list", "data": [{"id": name, "object": "model",
                                                                    "max_model_len": 512}]})
            self._send(404, {"error": "not found"})

        def do_POST(self):
            body = self._body()
            if self.path == "/_mode":
                state.update({k: body[k] for k in ("mode", "seconds") if k in body})
                return self._send(200, state)
            if self.path == "/tokenize":
                ids = tok(body["prompt"], add_special_tokens=body.get("add_special_tokens", True))["input_ids"]
                if state["mode"] == "other_tokenizer":
                    ids = [i + 1 for i in ids]
                return self._send(200, {"count": len(ids), "max_model_len": 512, "tokens": ids})
            if self.path != "/v1/completions":
                return self._send(404, {"error": "not found"})
            if body.get("model") != name:
                return self._send(404, {"error": {"message": f"The model `{body.get('model')}` does not exist."}})
            mode = state["mode"]
            if mode == "die":
                os._exit(1)
            if mode == "sleep":
                time.sleep(float(state["seconds"]))
            if mode == "500":
                return self._send(500, {"error": "internal error"})
            if mode == "malformed":
                return self._send(200, '{"choices": [ {"index": 0, "prompt_logprobs": [nul', raw=True)
            seqs = body["prompt"]
            seqs = seqs if seqs and isinstance(seqs[0], list) else [seqs]
            choices = []
            for j, seq in enumerate(seqs):
                plp = prompt_logprobs(seq, int(body.get("prompt_logprobs") or 0))
                if mode == "wrong_count":
                    plp = plp[:-1]
                if mode == "nan":
                    plp[-1][str(seq[-1])]["logprob"] = float("nan")
                echoed = [i + 1 for i in seq] if mode == "other_tokenizer" else seq
                choices.append({"index": j, "text": "", "logprobs": None, "finish_reason": "length",
                                "prompt_logprobs": plp,
                                "prompt_token_ids": echoed if body.get("return_token_ids") else None})
            self._send(200, {"id": "cmpl-fake", "object": "text_completion", "model": name, "choices": choices,
                             "usage": {"prompt_tokens": sum(map(len, seqs)), "completion_tokens": len(seqs)}})
            with lock:
                state["served"] += 1
                if args.die_after and state["served"] >= args.die_after:
                    os._exit(1)

    return H


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Launched:
    """A fake server in its own process group (`stop()` ends it and anything it started)."""

    def __init__(self, model, name: str = "teacher", port: int | None = None, *args: str, wait_s: float = 90.0):
        import subprocess
        import urllib.request

        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, __file__, "serve", str(model), "--port", str(self.port),
                                      "--served-model-name", name, *args], start_new_session=True,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"fake vllm server exited ({self.proc.returncode}): {self.proc.stderr.read()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1):
                    return
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"fake vllm server at {self.url} not healthy after {wait_s}s")

    def mode(self, mode: str, seconds: float | None = None) -> None:
        import urllib.request

        body = {"mode": mode, **({"seconds": seconds} if seconds is not None else {})}
        req = urllib.request.Request(self.url + "/_mode", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=5).read()

    def stop(self) -> None:
        import signal

        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=10)
        if self.proc.stderr:
            self.proc.stderr.close()


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("cmd", choices=["serve"])
    ap.add_argument("model")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--served-model-name", default=None)
    ap.add_argument("--mode", default=os.environ.get("FAKE_VLLM_MODE", "ok"))
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--die-after", type=int, default=0)
    args, _unknown = ap.parse_known_args(argv)   # vllm serve's other flags mean nothing here
    srv = ThreadingHTTPServer((args.host, args.port), build(args))
    srv.daemon_threads = True
    print(f"fake vllm serving {args.model} on http://{args.host}:{args.port}", file=sys.stderr, flush=True)
    srv.serve_forever()


if __name__ == "__main__":
    main()

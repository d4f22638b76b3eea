"""Server teachers: log p_T of the student's tokens from a vLLM OpenAI-compatible server.

A teacher that does not fit beside the student (a frontier-size expert, a team's own
nodes) runs as `vllm serve`; the loop asks it over HTTP. The request is the one TRL's
async distillation sends a teacher server (`trl/experimental/async_distillation/
async_rollout_worker.py`): `/v1/completions` with the whole sequence as token ids,
`max_tokens=1` (a throwaway token: the teacher is never sampled from) and
`prompt_logprobs`, whose entry i scores token i given tokens < i. Several sequences go in
one request (`prompt` as a list of token-id lists, one choice per sequence).

What can go wrong is an error naming the teacher and the URL, never a silent zero:
- connection errors, timeouts and 5xx are retried with exponential backoff, each round
  trying every URL in turn (fail-over); after `max_retries` rounds the run stops
  (`TeacherUnreachable`: the commands exit with code 3, core/exitcodes.py);
- a reply that is not JSON, has the wrong number of choices or positions, lacks the
  sampled token, carries NaN, or echoes other token ids than we sent stops it at once;
- a 4xx (a request the server refuses, e.g. a sequence over its max_model_len) is not
  retried: it would fail the same way again.
A fail-over is never silent: the first failure of a URL and its recovery are printed once
each (`teacher 'code': http://A unreachable (ConnectError), using http://B`); the loop
takes, once per batch, the failed attempts, fail-overs and serving URL as metrics and
those lines as run tags (`take_faults`), and its summary names every URL that failed
(`failed_urls`).
`check_tokenizer` compares the server's /tokenize of a chat-templated probe with the
student's tokenizer before any model is loaded.
"""
from __future__ import annotations

import math
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import torch

from core.exitcodes import Unreachable
from core.http import Retryable, json_request
from teachers.resolve import TeacherError


class ServerTeacherError(TeacherError):
    """A server teacher that cannot be used: unreachable, or a reply that cannot be trusted."""


class TeacherUnreachable(ServerTeacherError, Unreachable):
    """Every URL of a server teacher failed `max_retries + 1` rounds (exit code 3)."""


def _say(line: str) -> None:
    """One line on stderr above the progress bar (tqdm.write keeps the bar whole)."""
    from tqdm import tqdm

    tqdm.write(f"[mopd] {line}", file=sys.stderr)


def _pairs_ok(prompts: list[list[int]], completions: list[list[int]]) -> None:
    from teachers.scoring import _check_pairs  # one definition of a valid pair for every backend

    _check_pairs(prompts, completions)


class ServerTeacher:
    full_distributions = False
    remote = True      # waits on the network: the router asks all server teachers at once

    def __init__(self, name: str, urls: list[str], model: str, *, timeout_s: float = 60.0, max_retries: int = 3,
                 backoff_s: float = 1.0, concurrency: int = 4, batch_size: int = 16, path: str = "", top_k: int = 0):
        if not urls:
            raise ServerTeacherError(f"teacher {name!r}: backend server needs urls (start the servers with "
                                     f"`mopd teachers serve` and pass its overrides)")
        self.name, self.model, self.path = name, model, path or model
        self.top_k = top_k
        self.full_distributions = top_k > 0   # top-k rows stand in for the whole distribution
        self.urls = [u.rstrip("/") for u in urls]
        self.timeout_s, self.max_retries, self.backoff_s = timeout_s, max_retries, backoff_s
        self.concurrency, self.batch_size = concurrency, batch_size
        self._good = 0                   # the URL that answered last: tried first next time
        self._lock = threading.Lock()
        # what the operator sees of fail-overs (see the module docstring)
        self._down: dict[str, str] = {}         # URL -> the error that took it down, until it answers again
        self._said: set[str] = set()            # the URLs of _down whose failure was printed
        self.failed_urls: dict[str, str] = {}   # every URL that failed in this run -> its first error
        self._failed = self._failovers = 0      # since the last take_faults()
        self._served: Counter = Counter()       # URL index -> requests it answered, since the last take_faults()
        self._events: list[str] = []            # the lines printed since the last take_faults()
        self.client = httpx.Client(timeout=httpx.Timeout(timeout_s),
                                   limits=httpx.Limits(max_connections=max(concurrency, 1) * len(self.urls)))

    # --- HTTP with retries and fail-over -------------------------------------------
    def _once(self, url: str, method: str, path: str, payload: dict | None) -> dict:
        return json_request(self.client, method, url + path, payload, who=f"teacher {self.name!r}",
                            error=ServerTeacherError)

    def request(self, method: str, path: str, payload: dict | None = None) -> tuple[str, dict]:
        """(url, reply) from the first server that answers; every URL is tried per round,
        `max_retries` rounds with backoff_s * 2**round in between, then a ServerTeacherError
        naming the teacher, each URL and its last error."""
        last: dict[str, str] = {}
        tries = 0
        first = self._good
        for rnd in range(self.max_retries + 1):
            if rnd:
                time.sleep(self.backoff_s * 2 ** (rnd - 1))
            start = self._good
            for k in range(len(self.urls)):
                i = (start + k) % len(self.urls)
                url = self.urls[i]
                tries += 1
                try:
                    out = self._once(url, method, path, payload)
                except Retryable as e:
                    last[url] = str(e)
                    self._failed_once(url, str(e))
                    continue
                self._answered(i, first, last)
                return url, out
        detail = "; ".join(f"{u}: {e}" for u, e in last.items())
        raise TeacherUnreachable(f"teacher {self.name!r} is unreachable: {tries} attempts over {len(self.urls)} "
                                 f"URL(s) in {self.max_retries + 1} rounds failed ({detail})")

    def _failed_once(self, url: str, err: str) -> None:
        with self._lock:
            self._failed += 1
            self.failed_urls.setdefault(url, err)
            self._down.setdefault(url, err)

    def _answered(self, i: int, first: int, failed: dict[str, str]) -> None:
        """URL i answered a request that tried URL `first` first and saw `failed` fail: each
        URL newly down and each URL back up is said once (threads share these records)."""
        url = self.urls[i]
        lines = []
        with self._lock:
            self._served[i] += 1
            if i != first:
                self._failovers += 1
            if url in self._down:   # it had failed: back up
                del self._down[url]
                if url in self._said:
                    self._said.discard(url)
                    lines.append(f"teacher {self.name!r}: {url} answers again")
            for u in failed:
                if u != url and u in self._down and u not in self._said:
                    self._said.add(u)
                    lines.append(f"teacher {self.name!r}: {u} unreachable ({self._down[u].split(':')[0]}), "
                                 f"using {url}")
            if i != self._good:
                self._good = i
            self._events += lines
        for line in lines:
            _say(line)

    def take_faults(self) -> tuple[dict[str, float], list[str]]:
        """Since the last call: metrics (failed attempts, fail-overs, the index in `urls` of
        the URL that answered most requests) and the fail-over lines that were printed."""
        with self._lock:
            served = self._served.most_common(1)[0][0] if self._served else self._good
            m = {f"teacher_failed_attempts/{self.name}": float(self._failed),
                 f"teacher_failovers/{self.name}": float(self._failovers),
                 f"teacher_url/{self.name}": float(served)}
            events, self._events = self._events, []
            self._failed = self._failovers = 0
            self._served.clear()
        return m, events

    # --- checks ----------------------------------------------------------------------
    def check_tokenizer(self, tokenizer) -> None:
        """The served model tokenizes a chat-templated probe (special tokens, template
        markers, digits, unicode) exactly as the student does, on every reachable URL; a
        URL that is down now is skipped (fail-over covers it), all down is an error."""
        msgs = [{"role": "user", "content": "Probe: 12 + 30 = 42? naïve café, def f(x): return x**2"}]
        try:
            text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - a tokenizer without a chat template still has a vocabulary
            text = msgs[0]["content"]
        want = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        seen = 0
        for url in self.urls:
            try:
                out = self._once(url, "POST", "/tokenize", {"model": self.model, "prompt": text,
                                                           "add_special_tokens": False})
            except Retryable:
                continue
            seen += 1
            got = out.get("tokens")
            if got != want:
                at = next((j for j, (a, b) in enumerate(zip(got or [], want)) if a != b), min(len(got or []),
                                                                                          len(want)))
                raise ServerTeacherError(f"teacher {self.name!r}: the model served at {url} ({self.model}) has a "
                                         f"different tokenizer than the student: a probe gives {len(got or [])} "
                                         f"tokens vs the student's {len(want)}, first difference at token {at}")
        if not seen:
            self.request("POST", "/tokenize", {"model": self.model, "prompt": text})   # raises, naming each URL

    # --- scoring ---------------------------------------------------------------------
    def _score_batch(self, seqs: list[list[int]], starts: list[int], k: int = 0) -> list:
        """Sampled-token log-probs per sequence; with k > 0, (log-probs, [T, V'] top-k rows)."""
        payload = {"model": self.model, "prompt": seqs, "max_tokens": 1, "temperature": 0.0,
                   "prompt_logprobs": k, "return_token_ids": True}
        url, out = self.request("POST", "/v1/completions", payload)
        where = f"teacher {self.name!r}: {url}/v1/completions"
        choices = out.get("choices")
        if not isinstance(choices, list) or len(choices) != len(seqs):
            raise ServerTeacherError(f"{where} returned {len(choices) if isinstance(choices, list) else choices!r} "
                                     f"choices for {len(seqs)} sequences")
        res: list[torch.Tensor | None] = [None] * len(seqs)
        for j, ch in enumerate(choices):
            b = ch.get("index", j) if isinstance(ch, dict) else None
            if not isinstance(b, int) or not 0 <= b < len(seqs) or res[b] is not None:
                raise ServerTeacherError(f"{where}: choice {j} has a bad index {b!r}")
            seq, P = seqs[b], starts[b]
            echoed = ch.get("prompt_token_ids")
            if echoed is not None and list(echoed) != seq:
                raise ServerTeacherError(f"{where}: the server scored other token ids than were sent (sequence "
                                         f"{b}: {len(echoed)} ids vs {len(seq)}): a different tokenizer or a "
                                         f"server that re-tokenizes")
            plp = ch.get("prompt_logprobs")
            if not isinstance(plp, list) or len(plp) != len(seq):
                raise ServerTeacherError(f"{where}: sequence {b} has {len(seq)} tokens but "
                                         f"{len(plp) if isinstance(plp, list) else plp!r} prompt log-probs")
            vals = []
            for t in range(P, len(seq)):
                pos = plp[t]
                entry = pos.get(str(seq[t])) if isinstance(pos, dict) else None
                lp = entry.get("logprob") if isinstance(entry, dict) else None
                if not isinstance(lp, (int, float)) or isinstance(lp, bool):
                    raise ServerTeacherError(f"{where}: sequence {b} position {t} has no log-prob for the sampled "
                                             f"token {seq[t]} (got {pos!r:.200})")
                if math.isnan(lp) or lp > 1e-4:
                    raise ServerTeacherError(f"{where}: sequence {b} position {t}: log-prob {lp} of token "
                                             f"{seq[t]} is not a log-probability")
                vals.append(float(lp))
            res[b] = torch.tensor(vals, dtype=torch.float32)
            if k:
                res[b] = (res[b], self._topk_rows(plp[P:], where, b, P, k))
        return res   # type: ignore[return-value]

    def _topk_rows(self, positions: list, where: str, b: int, P: int, k: int) -> torch.Tensor:
        """[T, V'] log-probs: the top-k tokens (and the sampled one) renormalized over
        themselves, -inf elsewhere (`teachers.scoring.topk_rows`)."""
        from teachers.scoring import topk_rows

        rows = []
        for t, pos in enumerate(positions):
            try:
                items = [(int(tok), float(e["logprob"])) for tok, e in pos.items()]
            except (AttributeError, KeyError, TypeError, ValueError):
                raise ServerTeacherError(f"{where}: sequence {b} position {P + t}: top-k log-probs are not a "
                                         f"token -> logprob map ({pos!r:.200})") from None
            if len(items) < min(k, 1) or any(math.isnan(v) for _, v in items):
                raise ServerTeacherError(f"{where}: sequence {b} position {P + t}: {len(items)} top-k log-probs "
                                         f"(asked {k}), or NaN")
            rows.append(items)
        return topk_rows(rows)

    def score(self, prompts: list[list[int]], completions: list[list[int]]) -> list[torch.Tensor]:
        _pairs_ok(prompts, completions)
        out: list[torch.Tensor] = [torch.zeros(0, dtype=torch.float32) for _ in prompts]
        todo = [i for i, c in enumerate(completions) if len(c) > 0]
        todo.sort(key=lambda i: len(prompts[i]) + len(completions[i]))
        batches = [todo[k:k + self.batch_size] for k in range(0, len(todo), self.batch_size)]
        if not batches:
            return out

        def run(idx: list[int]) -> list[torch.Tensor]:
            return self._score_batch([list(prompts[i]) + list(completions[i]) for i in idx],
                                     [len(prompts[i]) for i in idx])

        if len(batches) == 1 or self.concurrency == 1:
            results = [run(b) for b in batches]
        else:
            with ThreadPoolExecutor(min(self.concurrency, len(batches))) as pool:
                results = list(pool.map(run, batches))
        for idx, lps in zip(batches, results):
            for i, lp in zip(idx, lps):
                out[i] = lp
        return out

    def score_full(self, prompts: list[list[int]], completions: list[list[int]]) -> list[torch.Tensor]:
        """With top_k > 0: per sequence a [T, V'] tensor of the teacher's top-k log-probs at
        each completion position, renormalized over them, -inf elsewhere."""
        if not self.top_k:
            raise ValueError(f"teacher {self.name!r}: the server backend returns sampled-token log-probs only "
                             f"unless top_k > 0 (prompt_logprobs=k); loss.kl=full and rollout.correct_below need "
                             f"top_k or backend hf")
        _pairs_ok(prompts, completions)
        out: list[torch.Tensor] = [torch.zeros(0, 0) for _ in prompts]
        todo = [i for i, c in enumerate(completions) if len(c) > 0]
        for s in range(0, len(todo), self.batch_size):
            idx = todo[s:s + self.batch_size]
            got = self._score_batch([list(prompts[i]) + list(completions[i]) for i in idx],
                                    [len(prompts[i]) for i in idx], k=self.top_k)
            for i, (_, full) in zip(idx, got):
                out[i] = full
        return out

    def close(self) -> None:
        self.client.close()


def from_spec(name: str, spec, path: str | None = None) -> ServerTeacher:
    """The ServerTeacher of a recipe's TeacherSpec (backend server)."""
    return ServerTeacher(name, list(spec.urls), spec.model, timeout_s=spec.timeout_s, max_retries=spec.max_retries,
                         backoff_s=spec.backoff_s, concurrency=spec.concurrency, batch_size=spec.batch_size,
                         path=str(path or spec.path or ""), top_k=getattr(spec, "top_k", 0))

"""One JSON request to a vLLM server, classified the way both of its clients here need
(server teachers, teachers/server.py; the sampler server, core/rollout/server.py): a
failure worth another try (connection refused or reset, timeout, HTTP 5xx) raises
`Retryable`; a refusal (another 4xx) or a reply that cannot be trusted (malformed JSON,
not a JSON object) raises the caller's own error class, naming who asked and the URL.
The retry and fail-over policies stay with the callers: they differ (a teacher fails over
between URLs; a weight update must never be sent twice)."""
from __future__ import annotations

import json
from collections.abc import Callable

import httpx


class Retryable(Exception):
    """A failure worth another try (connection, timeout, 5xx)."""


def json_request(client: httpx.Client, method: str, url: str, payload: dict | None, *, who: str,
                 error: type[Exception], hint: Callable[[httpx.Response], str] | None = None,
                 empty_ok: bool = False) -> dict:
    """The reply of `method url` with `payload` as a dict. `who` starts every error message
    (e.g. "teacher 'math'"); `hint(response)` may add a fix to a refusal's message;
    `empty_ok`: an empty body is {} (routes that answer nothing)."""
    try:
        r = client.request(method, url, json=payload)
    except (httpx.TransportError, OSError) as e:   # refused, reset, timeout
        raise Retryable(f"{type(e).__name__}: {e or 'no answer'}") from None
    if r.status_code >= 500:
        raise Retryable(f"HTTP {r.status_code}: {r.text[:300]}")
    if r.status_code != 200:
        raise error(f"{who}: {url} refused the request (HTTP {r.status_code}): {r.text[:400]}"
                    f"{hint(r) if hint else ''}")
    if empty_ok and not r.content:
        return {}
    try:
        out = r.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{who}: {url} answered malformed JSON ({e}): {r.text[:200]!r}") from None
    if not isinstance(out, dict):
        raise error(f"{who}: {url} answered {type(out).__name__}, not a JSON object")
    return out

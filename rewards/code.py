"""Reward for the `code` domain: 1.0 when the completion passes the row's tests, else 0.0.

Rows follow HumanEval's schema: `test` is Python source defining `check(candidate)`
(asserts), `entry_point` names the function under test, and `prompt_code` (optional)
is the code the prompt shows (HumanEval's signature + docstring; "" for procedural
rows). The completion may be
  1. a fenced block (```python ... ```), what chat models write: the first block that
     defines `entry_point` (else the first block) runs after `prompt_code` (for its
     imports and helpers; the block's own definition replaces the prompt's stub);
  2. a whole `def entry_point(...)` without fences: same, without the fence;
  3. anything else is a continuation of the prompt's signature, what base models write
     (and what HumanEval's canonical solutions are): `prompt_code + completion` runs.
Without a `prompt_code` column the prompt supplies it: a string prompt is the code
itself; for chat prompts, the fenced block of the last user message (or nothing).

How a row is judged (rewards/sandbox.py runs everything; one sandbox per row):
  - the sandbox runs a trusted harness that forks. The child installs the audit hook,
    reads only the candidate's code, runs it and then serves calls to `entry_point`
    over a pipe. The parent reads the test code and a per-run random token from its
    stdin *after* the fork (the child never has them), runs `check(candidate)` with a
    proxy `candidate` that forwards each call to the child, and writes the token to
    fd 3 only after check() returned. The reward requires exactly that token.
  - Values cross the pipe as tagged JSON and are rebuilt as plain builtins (int, float,
    str, bool, None, list, tuple, dict, set, frozenset, bytes, complex); anything else
    becomes an opaque value that equals nothing. So the candidate cannot reach the test
    code, the asserts or the token: printing "passed", defining its own `check`,
    monkeypatching builtins or `assert`, returning an object whose `__eq__` is always
    True, `sys.exit(0)` or `os._exit(0)` before the tests, reading the test file
    (there is none in its workspace) all score 0.
  - A candidate that raises, hangs (CPU time `timeout_s`, wall clock `wall_timeout_s`),
    floods memory or output, forks, touches the network or host files scores 0; the
    host is not harmed.
  - Both processes run under the sandbox's OS layers and audit hook (the checker
    installs it after reading its stdin): `test` and `prompt_code` are dataset text,
    trusted, but a hostile test row would be contained too.
  - Calls share nothing but the values: a test that relies on the candidate mutating
    its arguments in place, or on identity (`is`) of returned objects, would fail here
    (none of HumanEval's 164 does; all canonical solutions score 1.0).

Scores are None for rows whose `domain` column is another domain. The reward never
raises on model output (empty, huge, malformed, hostile: 0.0); it raises ValueError
for malformed *rows* (no `test` or `entry_point` for a code row) and for an unknown
isolation (`isolation=` or $MOPD_SANDBOX_ISOLATION), SandboxUnavailable where no
namespace isolation works and "none" was not chosen explicitly, and RuntimeError when
the sandbox cannot be built: a broken sandbox stops the run instead of scoring 0.0.
"""
from __future__ import annotations

import ast
import json
import re
import secrets
from concurrent.futures import ThreadPoolExecutor

from core.completions import completion_text
from rewards.columns import column
from rewards.sandbox import Limits, check_isolation, run_python

DOMAIN = "code"
MAX_COMPLETION_CHARS = 20_000   # longer completions score 0 without being run
MAX_WORKERS = 2                 # sandboxes run at once (each is a process or two)

# The trusted program run in the sandbox (see the module docstring). It gets
# `sandbox_lockdown` from the runner; stdin: {"token", "test", "helper", "entry_point"};
# workspace: solution.json {"code", "entry_point"}.
HARNESS = r'''
import _json, builtins, os, sys

LIMIT = 16 << 20
INF = float("inf")


# JSON without `import json` (its regexes cost ~10-30 ms of startup per sandbox): the C
# scanner and string escaper of the _json accelerator, and a small writer.
class _Ctx:
    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    parse_constant = {"NaN": float("nan"), "Infinity": INF, "-Infinity": -INF}.__getitem__
    memo = {}


_scan = _json.make_scanner(_Ctx())
_esc = _json.encode_basestring_ascii


def _loads(text):
    if isinstance(text, bytes):
        text = text.decode("utf-8")
    try:
        obj, end = _scan(text, 0)
    except StopIteration:
        raise ValueError("malformed message") from None
    if end != len(text):
        raise ValueError("malformed message")
    return obj


def _dump(x, out, depth=0):
    """Write `x` as JSON, tagging every container: {"l": [...]} list, "t" tuple,
    "d" dict (a list of pairs), "s" set, "f" frozenset, "b" bytes (hex), "c" complex,
    "o" an opaque value (its type name)."""
    if depth > 100:
        raise ValueError("value nested too deeply")
    if x is None:
        out.append("null")
    elif x is True or x is False or isinstance(x, bool):
        out.append("true" if x else "false")
    elif isinstance(x, int):
        out.append(int.__repr__(int(x)))
    elif isinstance(x, float):
        x = float(x)
        out.append("NaN" if x != x else "Infinity" if x == INF else "-Infinity" if x == -INF else float.__repr__(x))
    elif isinstance(x, str):
        out.append(_esc(str.__str__(x)))
    else:
        d = depth + 1
        if isinstance(x, (list, tuple, set, frozenset)):
            tag = "l" if isinstance(x, list) else "t" if isinstance(x, tuple) else \
                "f" if isinstance(x, frozenset) else "s"
            out.append('{"' + tag + '":[')
            for i, v in enumerate(x):
                if i:
                    out.append(",")
                _dump(v, out, d)
            out.append("]}")
        elif isinstance(x, dict):
            out.append('{"d":[')
            for i, (k, v) in enumerate(x.items()):
                out.append("," if i else "")
                out.append("[")
                _dump(k, out, d)
                out.append(",")
                _dump(v, out, d)
                out.append("]")
            out.append("]}")
        elif isinstance(x, (bytes, bytearray)):
            out.append('{"b":"' + bytes(x).hex() + '"}')
        elif isinstance(x, complex):
            out.append('{"c":[')
            _dump(x.real, out, d)
            out.append(",")
            _dump(x.imag, out, d)
            out.append("]}")
        else:
            out.append('{"o":' + _esc(type(x).__name__) + "}")


def _dumps(x):
    out = []
    _dump(x, out)
    return "".join(out)


def _read_exact(fd, n):
    parts, got = [], 0
    while got < n:
        b = os.read(fd, min(n - got, 1 << 20))
        if not b:
            return None
        parts.append(b)
        got += len(b)
    return b"".join(parts)


def _send_text(fd, text):
    data = text.encode("utf-8", "surrogatepass")
    data = len(data).to_bytes(4, "big") + data
    while data:
        data = data[os.write(fd, data):]


def _recv(fd):
    head = _read_exact(fd, 4)
    if head is None:
        return None
    n = int.from_bytes(head, "big")
    if n > LIMIT:
        raise ValueError("message too large")
    body = _read_exact(fd, n)
    if body is None:
        return None
    return _loads(body.decode("utf-8", "surrogatepass"))


class Opaque:
    """A value of a type that does not cross the pipe: equal only to itself."""
    def __init__(self, name):
        self.name = name
    def __repr__(self):
        return f"<opaque {self.name}>"


def _dec(x, depth=0):
    if depth > 100:
        raise ValueError("value nested too deeply")
    if x is None or type(x) in (bool, int, float, str):
        return x
    if type(x) is not dict or len(x) != 1:
        raise ValueError("malformed value")
    (tag, v), = x.items()
    d = depth + 1
    if tag in ("l", "t", "s", "f") and type(v) is list:
        items = [_dec(i, d) for i in v]
        return {"l": list, "t": tuple, "s": set, "f": frozenset}[tag](items)
    if tag == "d" and type(v) is list:
        out = {}
        for pair in v:
            if type(pair) is not list or len(pair) != 2:
                raise ValueError("malformed dict")
            out[_dec(pair[0], d)] = _dec(pair[1], d)
        return out
    if tag == "b" and type(v) is str:
        return bytes.fromhex(v)
    if tag == "c" and type(v) is list and len(v) == 2 and all(type(a) in (int, float) for a in v):
        return complex(v[0], v[1])
    if tag == "o" and type(v) is str:
        return Opaque(v[:100])
    raise ValueError("malformed value")


def _child(r_req, w_res):
    with open("solution.json", "rb") as f:
        sol = _loads(f.read())
    sandbox_lockdown()
    ns = {"__name__": "__solution__", "__builtins__": builtins}
    try:
        exec(compile(sol["code"], "solution.py", "exec"), ns)
        fn = ns.get(sol["entry_point"])
        if not callable(fn):
            raise NameError(f"{sol['entry_point']!r} is not defined")
    except BaseException as e:
        _send_text(w_res, '["error",' + _esc(type(e).__name__) + "]")
        return
    _send_text(w_res, '["ready"]')
    while True:
        msg = _recv(r_req)
        if msg is None:
            return
        try:
            out = fn(*_dec(msg[0]), **_dec(msg[1]))
            reply = '["ok",' + _dumps(out) + "]"
        except BaseException as e:
            try:
                reply = '["raise",' + _esc(type(e).__name__) + "," + _esc(str(e)[:300]) + "]"
            except BaseException:
                reply = '["raise","Exception",""]'
        _send_text(w_res, reply)


def _exception(name, message):
    cls = getattr(builtins, str(name), None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            return cls(message)
        except Exception:
            pass
    return RuntimeError(f"{name}: {message}")


def _parent(r_res, w_req):
    spec = _loads(sys.stdin.buffer.read())
    os.close(0)
    sandbox_lockdown()   # the test code is trusted, but it runs under the hook all the same
    first = _recv(r_res)
    if not first or first[0] != "ready":
        sys.stderr.write(f"solution failed to load: {first}\n")
        os._exit(1)
    ns = {"__name__": "__check__", "__builtins__": builtins}
    if spec["helper"]:
        try:
            exec(compile(spec["helper"], "prompt.py", "exec"), ns)
        except Exception:
            pass
    exec(compile(spec["test"], "test.py", "exec"), ns)

    def candidate(*args, **kwargs):
        _send_text(w_req, "[" + _dumps(list(args)) + "," + _dumps(kwargs) + "]")
        msg = _recv(r_res)
        if msg is None:
            raise RuntimeError("the solution process died")
        if type(msg) is list and msg and msg[0] == "ok" and len(msg) == 2:
            return _dec(msg[1])
        if type(msg) is list and len(msg) == 3 and msg[0] == "raise":
            raise _exception(msg[1], msg[2])
        raise RuntimeError("malformed reply from the solution process")

    candidate.__name__ = candidate.__qualname__ = spec["entry_point"]
    ns[spec["entry_point"]] = candidate   # tests that call the function by name get it too
    ns["check"](candidate)
    os.write(3, spec["token"].encode())
    os._exit(0)


def _main():
    null = os.open("/dev/null", os.O_RDONLY)
    r_req, w_req = os.pipe()
    r_res, w_res = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.dup2(null, 0)          # the parent's stdin (test, token) is not ours
            os.close(3)               # nor is the result channel
            os.close(w_req)
            os.close(r_res)
            _child(r_req, w_res)
        except BaseException:
            import traceback
            traceback.print_exc()
        finally:
            os._exit(0)
    os.close(null)
    os.close(r_req)
    os.close(w_res)
    _parent(r_res, w_req)


_main()
'''

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\r?\n(.*?)(?:```|\Z)", re.S | re.I)


def _defines(code: str, name: str) -> bool:
    return re.search(rf"^[ \t]*(?:async[ \t]+)?def[ \t]+{re.escape(name)}[ \t]*\(", code, re.M) is not None


def _compiles(code: str) -> bool:
    try:
        ast.parse(code)
        return True
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return False


def prompt_code_of(prompt) -> str:
    """The code a prompt shows: a string prompt is the code; for chat messages, the
    first fenced block of the last user message ("" when there is none)."""
    if isinstance(prompt, str):
        return prompt
    text = ""
    if isinstance(prompt, (list, tuple)):
        for msg in reversed(prompt):
            if isinstance(msg, dict) and msg.get("role") == "user" and isinstance(msg.get("content"), str):
                text = msg["content"]
                break
    m = _FENCE.search(text)
    return m.group(1) if m else ""


def build_program(completion: str, prompt_code: str, entry_point: str) -> str:
    """The candidate's full source (see the module docstring for the three cases)."""
    blocks = [b for b in _FENCE.findall(completion)] if "```" in completion else []
    if blocks:
        code = next((b for b in blocks if _defines(b, entry_point)), blocks[0])
    elif _defines(completion, entry_point) and not _compiles(prompt_code + completion):
        code = completion
    else:
        return prompt_code + completion   # a continuation of the prompt's signature
    helper = prompt_code if prompt_code.strip() and _compiles(prompt_code) else ""
    return f"{helper}\n{code}" if helper else code


def run_tests(program: str, test: str, entry_point: str, *, helper: str = "",
              limits: Limits | None = None, isolation: str | None = None) -> tuple[bool, object]:
    """(passed, sandbox result): run `program`, then `check(entry_point)` from `test`."""
    token = secrets.token_hex(16)
    spec = json.dumps({"token": token, "test": test, "helper": helper, "entry_point": entry_point})
    res = run_python(HARNESS, trusted=True, stdin=spec, limits=limits, isolation=isolation,
                     files={"solution.json": json.dumps({"code": program, "entry_point": entry_point})})
    return res.result == token.encode(), res


def _column(columns: dict, name: str, n: int):
    return column(columns, name, n, "rewards.code")


def reward(prompts, completions, *, timeout_s: float = 10.0, wall_timeout_s: float | None = None,
           memory_mb: int = 1024, max_workers: int = MAX_WORKERS, isolation: str | None = None,
           **columns) -> list[float | None]:
    """1.0 if the completion passes `check(candidate)` of its row's `test`, else 0.0;
    None for rows of another domain (see the module docstring).

    timeout_s is CPU time per process (an infinite loop dies after it, however busy the
    machine is); wall_timeout_s (default 2 * timeout_s + 5) catches programs that hang
    without using CPU (sleep, a deadlock). Both limits hold on an overloaded host where a
    wall-clock-only limit would fail correct solutions."""
    completions = list(completions)
    n = len(completions)
    prompts = list(prompts) if prompts is not None else [None] * n
    if len(prompts) != n:
        raise ValueError(f"rewards.code: {n} completions but {len(prompts)} prompts")
    domains = _column(columns, "domain", n) or [None] * n
    tests = _column(columns, "test", n)
    entry_points = _column(columns, "entry_point", n)
    prompt_codes = _column(columns, "prompt_code", n)
    max_workers = int(max_workers)   # settings may arrive as strings (--reward-kwarg k=v)
    wall = float(wall_timeout_s) if wall_timeout_s is not None else 2.0 * float(timeout_s) + 5.0
    limits = Limits(wall_s=wall, cpu_s=max(1, round(float(timeout_s))), memory_mb=int(memory_mb))

    out: list[float | None] = [None] * n
    jobs: list[tuple[int, str, str, str, str]] = []
    for i in range(n):
        if domains[i] is not None and domains[i] != DOMAIN:
            continue
        if tests is None or entry_points is None or not tests[i] or not entry_points[i]:
            raise ValueError(f"rewards.code: row {i} has no `test` / `entry_point` (code rows need both)")
        text = completion_text(completions[i])
        if not text.strip() or len(text) > MAX_COMPLETION_CHARS or "\x00" in text:
            out[i] = 0.0
            continue
        pcode = prompt_codes[i] if prompt_codes is not None and prompt_codes[i] is not None else None
        if pcode is None:
            pcode = prompt_code_of(prompts[i])
        helper = pcode if pcode.strip() and _compiles(pcode) else ""
        try:
            program = build_program(text, pcode, entry_points[i])
        except Exception:
            out[i] = 0.0
            continue
        jobs.append((i, program, tests[i], entry_points[i], helper))

    # A bad or missing isolation setting is the operator's error, not the completion's:
    # it raises here (ValueError, SandboxUnavailable) instead of scoring every row 0.0.
    if any(d is None or d == DOMAIN for d in domains):
        isolation = check_isolation(isolation)

    def score(job) -> tuple[int, float]:
        i, program, test, entry, helper = job
        passed, res = run_tests(program, test, entry, helper=helper, limits=limits, isolation=isolation)
        if res.reason == "setup_failed":
            # A program can fake the bootstrap's exit code and message, so a failed setup
            # stops the run only when a trivial program fails the same way.
            probe = run_python("print('ok')", isolation=isolation, limits=Limits(wall_s=20))
            if probe.reason == "setup_failed":
                raise RuntimeError(f"rewards.code: the sandbox ({isolation}) could not be built: "
                                   f"{probe.stderr[-500:]}")
        return i, 1.0 if passed else 0.0

    if len(jobs) <= 1 or max_workers <= 1:
        results = [score(job) for job in jobs]
    else:
        with ThreadPoolExecutor(max_workers=min(max_workers, len(jobs))) as pool:
            results = list(pool.map(score, jobs))
    for i, s in results:
        out[i] = s
    return out


def _preflight(*, isolation: str | None = None, **_kwargs) -> None:
    """Before any model loads (mopd.distill.data.load_reward_fn calls it): a bad or
    missing sandbox isolation is an error now, not at the first code batch."""
    check_isolation(isolation)


reward.preflight = _preflight

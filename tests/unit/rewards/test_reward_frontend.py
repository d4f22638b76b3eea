"""rewards/frontend.py and its browser pool (rewards/browser.py): spec checks in a real
headless Chromium, containment of hostile pages (endless scripts, network, popups,
faked styles), a crashed browser replaced, no browser named clearly, and no browser
process outliving a SIGKILLed host.

Needs Chromium ($MOPD_CHROMIUM or chromium on PATH; scripts/install.sh installs it):
without one these tests fail on purpose rather than skip, since the domain cannot work.
Safety: the killed-host tests kill only process groups they read from the host they
started, and SIGKILL whatever is left at the end."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from experts.frontend.data import CORRUPTIONS, FAMILIES, corrupt, corrupt_kind, make_dataset
from rewards import browser as B
from rewards.frontend import reward

REPO = Path(__file__).resolve().parents[3]
CHECKS = json.dumps([
    {"type": "text", "id": "a", "tag": "div", "text": "Hi"},
    {"type": "style", "id": "a", "prop": "backgroundColor", "value": "rgb(255, 0, 0)"},
    {"type": "width", "id": "a", "op": "eq", "px": 100},
])
GOOD = '<div id="a" style="width:100px;background:red">Hi</div>'


def _score(pages: list[str], checks: str = CHECKS, **kw) -> list[float]:
    n = len(pages)
    return reward([None] * n, pages, domain=["frontend"] * n, checks=[checks] * n, **kw)


def test_references_score_one_and_corruptions_do_not():
    """Every family at difficulties 1-3, in one batch: references 1.0, pages with every
    corruption at once <= 0.2 on average, each corruption kind alone below 1.0."""
    rows = []
    for d in (1, 3):   # the first row of each family
        firsts = {}
        for r in make_dataset("test", 30, seed=1, difficulty=d):
            firsts.setdefault(r["family"], dict(r))
        assert set(firsts) == set(FAMILIES)
        rows += firsts.values()
    refs = [r["completion"][-1]["content"] for r in rows]
    rng = random.Random(0)
    variants = [refs, [corrupt(r, ref, rng) for r, ref in zip(rows, refs)]]
    variants += [[corrupt_kind(ref, kind, rng) for ref in refs] for kind in CORRUPTIONS]
    k = len(variants)
    s = reward([r["prompt"] for r in rows] * k, [p for v in variants for p in v],
               domain=[r["domain"] for r in rows] * k, checks=[r["checks"] for r in rows] * k, max_pages=8)
    per = [s[i * len(rows):(i + 1) * len(rows)] for i in range(k)]
    assert per[0] == [1.0] * len(rows)
    assert sum(per[1]) / len(rows) <= 0.2 and max(per[1]) <= 0.34, per[1]
    for kind, scores in zip(CORRUPTIONS, per[2:]):
        assert max(scores) < 1.0, (kind, scores)


def test_the_checks_see_the_rendered_page_not_the_text():
    assert _score([GOOD, f"```html\n{GOOD}\n```", f"Here it is:\n```html\n{GOOD}```"]) == [1.0] * 3
    s = _score([
        '<div id="a" style="width:100px;background:#ff0000">Hi</div>',           # same color, other spelling
        '<style>#a{width:100px;background:red}</style><div id="a">Hi</div>',     # a stylesheet, not inline
        '<div id="a" style="width:100px;background:blue">Hi</div>',              # wrong color
        '<div id="a" style="width:100px;background:red;display:none">Hi</div>',  # not shown
        '<span id="a" style="width:100px;background:red">Hi</span>',             # wrong tag, inline: no width
        '<div id="a" style="width:100px;background:red">Hi there</div>',         # wrong text
        'div id=a red Hi',
    ])
    assert s == [1.0, 1.0, 2 / 3, 0.0, 1 / 3, 2 / 3, 0.0], s


def test_layout_relations():
    checks = json.dumps([{"type": "row", "ids": ["a", "b"]}, {"type": "above", "a": "a", "b": "c"},
                         {"type": "inside", "inner": "b", "outer": "r"}, {"type": "centered", "id": "c"},
                         {"type": "width", "id": "c", "op": "ge", "px": 200}])
    good = ('<div id="r" style="display:flex"><p id="a">One</p><p id="b">Two</p></div>'
            '<div id="c" style="margin:auto;width:250px">Mid</div>')
    broken = ('<div id="c" style="width:150px">Mid</div>'
              '<div id="r" style="display:grid"><p id="a">One</p></div><p id="b">Two</p>')
    assert _score([good, broken], checks) == [1.0, 0.0]


def _page_deadline(floor_s: float = 4.0) -> float:
    """A page deadline for tests on a busy machine: `floor_s`, or 8x what a batch of two
    good pages takes right now (a fixed 4 s failed good pages in CI rehearsals that shared
    the cores), so the deadline scales with the load instead of racing it. 8x: in the
    batch it is used for, good pages share the CPU with hostile pages' endless scripts."""
    _score([GOOD])                       # the pool warm: a launch is not the measure
    t0 = time.perf_counter()
    assert _score([GOOD, GOOD]) == [1.0, 1.0]
    return max(floor_s, 8 * (time.perf_counter() - t0))


def test_hostile_pages_are_contained_and_score_zero():
    """In one batch with good pages: each hostile page scores 0, the good ones 1, and the
    batch takes about one page deadline, not one per hung page."""
    hostile = [
        GOOD + "<script>while (true) {}</script>",                                  # never loads
        GOOD + "<script>setTimeout(() => { while (true) {} }, 0)</script>",         # hangs after load
        GOOD + '<img src="http://example.com/x.png">',                             # network
        GOOD + '<script>fetch("https://example.com/")</script>',
        GOOD + '<script>new WebSocket("ws://example.com/")</script>',
        GOOD + '<script>window.open("about:blank")</script>',                      # popup
        GOOD + '<script>alert("hi")</script>' + "<script>while (true) {}</script>",
    ]
    deadline = _page_deadline()
    t0 = time.perf_counter()
    s = _score([GOOD, *hostile, GOOD], timeout_s=deadline, max_pages=16)
    took = time.perf_counter() - t0
    assert s[0] == 1.0 and s[-1] == 1.0, s
    assert s[1:-1] == [0.0] * len(hostile), s
    assert took < deadline * 3, (took, deadline)   # one deadline for all of them, not one each
    # and the pool still serves the next batch at full speed
    assert _score([GOOD]) == [1.0]


def test_a_page_cannot_fake_styles_or_boxes():
    fake = ('<div id="a" style="width:10px;background:blue">Hi</div><script>'
            'window.getComputedStyle = () => ({backgroundColor: "rgb(255, 0, 0)", display: "block", '
            'visibility: "visible", opacity: "1"});'
            'Element.prototype.getBoundingClientRect = () => ({width: 100, height: 20, left: 0, right: 100});'
            'document.getElementById = () => null;</script>')
    assert _score([fake]) == [1 / 3]   # only the text, which is right


def test_a_killed_browser_is_replaced():
    pool = B.get_pool(None, 4)
    assert _score([GOOD]) == [1.0]
    pids = pool.browser_pids()
    assert pids
    before, old_tmp = pool.launches, list(pool.tmp_dirs)
    # Chromium's singleton socket lives in an org.chromium.Chromium.* folder in the launch's
    # own TMPDIR, which the SIGKILLed browser cannot remove: the pool does, on relaunch
    assert len(old_tmp) == 1 and any(Path(old_tmp[0]).glob("org.chromium.*"))
    for p in pids:
        os.kill(p, signal.SIGKILL)
    assert _score([GOOD, GOOD]) == [1.0, 1.0]
    assert pool.launches == before + 1
    assert not Path(old_tmp[0]).exists() and len(pool.tmp_dirs) == 1


def test_a_browser_dying_mid_batch_does_not_stall_it():
    """The browser is SIGKILLed while pages wait for their turn (2 at a time, one of them
    hung): the batch finishes, on a relaunched browser, with every good page scored."""
    pool = B.get_pool(None, 2)
    _score([GOOD], max_pages=2)
    pids, before = pool.browser_pids(), pool.launches
    killer = threading.Timer(0.5, lambda: [os.kill(p, signal.SIGKILL) for p in pids])
    killer.start()
    t0 = time.perf_counter()
    s = _score([GOOD + "<script>while (true) {}</script>"] + [GOOD] * 8, timeout_s=4.0, max_pages=2)
    killer.join()
    assert s == [0.0] + [1.0] * 8, s
    assert pool.launches == before + 1
    assert time.perf_counter() - t0 < 30


def test_called_from_threads_and_inside_a_running_event_loop():
    """As TRL, the MOPD reward mix and the evals call it: from several threads at once, and
    from code running inside an asyncio loop (where Playwright's sync API would refuse)."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    async def inside_a_loop():
        return _score([GOOD])
    assert asyncio.run(inside_a_loop()) == [1.0]
    with ThreadPoolExecutor(4) as ex:
        outs = list(ex.map(lambda i: _score([GOOD, "<p>x</p>"]), range(4)))
    assert outs == [[1.0, 0.0]] * 4


@pytest.mark.ci   # second tier: a forked child starts its own Chromium (~45 s); the fast tier stays under 10 minutes
def test_a_forked_child_gets_its_own_browser():
    """A process forked after the pool started (a DataLoader worker, say) inherits the pool
    object but not its thread or browser: it renders with a browser of its own."""
    assert _score([GOOD]) == [1.0]
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:   # the child: report, never return into pytest
        try:
            os.write(w, json.dumps(_score([GOOD, "<p>x</p>"], timeout_s=20)).encode())
            B._close_all()   # os._exit skips atexit: close the child's browser and driver here
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        got = f.read()
    os.waitpid(pid, 0)
    assert json.loads(got) == [1.0, 0.0]
    assert _score([GOOD]) == [1.0]   # the parent's pool still works


def test_rows_and_outputs():
    n = 4
    out = reward([None] * n, ["", "x" * 30_000, GOOD, [{"role": "assistant", "content": GOOD}]],
                 domain=["frontend", "frontend", "code", "frontend"], checks=[CHECKS] * n)
    assert out == [0.0, 0.0, None, 1.0]
    with pytest.raises(ValueError, match="row 0 has no `checks`"):
        reward([None], [GOOD], domain=["frontend"])
    with pytest.raises(ValueError, match="unknown check"):
        reward([None], [GOOD], domain=["frontend"], checks=[json.dumps([{"type": "nope"}])])


def test_no_browser_is_a_clear_error_before_any_page(monkeypatch, tmp_path):
    monkeypatch.delenv(B.ENV_EXECUTABLE, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(B.BrowserUnavailable, match="apt-get install -y chromium"):
        reward.preflight()
    monkeypatch.setenv(B.ENV_EXECUTABLE, str(tmp_path / "nope"))
    with pytest.raises(B.BrowserUnavailable, match="MOPD_CHROMIUM"):
        B.find_chromium()
    with pytest.raises(B.BrowserUnavailable, match="not an executable"):
        reward([None], [GOOD], domain=["frontend"], checks=[CHECKS], executable=str(tmp_path / "nope"))
    from mopd.distill.data import load_reward_fn
    with pytest.raises(B.BrowserUnavailable):
        load_reward_fn("rewards.frontend:reward")


# ----------------------------------------------------------------------------- killed host
HOST = textwrap.dedent("""
    import json, sys, threading, time
    from rewards.frontend import reward
    checks = json.dumps([{"type": "exists", "id": "a", "tag": "div"}])
    page = '<div id="a">x</div>'
    assert reward([None], [page], domain=["frontend"], checks=[checks]) == [1.0]
    from rewards.browser import _POOLS
    pool = next(iter(_POOLS.values()))
    threading.Thread(target=reward, args=([None], [page + "<script>while (true) {}</script>"]),
                     kwargs=dict(domain=["frontend"], checks=[checks], timeout_s=300), daemon=True).start()
    time.sleep(1.0)
    print(json.dumps({"groups": pool.groups, "watchdog": pool._watchdog.pid, "dirs": pool.profile_dirs,
                      "tmp": pool.tmp_dirs}), flush=True)
    time.sleep(300)
""")


def _live_in_group(g: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[2]) == g and fields[0] != "Z":
                out.append(int(d))
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("stopped", [False, True], ids=["plain", "browser-stopped"])
def test_a_killed_host_leaves_no_browser(stopped):
    """SIGKILL of the host's whole process group (Python and Playwright's node driver) while
    a page loops: every process of the browser is gone soon after, and its temp profile.
    With the browser SIGSTOPped first, it cannot notice its driver is gone: the watchdog
    kills it (without the watchdog this variant fails: checked by hand)."""
    host = subprocess.Popen([sys.executable, "-c", HOST], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    groups: list[int] = []
    try:
        line = host.stdout.readline()
        assert line, "the host printed nothing"
        info = json.loads(line)
        groups = info["groups"]
        assert groups and all(_live_in_group(g) for g in groups)
        assert info["dirs"] and all(Path(d).is_dir() for d in info["dirs"])
        assert info["tmp"] and all(any(Path(d).glob("org.chromium.*")) for d in info["tmp"])
        if stopped:
            for g in groups:
                os.killpg(g, signal.SIGSTOP)
        os.killpg(host.pid, signal.SIGKILL)
        host.wait(timeout=30)
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline and (any(_live_in_group(g) for g in groups) or _alive(info["watchdog"])):
            time.sleep(0.5)
        assert not any(_live_in_group(g) for g in groups), [(g, _live_in_group(g)) for g in groups]
        assert not _alive(info["watchdog"])
        assert not any(Path(d).exists() for d in info["dirs"])   # the browser profile is removed too
        assert not any(Path(d).exists() for d in info["tmp"])    # and its TMPDIR (singleton socket)
    finally:
        for g in groups:
            try:
                os.killpg(g, signal.SIGKILL)
            except OSError:
                pass
        if host.poll() is None:
            os.killpg(host.pid, signal.SIGKILL)

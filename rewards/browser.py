"""One long-lived headless Chromium that renders many untrusted HTML pages, for the
`frontend` reward (rewards/frontend.py) and its eval's screenshots.

The browser is Debian's `chromium` (or $MOPD_CHROMIUM), driven by Playwright's async API
with `executable_path`; Playwright's own browser download is never used.

Why it is built this way:
  - The reward is called synchronously from TRL's GRPOTrainer, the MOPD reward mix and
    the evals, from any thread and possibly inside a running asyncio loop, where
    Playwright's sync API refuses to work. So the pool owns one daemon thread with its own
    event loop; `render()` submits a coroutine to it and waits. Browser start-up (~0.5 s)
    is paid once per process, not per batch.
  - One browser context per page (own cookies, storage and renderer process), up to
    `max_pages` at once. Every page has one wall-clock deadline for load, checks and
    screenshot: a page that loops forever, blocks on an alert or never fires `load` is
    abandoned at its deadline and its context closed (which kills its renderer); the
    other pages of the batch are not held up.
  - Every request the page makes is aborted (the page itself is set with set_content, so
    it needs none) and recorded; the browser also runs with a proxy that points nowhere, so
    what routing cannot see (WebSockets, prefetch) fails too. Windows a page opens are
    recorded and closed.
  - The checks run in an isolated JS world (CDP Page.createIsolatedWorld): the page's own
    scripts share the DOM with it but not its globals, so a page that overrides
    getComputedStyle or getBoundingClientRect cannot lie to the checker.
  - A browser that crashed or disconnected is relaunched on the next batch, and the pages
    a browser crash took down are rendered once more.
  - Killed host: Playwright's node driver closes the browser when its stdin (our pipe)
    closes, and Chromium exits when its debugging pipe to the driver closes; both were
    seen to work on SIGKILL of the host. For what that does not cover (the driver killed
    with the host, a stopped or wedged browser) a watchdog process in its own session
    waits for the host to go and then SIGKILLs the process group of every browser the host
    launched (tests/unit/rewards/test_reward_frontend.py kills a host whose browser is
    SIGSTOPped).
  - Each launch gets its own TMPDIR (mopd-browser-tmp-*): Chromium keeps its singleton
    socket in an org.chromium.Chromium.* folder there, which a killed browser cannot remove
    itself; the pool removes the folder when the browser is dropped or closed, the watchdog
    when the host is gone.
"""
from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ENV_EXECUTABLE = "MOPD_CHROMIUM"
CANDIDATES = ("chromium", "chromium-browser", "google-chrome")
INSTALL_HINT = ("install Debian's chromium (`apt-get install -y chromium`, which scripts/install.sh does when "
                "run as root) or point $MOPD_CHROMIUM at a Chromium/Chrome executable")
TAG = "MOPD_BROWSER_RUN"          # env var every launched browser carries: <host pid>-<nonce>-<launch>
VIEWPORT = {"width": 800, "height": 600}
# The pages are small: the top of the viewport is what a grid of screenshots needs.
SCREENSHOT_CLIP = {"x": 0, "y": 0, "width": 800, "height": 320}
CLOSE_TIMEOUT_S = 5.0
SETTLE_S = 0.3            # after load, before the checks: late request/popup events arrive
LAUNCH_TIMEOUT_S = 90.0
TMP_PREFIX = "mopd-browser-tmp-"   # each launch's TMPDIR, removed with the browser
# Chromium flags: no network at all (a proxy that points at a closed port; routing aborts
# the requests it sees first), no background traffic, nothing written outside /tmp.
BROWSER_ARGS = ["--proxy-server=http://127.0.0.1:9", "--proxy-bypass-list=<-loopback>",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--no-first-run", "--disable-dev-shm-usage", "--mute-audio", "--disable-gpu"]


class BrowserUnavailable(RuntimeError):
    """No Chromium to render pages with (the message says how to install one)."""


def find_chromium(executable: str | None = None) -> str:
    """The browser executable: `executable`, else $MOPD_CHROMIUM, else the first of
    chromium / chromium-browser / google-chrome on PATH; BrowserUnavailable if none."""
    given = executable or os.environ.get(ENV_EXECUTABLE)
    if given:
        path = shutil.which(given) or (given if os.path.isfile(given) and os.access(given, os.X_OK) else None)
        if not path:
            src = "executable=" if executable else f"${ENV_EXECUTABLE}="
            raise BrowserUnavailable(f"frontend reward: browser {src}{given!r} is not an executable file; {INSTALL_HINT}")
        return path
    for name in CANDIDATES:
        path = shutil.which(name)
        if path:
            return path
    raise BrowserUnavailable(f"frontend reward: no browser found ({', '.join(CANDIDATES)} on PATH, "
                             f"${ENV_EXECUTABLE} unset); {INSTALL_HINT}")


def check_playwright() -> None:
    try:
        import playwright.async_api  # noqa: F401
    except ImportError as e:
        raise BrowserUnavailable(f"frontend reward: the playwright package is missing ({e}); "
                                 "`pip install playwright==1.65.2` (a dependency of mopd)") from None


@dataclass
class PageJob:
    html: str
    script: str                    # a JS expression evaluated in an isolated world after load
    screenshot: str | None = None  # write a PNG of the viewport's top (SCREENSHOT_CLIP) here


@dataclass
class PageResult:
    loaded: bool = False
    value: object = None           # what `script` returned (JSON-able), None if it did not run
    requests: list[str] = field(default_factory=list)   # URLs the page tried to fetch (all aborted)
    popups: int = 0                # windows the page opened (all closed)
    error: str | None = None       # "timeout", "crashed", "browser", or an exception's text
    seconds: float = 0.0
    screenshot: str | None = None  # the PNG written, if any
    console: list[str] = field(default_factory=list)    # console errors and uncaught exceptions (first 8)


# ----------------------------------------------------------------------------- watchdog
# Runs as `python -c WATCHDOG <tag prefix> <host pid> <TMP_PREFIX>` in its own session (so a kill of the
# host's process group spares it); stdin is a pipe from the host that carries only lines
# "g <browser process group>", "f <group gone>" and "d <browser profile dir>". EOF (the host
# is gone) or the host pid gone: SIGKILL every process carrying the tag and every browser
# process (comm chrom*) in the recorded groups, remove the profile dirs (the driver that
# would have removed them may be dead too), and exit.
WATCHDOG = r'''
import os, select, shutil, signal, sys, tempfile, time
prefix, host, tmp_prefix = sys.argv[1].encode(), int(sys.argv[2]), sys.argv[3]
groups, dirs, buf = set(), set(), b""

def host_alive():
    try:
        os.kill(host, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True

def tagged():
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/environ", "rb") as f:
                    env = f.read()
            except OSError:
                continue
            if b"\0MOPD_BROWSER_RUN=" + prefix in b"\0" + env:
                out.append(int(d))
    return out

while True:
    r, _, _ = select.select([0], [], [], 1.0)
    if r:
        chunk = os.read(0, 4096)
        if not chunk:
            break
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            kind, _, arg = line.decode(errors="replace").partition(" ")
            if kind == "g" and arg.isdigit():
                groups.add(int(arg))
            elif kind == "f" and arg.isdigit():
                groups.discard(int(arg))
            elif kind == "d":
                dirs.add(arg)
    elif not host_alive():
        break
time.sleep(2.0)   # give the driver and browser the chance to close themselves


def members(gs):
    """Live browser processes (comm chrom*) in process groups `gs`: a group id recorded
    long ago may have been reused by someone else's processes, which are spared."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            comm, rest = stat[stat.find("(") + 1:stat.rfind(")")], stat[stat.rfind(")") + 2:].split()
            if comm.startswith("chrom") and rest[0] != "Z" and int(rest[2]) in gs:
                out.append(int(d))
    return out


for _ in range(5):
    pids = tagged()
    gs = set(groups)
    for p in pids:
        try:
            gs.add(os.getpgid(p))
        except OSError:
            pass
    gs.discard(os.getpgid(0))
    victims = set(pids) | set(members(gs))
    for p in victims:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass
    if not victims:
        break
    time.sleep(0.5)
for d in dirs:   # only Playwright's profile folders and our per-launch TMPDIRs in the temp dir
    if os.path.dirname(d) == tempfile.gettempdir() and os.path.basename(d).startswith(
            ("playwright_chromiumdev_profile-", tmp_prefix)):
        shutil.rmtree(d, ignore_errors=True)
'''


def _tagged_pids(value: str) -> list[int]:
    """Processes whose environment has TAG=value (the browser's main process; its
    children clear their environment, but share its process group)."""
    needle = f"\0{TAG}={value}\0".encode()
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                env = b"\0" + f.read()
        except OSError:
            continue
        if needle in env + b"\0":
            out.append(int(d))
    return out


def _profile_dirs(pid: int) -> list[str]:
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return []
    return [a.decode().split("=", 1)[1] for a in args if a.startswith(b"--user-data-dir=")]


# ----------------------------------------------------------------------------- the pool
class BrowserPool:
    """A lazily started browser serving `render()` calls from any thread (module doc)."""

    def __init__(self, executable: str | None = None, *, max_pages: int = 4):
        self.executable = executable
        self.max_pages = max(1, int(max_pages))
        self.prefix = f"{os.getpid()}-{secrets.token_hex(4)}"
        self.launches = 0
        self.groups: list[int] = []          # process groups of the browsers launched
        self.profile_dirs: list[str] = []    # their --user-data-dir (Playwright's temp profiles)
        self.tmp_dirs: list[str] = []        # their TMPDIRs (TMP_PREFIX), removed with them
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._pw = None
        self._browser = None
        self._watchdog: subprocess.Popen | None = None
        self._sem: asyncio.Semaphore | None = None
        self._launch_lock: asyncio.Lock | None = None
        self._owner = os.getpid()

    # -- plumbing
    def _start_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._owner != os.getpid():
                # a forked child inherits this object but not the thread, the driver or the
                # browser: start from nothing (the parent's browser stays the parent's)
                self.__init__(self.executable, max_pages=self.max_pages)
            if self._loop is None:
                loop = asyncio.new_event_loop()
                t = threading.Thread(target=loop.run_forever, name="mopd-browser", daemon=True)
                t.start()
                self._loop, self._thread = loop, t
            return self._loop

    def _start_watchdog(self) -> None:
        if self._watchdog is None or self._watchdog.poll() is not None:
            self._watchdog = subprocess.Popen(
                [sys.executable, "-c", WATCHDOG, self.prefix, str(os.getpid()), TMP_PREFIX], stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True)
            for g in self.groups:
                self._tell_watchdog(f"g {g}")

    def _tell_watchdog(self, line: str) -> None:
        try:
            self._watchdog.stdin.write(f"{line}\n".encode())
            self._watchdog.stdin.flush()
        except (OSError, AttributeError, ValueError):
            pass

    async def _ensure_browser(self):
        if self._launch_lock is None:
            self._launch_lock = asyncio.Lock()
            self._sem = asyncio.Semaphore(self.max_pages)
        async with self._launch_lock:
            if self._browser is not None and self._browser.is_connected():
                return self._browser
            await self._drop_browser()
            from playwright.async_api import async_playwright

            exe = find_chromium(self.executable)
            if self._pw is None:
                self._pw = await async_playwright().start()
            self.launches += 1
            value = f"{self.prefix}-{self.launches}"
            env = {k: v for k, v in os.environ.items()}
            env[TAG] = value
            self._start_watchdog()
            tmp = tempfile.mkdtemp(prefix=TMP_PREFIX)
            env["TMPDIR"] = tmp
            self.tmp_dirs.append(tmp)
            self._tell_watchdog(f"d {tmp}")
            self._browser = await self._pw.chromium.launch(
                executable_path=exe, args=BROWSER_ARGS, env=env, handle_sigint=False, handle_sigterm=False,
                handle_sighup=False, timeout=60_000)
            for pid in _tagged_pids(value):
                try:
                    g = os.getpgid(pid)
                except OSError:
                    continue
                if g != os.getpgid(0) and g not in self.groups:   # never our own group
                    self.groups.append(g)
                    self._tell_watchdog(f"g {g}")
                self.profile_dirs += [d for d in _profile_dirs(pid) if d not in self.profile_dirs]
                for d in self.profile_dirs:
                    self._tell_watchdog(f"d {d}")
            return self._browser

    async def _drop_browser(self) -> None:
        b, self._browser = self._browser, None
        if b is None:
            return
        try:
            await _within(b.close(), CLOSE_TIMEOUT_S)
        except Exception:
            pass
        self._kill_groups()
        self._remove_tmp_dirs()

    def _remove_tmp_dirs(self) -> None:
        """The TMPDIRs of every browser launched so far (none is live when this runs)."""
        for d in self.tmp_dirs:
            shutil.rmtree(d, ignore_errors=True)
        self.tmp_dirs = []

    def _kill_groups(self) -> None:
        """SIGKILL the process groups of browsers launched so far that are not the live one."""
        live = set()
        if self._browser is not None and self.launches:
            for pid in _tagged_pids(f"{self.prefix}-{self.launches}"):
                try:
                    live.add(os.getpgid(pid))
                except OSError:
                    pass
        for g in list(self.groups):
            if g in live:
                continue
            try:
                os.killpg(g, signal.SIGKILL)
            except OSError:
                pass
            self.groups.remove(g)
            self._tell_watchdog(f"f {g}")   # gone: its id may be reused by someone else

    # -- one page
    async def _page(self, browser, job: PageJob, timeout_s: float) -> PageResult:
        res = PageResult()
        t0 = time.perf_counter()
        opened: list = []   # the context, once there is one
        async with self._sem:
            try:
                res.value = await _within(self._open_and_work(browser, job, res, opened, timeout_s), timeout_s)
            except asyncio.TimeoutError:
                res.error = "timeout"
            except Exception as e:   # page crash, closed target, browser gone
                msg = str(e).split("\n")[0][:200]
                res.error = "crashed" if "crash" in msg.lower() else \
                    "browser" if not browser.is_connected() else msg or type(e).__name__
            finally:
                for ctx in opened:
                    try:
                        await _within(ctx.close(), CLOSE_TIMEOUT_S)
                    except Exception:
                        pass
        res.seconds = time.perf_counter() - t0
        return res

    async def _open_and_work(self, browser, job: PageJob, res: PageResult, opened: list, timeout_s: float):
        ctx = await browser.new_context(viewport=VIEWPORT, java_script_enabled=True, service_workers="block",
                                        accept_downloads=False)
        opened.append(ctx)
        ctx.set_default_timeout(timeout_s * 1000)   # what _within abandons ends by itself too
        main: list = []

        async def route(r):
            res.requests.append(r.request.url[:200])
            try:
                await r.abort()
            except Exception:
                pass

        def on_page(p):
            if main and p is not main[0]:
                res.popups += 1
                asyncio.ensure_future(_quiet(p.close()))

        await ctx.route("**/*", route)
        ctx.on("page", on_page)
        page = await ctx.new_page()
        main.append(page)
        page.on("dialog", lambda d: asyncio.ensure_future(_quiet(d.dismiss())))
        page.on("websocket", lambda ws: res.requests.append(ws.url[:200]))   # routing does not see these
        # what the page's scripts broke (frontend_loop's render report shows the model)
        page.on("console", lambda m: _keep(res.console, m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: _keep(res.console, str(e)))
        return await self._work(ctx, page, job, res)

    async def _work(self, ctx, page, job: PageJob, res: PageResult):
        await page.set_content(job.html, wait_until="load")
        res.loaded = True
        # A request, socket or popup the page starts while loading (a fetch, window.open, a
        # setTimeout(0)) reaches its handler through the driver a little later; closing the
        # context first would lose it and score a cheating page as clean (seen under load).
        await asyncio.sleep(SETTLE_S)
        cdp = await ctx.new_cdp_session(page)
        tree = await cdp.send("Page.getFrameTree")
        world = await cdp.send("Page.createIsolatedWorld", {
            "frameId": tree["frameTree"]["frame"]["id"], "worldName": "mopd-checks"})
        out = await cdp.send("Runtime.evaluate", {"expression": job.script, "contextId": world["executionContextId"],
                                                  "returnByValue": True, "awaitPromise": False})
        if "exceptionDetails" in out:
            raise RuntimeError(f"check script failed: {out['exceptionDetails'].get('text', '')[:200]}")
        value = out.get("result", {}).get("value")
        if job.screenshot:
            Path(job.screenshot).parent.mkdir(parents=True, exist_ok=True)
            await page.screenshot(path=job.screenshot, animations="disabled", clip=SCREENSHOT_CLIP)
            res.screenshot = job.screenshot
        return value

    async def _batch(self, jobs: list[PageJob], timeout_s: float) -> list[PageResult]:
        browser = await _within(self._ensure_browser(), LAUNCH_TIMEOUT_S)
        results = list(await asyncio.gather(*[self._page(browser, j, timeout_s) for j in jobs]))
        again = [i for i, r in enumerate(results) if r.error == "browser" or
                 (r.error and not browser.is_connected())]
        if again:   # the browser died under these pages: once more on a fresh one
            browser = await _within(self._ensure_browser(), LAUNCH_TIMEOUT_S)
            redo = await asyncio.gather(*[self._page(browser, jobs[i], timeout_s) for i in again])
            for i, r in zip(again, redo):
                results[i] = r
        return results

    # -- API
    def render(self, jobs: list[PageJob], *, timeout_s: float = 10.0) -> list[PageResult]:
        """Render every job (at most max_pages at once) -> one PageResult each, in order.
        Never raises for a page; raises BrowserUnavailable when there is no browser."""
        if not jobs:
            return []
        loop = self._start_loop()
        if threading.current_thread() is self._thread:
            raise RuntimeError("BrowserPool.render called from the pool's own thread")
        fut = asyncio.run_coroutine_threadsafe(self._batch(list(jobs), float(timeout_s)), loop)
        # Each page ends at its deadline; this bound (every page at its deadline and slow to
        # close, twice, plus a launch) is only reached if the pool itself is wedged.
        rounds = -(-len(jobs) // self.max_pages)
        limit = 2 * LAUNCH_TIMEOUT_S + 2 * rounds * (float(timeout_s) + CLOSE_TIMEOUT_S + 5)
        try:
            return fut.result(timeout=limit)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise RuntimeError(f"browser pool: {len(jobs)} pages not done after {limit:.0f} s; the browser "
                               "or its driver is wedged") from None

    def browser_pids(self) -> list[int]:
        """Main process of the live browser (for tests and diagnostics)."""
        return _tagged_pids(f"{self.prefix}-{self.launches}") if self.launches else []

    def close(self) -> None:
        """Close the browser and the driver; the pool can be used again afterwards."""
        if self._loop is None:
            return

        async def _close():
            await self._drop_browser()
            if self._pw is not None:
                try:
                    await _within(self._pw.stop(), CLOSE_TIMEOUT_S)
                except Exception:
                    pass
                self._pw = None
        try:
            asyncio.run_coroutine_threadsafe(_close(), self._loop).result(timeout=3 * CLOSE_TIMEOUT_S)
        except Exception:
            pass
        self._kill_groups()
        self._remove_tmp_dirs()
        if self._watchdog is not None:
            try:
                self._watchdog.stdin.close()   # EOF: it sweeps (nothing is left) and exits
            except OSError:
                pass
            self._watchdog = None
        # a browser launched after this must not carry the tag the old watchdog sweeps for
        self.prefix = f"{os.getpid()}-{secrets.token_hex(4)}"
        self.groups, self.profile_dirs = [], []


async def _within(coro, timeout_s: float):
    """`coro`'s result, or asyncio.TimeoutError after timeout_s. Unlike asyncio.wait_for,
    it does not wait for the cancelled coroutine to wind down: a Playwright call stuck on a
    dead or wedged browser cannot hold up the caller past its deadline."""
    task = asyncio.ensure_future(coro)
    done, _ = await asyncio.wait({task}, timeout=max(0.05, float(timeout_s)))
    if not done:
        task.cancel()
        task.add_done_callback(lambda t: t.cancelled() or t.exception())   # no "never retrieved" noise
        raise asyncio.TimeoutError
    return task.result()


def _keep(lines: list[str], text: str, most: int = 8) -> None:
    if len(lines) < most:
        lines.append(str(text).split("\n")[0][:200])


async def _quiet(coro) -> None:
    try:
        await coro
    except Exception:
        pass


_POOLS: dict[tuple[str | None, int], BrowserPool] = {}
_POOLS_LOCK = threading.Lock()


def get_pool(executable: str | None = None, max_pages: int = 4) -> BrowserPool:
    """The process's pool for (executable, max_pages), created on first use."""
    key = (executable, int(max_pages))
    with _POOLS_LOCK:
        if key not in _POOLS:
            _POOLS[key] = BrowserPool(executable, max_pages=max_pages)
        return _POOLS[key]


@atexit.register
def _close_all() -> None:
    for p in list(_POOLS.values()):
        p.close()

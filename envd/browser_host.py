"""One Chromium per envd process, shared by every browser session through its own BrowserContext.

Playwright objects belong to the event loop that made them, while envd runs backend calls in a pool of worker
threads. So the host owns one dedicated thread running an asyncio loop with the Playwright async API; sessions
submit coroutines to it (`BrowserHost.call`) and wait for the result with a deadline. The loop interleaves the
calls of many sessions; nothing on it blocks.

Lifetime:
  - the browser (and Playwright's node driver) start lazily with the first `acquire()`;
  - if the browser process dies, every session bound to it fails its next call (BrowserGone, which envd reports as
    INFRA_ERROR) and the next `acquire()` launches a new one (a new `generation`); if Playwright's node driver
    dies (Chromium exits with it), the next `acquire()` starts a new driver too;
  - when the last session releases it, the browser and the driver are shut down after `linger_s` (a daemon that
    closes and re-creates sessions back to back keeps one browser; an idle daemon holds no Chromium);
  - `shutdown()` closes everything now; it runs at interpreter exit too. If this process is killed outright, the
    driver sees its stdin close and exits, and Chromium exits when its DevTools pipe closes.
"""
from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import logging
import os
import signal
import threading
from typing import Any, Awaitable, Callable

from envd import proctree

log = logging.getLogger("envd.browser")

CHROMIUM = "/usr/bin/chromium"
# Flags known to work headless in containers; no sandbox because envd itself runs inside one (and as root in CI).
CHROMIUM_ARGS = ("--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--no-first-run", "--disable-dev-shm-usage", "--disable-sync")


class BrowserGone(RuntimeError):
    """The browser process behind a session died (or was shut down): the session cannot go on."""


class BrowserTimeout(RuntimeError):
    """A call on the browser thread ran past its deadline."""


def _stat(pid: str) -> list[str] | None:
    """/proc/<pid>/stat fields after the command name: [state, ppid, pgrp, ...]; None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def proc_children(pid: int) -> list[tuple[int, str]]:
    """(pid, argv[0]) of the live children of `pid`."""
    out = []
    for d in os.listdir("/proc"):
        st = _stat(d) if d.isdigit() else None
        if st is None or st[0] == "Z" or int(st[1]) != pid:
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                out.append((int(d), f.read().split(b"\0", 1)[0].decode(errors="replace")))
        except OSError:
            continue  # it went away while we looked
    return out


def process_group(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group `pgid`."""
    out = []
    for d in os.listdir("/proc"):
        st = _stat(d) if d.isdigit() else None
        if st is not None and st[0] != "Z" and int(st[2]) == pgid:
            out.append(int(d))
    return out


class BrowserHost:
    def __init__(self, executable: str = CHROMIUM, args: tuple[str, ...] = CHROMIUM_ARGS, linger_s: float = 5.0,
                 launch_timeout_s: float = 60.0):
        self.executable, self.args = executable, tuple(args)
        self.linger_s = linger_s                  # idle time before an unused browser is shut down
        self.launch_timeout_s = launch_timeout_s
        self._lock = threading.Lock()             # guards the fields below that worker threads touch
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._users = 0                           # sessions holding the browser
        self._epoch = 0                           # bumped by every acquire: a pending idle close checks it
        self._atexit = False
        # Written only on the browser thread (read anywhere):
        self._alock: asyncio.Lock | None = None   # serialises launch and close
        self._pw = None
        self._browser = None
        self.generation = 0                       # bumped by every launch; a session remembers its own
        self.browser_pid: int | None = None       # Chromium's main process (the leader of its process group)
        self.driver_pid: int | None = None        # Playwright's node driver
        self.launches = 0

    # ---- the browser thread ---------------------------------------------------------------------------------
    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is not None and self._thread is not None and self._thread.is_alive():
                return self._loop
            loop = asyncio.new_event_loop()
            ready = threading.Event()

            def main() -> None:
                asyncio.set_event_loop(loop)
                loop.call_soon(ready.set)
                loop.run_forever()

            t = threading.Thread(target=main, name="envd-browser", daemon=True)
            t.start()
            if not ready.wait(10.0):
                raise BrowserTimeout("the browser thread did not start within 10 s")
            self._loop, self._thread = loop, t
            if not self._atexit:
                atexit.register(self.shutdown)
                self._atexit = True
            return loop

    def call(self, fn: Callable[..., Awaitable[Any]], *args: Any, timeout: float) -> Any:
        """Run the coroutine `fn(*args)` on the browser thread and return its result; BrowserTimeout past
        `timeout` seconds (the coroutine is then cancelled). Exceptions from `fn` propagate unchanged."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("BrowserHost.call from the browser thread would deadlock")
        loop = self._ensure_loop()
        fut = asyncio.run_coroutine_threadsafe(fn(*args), loop)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            if fut.done():
                raise  # the coroutine itself raised TimeoutError
            fut.cancel()
            raise BrowserTimeout(f"{getattr(fn, '__qualname__', fn)} took longer than {timeout:g}s") from None

    # ---- sessions -------------------------------------------------------------------------------------------
    def acquire(self, timeout: float) -> tuple[Any, int]:
        """(browser, generation) for a new session; launches the browser if none is running. Pair with release()."""
        with self._lock:
            self._users += 1
            self._epoch += 1
        try:
            return self.call(self._ensure_browser, timeout=timeout)
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users > 0 or self._loop is None:
                return
            epoch, loop = self._epoch, self._loop
        try:
            asyncio.run_coroutine_threadsafe(self._close_if_idle(epoch), loop)
        except RuntimeError:
            pass  # the loop is closed already: nothing left to shut down

    @property
    def users(self) -> int:
        return self._users

    def alive(self, generation: int) -> bool:
        """Whether the browser of `generation` is still the running one. Its driver must live too: when Playwright's
        node driver dies, Chromium exits with it but the Browser object still says it is connected."""
        b = self._browser
        return b is not None and generation == self.generation and b.is_connected() and self._driver_alive()

    def _driver_alive(self) -> bool:
        return self.driver_pid is None or proctree.alive(self.driver_pid)

    def lost(self, generation: int) -> None:
        """A session found the browser of `generation` dead (a TargetClosedError): the next acquire() launches anew."""
        if generation == self.generation and self._browser is not None:
            log.warning("Chromium (generation %d, pid %s) is gone", generation, self.browser_pid)
            self._browser = None

    async def _ensure_browser(self) -> tuple[Any, int]:
        if self._alock is None:
            self._alock = asyncio.Lock()
        async with self._alock:
            if self._pw is not None and not self._driver_alive():
                log.warning("the Playwright driver (pid %s) died: starting a new one", self.driver_pid)
                self._browser = None      # its Chromium exited with the driver; the object cannot tell
                await self._teardown()
            if self._browser is not None and self._browser.is_connected():
                return self._browser, self.generation
            if self.browser_pid is not None:  # what is left of a browser that died
                self._kill_group(self.browser_pid)
                self.browser_pid = None
            if self._pw is None:
                from playwright.async_api import async_playwright

                others = {p for p, _ in proc_children(os.getpid())}
                self._pw = await asyncio.wait_for(async_playwright().start(), self.launch_timeout_s)
                drivers = [p for p, exe in proc_children(os.getpid()) if "playwright" in exe and p not in others]
                self.driver_pid = max(drivers) if drivers else None
            before = {p for p, _ in proc_children(self.driver_pid)} if self.driver_pid else set()
            browser = await self._pw.chromium.launch(executable_path=self.executable, args=list(self.args),
                                                     headless=True, timeout=self.launch_timeout_s * 1000)
            self.generation += 1
            self.launches += 1
            gen = self.generation
            browser.on("disconnected", lambda b: self._on_disconnected(b, gen))
            self._browser = browser
            new = [p for p, exe in proc_children(self.driver_pid)
                   if p not in before and "chrom" in exe] if self.driver_pid else []
            self.browser_pid = new[0] if len(new) == 1 else None
            log.info("launched Chromium %s (pid %s, generation %d)", browser.version, self.browser_pid, gen)
            return browser, gen

    def _on_disconnected(self, browser: Any, gen: int) -> None:
        if self._browser is browser:
            log.warning("Chromium (generation %d, pid %s) disconnected", gen, self.browser_pid)
            self._browser = None

    async def _close_if_idle(self, epoch: int) -> None:
        await asyncio.sleep(self.linger_s)
        with self._lock:
            if self._users > 0 or self._epoch != epoch:
                return  # a session came along meanwhile
        await self._close()

    async def _close(self) -> None:
        """Close the browser and stop the driver (each step bounded); kill whatever is left of Chromium's group."""
        if self._alock is None:
            self._alock = asyncio.Lock()
        async with self._alock:
            await self._teardown()

    async def _teardown(self) -> None:
        browser, self._browser = self._browser, None
        pid = self.browser_pid
        if browser is not None:
            try:
                await asyncio.wait_for(browser.close(), 10.0)
            except Exception as e:  # already dead, or hung: the group kill below finishes the job
                log.warning("closing Chromium failed: %s: %s", type(e).__name__, e)
        if self._pw is not None:
            pw, self._pw = self._pw, None
            try:
                await asyncio.wait_for(pw.stop(), 10.0)
            except Exception as e:
                log.warning("stopping the Playwright driver failed: %s: %s", type(e).__name__, e)
        if pid is not None:
            self._kill_group(pid)
        self.browser_pid = self.driver_pid = None

    @staticmethod
    def _kill_group(pgid: int) -> None:
        # Chromium leads its own process group (Playwright starts it detached). Whatever is left of the group after
        # a clean close is killed, unless the leader's pid now belongs to something that is not Chromium.
        left = process_group(pgid)
        if not left:
            return
        try:
            with open(f"/proc/{pgid}/cmdline", "rb") as f:
                if b"chrom" not in f.read():
                    return
        except OSError:
            pass  # the leader is gone; its children still carry the group id
        log.warning("killing %d Chromium process(es) left in group %d", len(left), pgid)
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def shutdown(self, timeout: float = 20.0) -> None:
        """Close the browser and the driver now and stop the browser thread. Safe to call more than once."""
        with self._lock:
            loop, thread = self._loop, self._thread
            self._loop = self._thread = None
        if loop is None or thread is None or not thread.is_alive():
            return
        try:
            asyncio.run_coroutine_threadsafe(self._close(), loop).result(timeout)
            asyncio.run_coroutine_threadsafe(_cancel_other_tasks(), loop).result(timeout)
        except Exception as e:
            log.warning("browser shutdown: %s: %s", type(e).__name__, e)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout)
        if not thread.is_alive():
            loop.close()
        self._alock = None  # bound to the old loop; a later acquire starts a fresh thread and loop


async def _cancel_other_tasks() -> None:
    """Cancel and await the loop's other tasks (an idle-close timer still sleeping), so the loop closes clean."""
    me = asyncio.current_task()
    others = [t for t in asyncio.all_tasks() if t is not me]
    for t in others:
        t.cancel()
    await asyncio.gather(*others, return_exceptions=True)

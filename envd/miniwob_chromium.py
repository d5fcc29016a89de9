"""One MiniWoB++ session's browser: chromedriver + headless Debian Chromium in their own process group, under the
session's private directory, every WebDriver command bounded.

chromedriver is told its port by Selenium, which picks one that is free at that moment (bind to port 0, close) and
starts chromedriver on it. Between the two, any other socket on the host may take that port: an outgoing connection
draws its local port from the same ephemeral range, and a busy envd opens many (one per WebDriver command of every
session). chromedriver then exits at once ("IPv4 port not available. Exiting...", status 1). Nothing was created
yet, so start() starts again on a fresh port, at most START_ATTEMPTS times; any other failure of chromedriver is
raised at once with the last lines chromedriver wrote (its log, chromedriver.log in the session's directory, holds
what it prints at start and its warnings), not Selenium's bare "unexpectedly exited. Status code was: 1".
"""
from __future__ import annotations

import os

from envd.proctree import kill_session, with_parent_death_signal

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
# The flags that work in a container without a GPU or network. --remote-debugging-pipe: Chromium talks to
# chromedriver over a pipe and exits when chromedriver dies, so a killed daemon cannot leave a browser behind.
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--no-first-run", "--disable-dev-shm-usage", "--disable-sync",
                  "--remote-debugging-pipe", f"--disk-cache-size={32 << 20}")
START_ATTEMPTS = 4
PORT_TAKEN = "port not available"  # what chromedriver prints (in any case) when its port was taken
LOG_TAIL_BYTES = 2048


class ChromiumProcess:
    """chromedriver + Chromium for one session: own process group, private directory, bounded commands."""

    def __init__(self, workdir: str, command_timeout_s: float):
        self.workdir, self.command_timeout_s = workdir, command_timeout_s
        self.service = None
        self.driver = None
        self.port_retries = 0  # starts that lost their port to another socket and were made again
        self._log = None       # chromedriver's stdout and stderr (the file object this process owns)

    @property
    def log_path(self) -> str:
        return os.path.join(self.workdir, "chromedriver.log")

    def start(self, window: tuple[int, int]):
        from selenium.common.exceptions import WebDriverException

        for attempt in range(START_ATTEMPTS):
            try:
                return self._start_once(window)
            except WebDriverException as e:
                said = self._log_tail()
                self.stop()
                if PORT_TAKEN in said.lower() and attempt + 1 < START_ATTEMPTS:
                    self.port_retries += 1
                    continue
                if not said:
                    raise
                raise WebDriverException(f"{e.msg}; chromedriver said: {said}") from None
        raise AssertionError("unreachable")

    def _start_once(self, window: tuple[int, int]):
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        argv = with_parent_death_signal([os.environ.get("MINIWOB_CHROMEDRIVER") or CHROMEDRIVER])

        class _Service(Service):  # chromedriver behind setpriv: prepend the rest of argv to chromedriver's args
            def command_line_args(self) -> list[str]:
                return [*argv[1:], *super().command_line_args()] if self.path == argv[0] else super().command_line_args()

        # HOME/XDG dirs: Chromium's crash handler and caches write here, not in the daemon user's home.
        env = {**os.environ, "HOME": self.workdir, "XDG_CONFIG_HOME": os.path.join(self.workdir, "config"),
               "XDG_CACHE_HOME": os.path.join(self.workdir, "cache")}
        opts = webdriver.ChromeOptions()
        opts.binary_location = os.environ.get("MINIWOB_CHROME_BINARY") or CHROMIUM
        for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={self.workdir}/profile", f"--window-size={window[0]},{window[1]}"):
            opts.add_argument(flag)
        # start_new_session: chromedriver and Chromium get their own process group, killed as one on close.
        # The log (this attempt's only): chromedriver's own output at its default level (start-up lines, warnings).
        self._log = open(self.log_path, "w", encoding="utf-8")
        self.service = _Service(executable_path=argv[0], env=env, log_output=self._log,
                                popen_kw={"start_new_session": True})
        self.driver = webdriver.Chrome(service=self.service, options=opts)
        self.driver.command_executor.client_config.timeout = self.command_timeout_s
        self.driver.set_page_load_timeout(self.command_timeout_s)
        self.driver.set_script_timeout(self.command_timeout_s)
        return self.driver

    def _log_tail(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, os.path.getsize(self.log_path) - LOG_TAIL_BYTES))
                lines = f.read().decode("utf-8", "replace").strip().splitlines()
        except OSError:
            return ""
        return " | ".join(line.strip() for line in lines[-3:] if line.strip())

    @property
    def pid(self) -> int:
        p = getattr(self.service, "process", None)
        return p.pid if p is not None else 0

    def stop(self) -> None:
        """Quit politely (bounded), then SIGKILL whatever is left of the session's processes."""
        driver, self.driver = self.driver, None
        if driver is not None:
            try:
                driver.command_executor.client_config.timeout = 5
                driver.quit()
            except Exception:
                pass  # a dead browser cannot be quit; the kill below is what counts
        pid = self.pid
        kill_session(pid, {pid} if pid else set(), needle=self.workdir)
        if pid:
            try:
                self.service.process.wait(timeout=5)
            except Exception:
                pass
        log, self._log = self._log, None
        if log is not None:
            log.close()

"""One MiniWoB++ session's browser: chromedriver + headless Debian Chromium in a bubblewrap sandbox of their own
(envd/bwrap.py), reached through a Unix socket, every WebDriver command bounded.

Why a sandbox: chromedriver has no authentication, and whoever reaches its HTTP port can open a WebDriver session
and start any program as its user (`goog:chromeOptions.binary`). On a TCP port of the host's loopback that is every
local user. Here chromedriver listens on 127.0.0.1:9515 of the sandbox's own network namespace, which nothing
outside reaches, and socat, in the sandbox too, relays the Unix socket `driver.sock` of the sandbox's home to it. The
home is the session's: mode 0700, owned by the sandbox's uid (a root daemon's: one of its own, envd/sandbox_limits.py)
or by the daemon's user, so only they and root connect. A port of its own also ends the race Selenium's launch had
(a port found free, then taken by another socket before chromedriver bound it).

Inside: the system directories, /etc/fonts and Debian's /etc/chromium{,.d} (its wrapper's flags) read-only; the
MiniWoB++ pages read-only at /run/tars/miniwob (file:// URLs); the home read-write at /workspace (profile, caches,
the socket); no network. FlightWoB pages must come over http: for those a second socat in the sandbox serves
127.0.0.1:8000 from envd's page server, which listens on a Unix socket bound in (`flight_socket`).

Limits: the sandbox's uid, files and /tmp (Chromium's shared memory, --disable-dev-shm-usage); the memory of all
of its processes together, by a memory cgroup (`MEMORY_BOUND_MB`) where the daemon makes them (envd/cgroups.py);
per process, address space, processes and CPU time in effect unbounded (V8 reserves a terabyte of address space,
so RLIMIT_AS cannot bound it; threads count as processes).

Lifetime: `stop` kills the sandbox's init (the kernel kills all of its pid namespace with it), waits on its pidfd,
then reaps bwrap; a killed daemon takes the sandbox with it (setpriv --pdeathsig, bwrap --die-with-parent).
"""
from __future__ import annotations

import http.client
import os
import pathlib
import shlex
import shutil
import socket
import subprocess
import time

from envd import scratch
from envd.cgroups import MemoryCgroup, memory_cgroup
from envd.bwrap import SANDBOX_WORKSPACE, sandbox_argv, unreachable, write_etc
from envd.sandbox_exit import end_sandbox, exited, open_pidfd, read_child_pid
from envd.sandbox_limits import Limits, allocate_uid, chown_tree, missing_tools, release_uid

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
# The flags that work in a sandbox without a GPU or network. --remote-debugging-pipe: Chromium talks to
# chromedriver over a pipe, no port. --no-sandbox: Chromium's own sandbox needs user namespaces, which the bwrap
# sandbox does not let it make.
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--no-first-run", "--disable-dev-shm-usage", "--disable-sync",
                  "--remote-debugging-pipe", f"--disk-cache-size={32 << 20}")
PAGES = "/run/tars/miniwob"            # the package's html directory, in the sandbox
PAGES_URL = f"file://{PAGES}/miniwob/"
FLIGHT_URL = "http://127.0.0.1:8000/"  # FlightWoB's pages, in the sandbox (relayed to envd's page server)
DRIVER_PORT, SOCKET, FLIGHT_SOCKET = 9515, "driver.sock", "/run/tars/pages.sock"
BROWSER_LIMITS = Limits(cpu_s=30 * 86400, memory_mb=1 << 26, nproc=1 << 15, fsize_mb=1024, nofile=8192, tmp_mb=256)
# The bound of a session's memory cgroup, above the host budget's claim (MiniWoBEnv.claim, an estimate of a warm
# session's use: ~200 MiB charged measured, docs/envd-miniwob-desktop.md): the first session after the page cache is
# dropped is charged Chromium's files as it reads them (~600 MiB measured), and at a bound of 384 MiB it spent
# 36 s reclaiming and re-reading them in its first episodes instead of 1.5 s.
MEMORY_BOUND_MB = 1024
_ETC = ("/etc/fonts", "/etc/chromium", "/etc/chromium.d")
LOG_TAIL_BYTES = 2048


def programs() -> tuple[str, str]:
    """(Chromium, chromedriver): Debian's, or MINIWOB_CHROME_BINARY's and MINIWOB_CHROMEDRIVER's."""
    return (os.environ.get("MINIWOB_CHROME_BINARY") or CHROMIUM, os.environ.get("MINIWOB_CHROMEDRIVER") or CHROMEDRIVER)


def missing() -> list[str]:
    """The host programs a MiniWoB session needs that are not installed."""
    return missing_tools() + [t for t in ("socat", *programs()) if shutil.which(t) is None]


def pages_dir(uid: int | None) -> str:
    """The MiniWoB++ html directory as `uid` (None: the daemon's own) can read it: the package's own, or, when a
    root daemon's package lies where other uids cannot pass (/root/...), a copy in this process's scratch."""
    from miniwob.selenium_instance import HTML_DIR

    if uid is None or not unreachable(pathlib.Path(HTML_DIR) / "x") and os.stat(HTML_DIR).st_mode & 0o005 == 0o005:
        return str(HTML_DIR)
    copy = scratch.root() / "miniwob-html"
    if not copy.is_dir():
        tmp = scratch.root() / f".miniwob-html-{os.getpid()}-{time.monotonic_ns()}"
        shutil.copytree(HTML_DIR, tmp)
        for dirpath, dirnames, filenames in os.walk(tmp):
            os.chmod(dirpath, 0o755)
            for f in filenames:
                os.chmod(os.path.join(dirpath, f), 0o644)
        try:
            os.rename(tmp, copy)
        except OSError:             # another thread made it first
            shutil.rmtree(tmp, ignore_errors=True)
    return str(copy)


def unix_pool_manager(path: str, timeout: float):
    """A urllib3 PoolManager whose http:// connections are the Unix socket `path` (whatever the URL's host)."""
    import urllib3
    from urllib3.connection import HTTPConnection
    from urllib3.connectionpool import HTTPConnectionPool

    class Conn(HTTPConnection):
        def _new_conn(self):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(self.timeout if isinstance(self.timeout, (int, float)) else timeout)
            try:
                s.connect(path)
            except OSError:
                s.close()
                raise
            return s

    class Pool(HTTPConnectionPool):
        ConnectionCls = Conn

    pm = urllib3.PoolManager(timeout=timeout)
    pm.pool_classes_by_scheme = {"http": Pool}
    return pm


def driver_connection(path: str):
    """Selenium's connection to chromedriver (as webdriver.Chrome makes it), over the Unix socket `path`."""
    from selenium.webdriver.chromium.remote_connection import ChromiumRemoteConnection

    class Connection(ChromiumRemoteConnection):
        def _get_connection_manager(self):
            return unix_pool_manager(path, self._client_config.timeout)

    return Connection(remote_server_addr="http://localhost", vendor_prefix="goog", browser_name="chrome")


class ChromiumProcess:
    """chromedriver + Chromium for one session: own sandbox, private home, bounded commands."""

    def __init__(self, workdir: str, command_timeout_s: float, flight_socket: str = "", memory_mb: int = 0):
        self.workdir, self.command_timeout_s = workdir, command_timeout_s
        self.memory_mb = memory_mb          # the sandbox's memory cgroup's bound (0: none)
        self.cgroup: MemoryCgroup | None = None
        self.flight_socket = flight_socket  # envd's FlightWoB page server (a Unix socket), for flight.* tasks
        self.driver = None
        self.proc: subprocess.Popen | None = None   # bwrap
        self.uid: int | None = None
        self.init_pid, self._init_fd = 0, -1
        self.last_init_pid = 0                       # the last sandbox's init, kept after stop (tests)

    @property
    def home(self) -> str:
        return os.path.join(self.workdir, "home")

    @property
    def socket_path(self) -> str:
        return os.path.join(self.home, SOCKET)

    @property
    def log_path(self) -> str:
        return os.path.join(self.workdir, "chromedriver.log")

    def start(self, window: tuple[int, int]):
        from selenium import webdriver
        from selenium.common.exceptions import WebDriverException

        if lacking := missing():
            raise RuntimeError(f"a MiniWoB session needs {', '.join(lacking)} on the host "
                               "(apt: chromium, chromium-driver, socat, bubblewrap, util-linux)")
        self.stop()
        try:
            self._launch()
            self._wait_ready(time.monotonic() + self.command_timeout_s)
            opts = webdriver.ChromeOptions()
            opts.binary_location = programs()[0]
            for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={SANDBOX_WORKSPACE}/profile",
                         f"--window-size={window[0]},{window[1]}"):
                opts.add_argument(flag)
            self.driver = webdriver.Remote(command_executor=driver_connection(self.socket_path), options=opts)
        except WebDriverException as e:
            said = self._log_tail()
            self.stop()
            raise WebDriverException(f"{e.msg}; chromedriver said: {said}" if said else e.msg) from None
        except BaseException:
            self.stop()
            raise
        self.driver.command_executor.client_config.timeout = self.command_timeout_s
        self.driver.set_page_load_timeout(self.command_timeout_s)
        self.driver.set_script_timeout(self.command_timeout_s)
        return self.driver

    def _launch(self) -> None:
        """Start the sandbox: chromedriver on its private port, then (once it listens) socat on the socket."""
        self.uid = allocate_uid()
        os.makedirs(self.home, mode=0o700, exist_ok=True)
        if self.uid is not None and (blocked := unreachable(pathlib.Path(self.workdir))):
            raise RuntimeError(f"the MiniWoB browser's sandbox uid cannot pass {blocked} (mode 0700?) to reach "
                               f"{self.workdir}: envd's temp dir (TMPDIR) must lie where other uids may pass")
        if self.uid is not None:
            os.chmod(self.workdir, 0o711)            # the uid reaches its home (and nothing else in here)
            chown_tree(pathlib.Path(self.home), self.uid)
        etc = write_etc(pathlib.Path(self.workdir) / "etc")
        binds = [(p, p) for p in _ETC if os.path.isdir(p)] + [(pages_dir(self.uid), PAGES)]
        if self.flight_socket:
            binds.append((self.flight_socket, FLIGHT_SOCKET))
        binds += [(p, p) for p in programs() if not p.startswith(("/usr/", "/bin/", "/sbin/"))]  # seen where they lie
        driver = programs()[1]
        relay = f"UNIX-LISTEN:{SANDBOX_WORKSPACE}/{SOCKET},mode=0600,fork TCP:127.0.0.1:{DRIVER_PORT},nodelay"
        script = (f"{shlex.quote(driver)} --port={DRIVER_PORT} & d=$!\n"
                  f"until (: <>/dev/tcp/127.0.0.1/{DRIVER_PORT}) 2>/dev/null; do\n"
                  "  kill -0 $d 2>/dev/null || exit 1; sleep 0.02\ndone\n")
        if self.flight_socket:
            script += f"socat TCP-LISTEN:8000,bind=127.0.0.1,reuseaddr,fork UNIX-CONNECT:{FLIGHT_SOCKET} &\n"
        script += f"socat {relay} &\nwait -n\n"        # either ends: the sandbox ends
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": SANDBOX_WORKSPACE, "LANG": "C.UTF-8",
               "XDG_CONFIG_HOME": f"{SANDBOX_WORKSPACE}/config", "XDG_CACHE_HOME": f"{SANDBOX_WORKSPACE}/cache"}
        self.cgroup = memory_cgroup(self.memory_mb) if self.memory_mb else None
        info_r, info_w = os.pipe()
        try:
            argv = sandbox_argv(self.home, etc, BROWSER_LIMITS, self.uid, info_w, ro_binds=binds, cgroup=self.cgroup)
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen([*argv, "/bin/bash", "-c", script], env=env, close_fds=True,
                                             pass_fds=(info_w,), process_group=0, stdin=subprocess.DEVNULL,
                                             stdout=log, stderr=log)
        except BaseException:
            os.close(info_r)
            raise
        finally:
            os.close(info_w)
        pid = read_child_pid(info_r, self.command_timeout_s)  # closes info_r
        self.init_pid, self._init_fd = pid or 0, open_pidfd(pid)
        self.last_init_pid = self.init_pid

    def _wait_ready(self, deadline: float) -> None:
        """Until chromedriver answers /status through the socket; WebDriverException if the sandbox ends first or
        the deadline passes."""
        from selenium.common.exceptions import WebDriverException

        while True:
            if self._init_fd < 0 or exited(self._init_fd):
                raise WebDriverException("chromedriver's sandbox exited at start")
            if os.path.exists(self.socket_path):
                c = http.client.HTTPConnection("localhost")
                try:
                    c.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    c.sock.settimeout(max(0.1, deadline - time.monotonic()))
                    c.sock.connect(self.socket_path)
                    c.request("GET", "/status")
                    if c.getresponse().status == 200:
                        return
                except (OSError, http.client.HTTPException):
                    pass                               # socat up, chromedriver not yet (or gone): ask again
                finally:
                    c.close()
            if time.monotonic() > deadline:
                raise WebDriverException(f"chromedriver did not answer within {self.command_timeout_s:g} s")
            exited(self._init_fd, 0.02)               # a moment, or at once if the sandbox ends

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
        """The sandbox's init (everything of the session's browser runs under it); 0 when none runs."""
        return self.init_pid

    def stop(self) -> None:
        """Kill the sandbox (its init first, waited for until its namespace is empty) and reap bwrap; no quit:
        nothing of the profile is kept."""
        driver, self.driver = self.driver, None
        proc, fd = self.proc, self._init_fd
        self.proc, self._init_fd, self.init_pid = None, -1, 0
        cgroup, self.cgroup = self.cgroup, None
        try:
            if not end_sandbox(fd, proc, cgroup=cgroup):
                raise RuntimeError("the MiniWoB browser's sandbox still runs 5 s after it was killed")
        finally:
            if driver is not None:
                try:
                    driver.command_executor.close()   # the pool's sockets
                except Exception:
                    pass
            release_uid(self.uid)
            self.uid = None

"""Starting SGLang servers as subprocesses for the `sglang` engine, supervising them, and waiting for them to be healthy.

Each server is its own process group with PDEATHSIG (core.proc.die_with_parent), so stopping it (or this process
dying) takes SGLang's scheduler and detokenizer processes down with it.

- `server_command`: the one command line of a server (tests check its flags against SGLang 0.5.23's parser);
  `launch_commands`: every launched server's, with the checks below (SGLangFleet and launch_sglang_servers alike).
- `context_args`: the servers' --context-length, inference.max_context (checked against sglang_args, in every form
  SGLang's argparse accepts (flag_uses), and the model's own context length).
- `SGLangFleet`: `inference.sglang_launch` servers on the checkpoint directory, started by `make_engine`; one that
  exits is restarted on its port (at most sglang_max_restarts times, the wait doubling from sglang_restart_backoff_s),
  and `stop` ends every group. The replica pool (inference_server.sglang_pool) takes a dead server's replica out at
  once (`on_exit`) and lets it back in when its /health_generate answers again, weights brought up to date first.
- `wait_first_healthy`: the start-up deadline (sglang_startup_timeout_s); SGLangStartupError names what failed in one
  line, which `tars serve` prints before exiting with status 2.
- `launch_sglang_servers` / `stop_sglang_servers` / `wait_healthy`: unsupervised launching for scripts and tests.

A launched server's HTTP API (weights, pause, generate) takes no token, so it is launched on a loopback address only
(check_host; docs/threat-model.md): off loopback only with auth, and tars has none to give SGLang.
"""
from __future__ import annotations

import logging
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from typing import Callable

from core.auth import InsecureBind, is_loopback
from inference_server.sglang_http import http_json

log = logging.getLogger("tars.inference.sglang")

MAX_BACKOFF_S = 60.0


class SGLangStartupError(RuntimeError):
    """No SGLang server became usable at start (none answered in time, or a launched one exited): one line."""


def server_command(model_path: str, host: str, port: int, weight_version: int = 0, extra_args: list[str] | None = None,
                   module: str = "sglang.launch_server", python: str = "") -> list[str]:
    """`python -m sglang.launch_server` with the flags the `sglang` engine relies on.

    --skip-tokenizer-init: token ids in, token ids out (tars never lets a server re-tokenize). --tokenizer-path: the
    checkpoint directory, where its tokenizer files ship (docs/model.md). --weight-version: meta_info reports tars
    versions from the first token on.
    """
    return [python or sys.executable, "-m", module, "--model-path", model_path, "--tokenizer-path", model_path,
            "--skip-tokenizer-init", "--host", host, "--port", str(port), "--weight-version", str(int(weight_version)),
            *[str(a) for a in extra_args or ()]]


# SGLang's hf_transformers_utils.get_context_length: the first of these keys in the model's (text) config, times the
# rope_scaling factor (1 for llama3 scaling or one that names original_max_position_embeddings); 2048 without any.
_CONTEXT_KEYS = ("max_sequence_length", "seq_length", "max_seq_len", "model_max_length", "max_position_embeddings")
ALLOW_LONGER = "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"  # SGLang's own switch for a --context-length past the model's


def model_context_length(model_path: str) -> int | None:
    """The context length SGLang derives from the checkpoint's config.json (None when there is none to read)."""
    import json
    import pathlib

    f = pathlib.Path(model_path) / "config.json"
    try:
        d = json.loads(f.read_text())
    except (OSError, ValueError):
        return None
    d = {**d, **(d.get("text_config") or {})} if isinstance(d.get("text_config"), dict) else d
    rope = d.get("rope_scaling") if isinstance(d.get("rope_scaling"), dict) else {}
    factor = 1 if "original_max_position_embeddings" in rope or rope.get("rope_type") == "llama3" else rope.get("factor", 1)
    val = next((d[k] for k in _CONTEXT_KEYS if d.get(k) is not None), 2048)
    return int(factor * int(val))


def allow_longer_context() -> bool:
    return os.environ.get(ALLOW_LONGER, "").strip().lower() in ("true", "1")


def flag_uses(args: list, flag: str) -> list[tuple[str, str]]:
    """(as written, value) for every place `args` sets `flag` in a form SGLang's argparse parser accepts: `--flag V`,
    `--flag=V`, and a prefix of the flag (allow_abbrev: `--context-len 300`; argparse refuses a prefix that fits
    other flags too, e.g. `--context` in 0.5.23, so counting one here only refuses it earlier). SGLang keeps the last."""
    args = [str(a) for a in args or ()]
    out = []
    for i, a in enumerate(args):
        name, eq, val = a.partition("=")
        if len(name) > 2 and name.startswith("--") and flag.startswith(name):
            out.append((name, val if eq else (args[i + 1] if i + 1 < len(args) else "")))
    return out


def context_args(max_context: int, model_path: str, extra_args: list | None = None) -> list[str]:
    """The launched servers' `--context-length`: inference.max_context, so that SGLang's limit is the one tars admits
    requests by (InferenceConfig.request_limit). [] when sglang_args set it themselves (in any form flag_uses finds),
    to the same value; ValueError when they set another, or when max_context is past the model's own context length
    (SGLang refuses to start then unless SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1 is in the environment, which the
    servers inherit)."""
    uses = flag_uses(extra_args, "--context-length")
    for written, given in uses:
        if given != str(max_context):
            raise ValueError(f"inference.sglang_args sets {written} {given} but inference.max_context is "
                             f"{max_context}: tars admits requests by max_context, so the two must agree (set "
                             "inference.max_context, and leave --context-length out of sglang_args)")
    model = model_context_length(model_path)
    if model is not None and max_context > model and not allow_longer_context():
        raise ValueError(f"inference.max_context={max_context} is past the model's context length {model} "
                         f"({model_path}/config.json): lower it, or set {ALLOW_LONGER}=1 in the environment to run "
                         "the model past the length it was trained for")
    return [] if uses else ["--context-length", str(max_context)]


def check_host(host: str, extra_args: list | None = None) -> None:
    """InsecureBind (a ValueError: `tars serve` prints it and exits 2) for a launch address that is not loopback, or
    for extra server flags that set the address themselves (`--host 0.0.0.0` in sglang_args comes after the launcher's
    --host, so SGLang's parser would bind it; any form flag_uses finds, `--hos 0.0.0.0` and `--host=::` too)."""
    for written, val in flag_uses(extra_args, "--host"):
        raise InsecureBind(f"inference.sglang_args sets the launched servers' address ({written} {val!r}): set "
                           "inference.sglang_host instead, a loopback address (their HTTP API takes no token)")
    if not is_loopback(host):
        raise InsecureBind(f"inference.sglang_host={host!r}: refusing to launch SGLang servers off loopback: their HTTP "
                           "API (update_weights_from_disk, pause_generation, generate) takes no token, so anyone who "
                           "can reach this host could use it. Bind 127.0.0.1 (remote actors call the tars front, "
                           "guarded by inference.auth_token)")


def launch_commands(model_path: str, host: str, ports: list[int], max_context: int, weight_version: int = 0,
                    extra_args: list | None = None, module: str = "sglang.launch_server", python: str = "") -> list[list[str]]:
    """The launched servers' command lines, one per port: the one place they are built (SGLangFleet and
    launch_sglang_servers). check_host and context_args refuse what SGLang must not be given, before anything starts."""
    extra = [str(a) for a in extra_args or ()]
    check_host(host, extra)
    extra = context_args(max_context, model_path, extra) + extra
    return [server_command(model_path, host, p, weight_version, extra, module, python) for p in ports]


# Run by the server's own Python before it becomes the server: SIGTERM when the thread that started it goes
# (PR_SET_PDEATHSIG, kept across exec), then exec the server in the same process (same pid, same process group).
# Standard library only, as sglang_python is another environment. Not a preexec_fn: Python code between fork and
# exec in a process with gRPC's threads can deadlock or abort the child; without one the fork is a vfork.
_PDEATHSIG_THEN_EXEC = ("import ctypes, os, signal, sys\n"
                        "ctypes.CDLL('libc.so.6', use_errno=True).prctl(1, signal.SIGTERM)\n"
                        "if os.getppid() != {ppid}: sys.exit(1)\n"
                        "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])\n")


def _spawn(cmd: list[str], gpu: str | None) -> subprocess.Popen:
    env = dict(os.environ)
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    trampoline = [cmd[0], "-c", _PDEATHSIG_THEN_EXEC.format(ppid=os.getpid()), *cmd[1:]]
    proc = subprocess.Popen(trampoline, env=env, start_new_session=True)
    proc.command = cmd  # the server's command line, for messages
    return proc


def _kill_group(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _answers(url: str, timeout: float) -> bool:
    try:
        return http_json(url, "/health_generate", timeout=timeout)[0] == 200
    except OSError:
        return False


class SGLangFleet:
    """cfg.sglang_launch SGLang servers on model_path, supervised from one thread (which also starts them, so that
    PDEATHSIG, bound to the thread that forks, outlives no spawning thread)."""

    def __init__(self, cfg, model_path: str, weight_version: int = 0):
        n = int(cfg.sglang_launch)
        if n < 1:
            raise ValueError(f"inference.sglang_launch must be >= 1 to launch servers, got {n}")
        self.cfg, self.n = cfg, n
        ports = [int(cfg.sglang_base_port) + i for i in range(n)]
        self.urls = [f"http://{cfg.sglang_host}:{p}" for p in ports]
        self.commands = launch_commands(model_path, cfg.sglang_host, ports, cfg.max_context, weight_version,
                                        list(cfg.sglang_args), cfg.sglang_module, cfg.sglang_python)
        gpus = [str(g) for g in cfg.sglang_gpus]
        self.gpus = [gpus[i % len(gpus)] if gpus else None for i in range(n)]
        self.procs: list[subprocess.Popen | None] = [None] * n
        self.restarts = [0] * n
        self.given_up = [False] * n
        self.exits: list[tuple[int, int]] = []      # (server index, exit status), in order
        self.on_exit: Callable[[int, int], None] | None = None
        self.supervising = False                     # before that, an exit is a start-up failure, not restarted
        self._next = [0.0] * n
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="tars-sglang-fleet", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - the supervisor must not die of one bad round
                log.exception("SGLang supervision round failed")
            if self._stop.wait(0.2):
                return

    def poll(self) -> None:
        """One round: note servers that exited (restarting them once supervising), start the ones due."""
        now = time.monotonic()
        for i in range(self.n):
            with self._lock:
                if self._stop.is_set():
                    return
                p = self.procs[i]
                if p is not None and p.poll() is not None:
                    code = p.returncode
                    _kill_group(p, signal.SIGKILL)  # what it left behind (scheduler, detokenizer)
                    self.exits.append((i, code))
                    self.procs[i] = None
                    if not self.supervising:
                        self.given_up[i] = True
                    elif self.restarts[i] >= self.cfg.sglang_max_restarts:
                        self.given_up[i] = True
                        log.error("SGLang server %s exited (status %s) after %d restarts: given up",
                                  self.urls[i], code, self.restarts[i])
                    else:
                        wait = min(MAX_BACKOFF_S, self.cfg.sglang_restart_backoff_s * 2 ** self.restarts[i])
                        self.restarts[i] += 1
                        self._next[i] = now + wait
                        log.warning("SGLang server %s exited (status %s); restart %d/%d in %.1f s", self.urls[i], code,
                                    self.restarts[i], self.cfg.sglang_max_restarts, wait)
                    exited = True
                else:
                    exited = False
                if self.procs[i] is None and not self.given_up[i] and now >= self._next[i]:
                    self.procs[i] = _spawn(self.commands[i], self.gpus[i])
            if exited and self.on_exit is not None:
                self.on_exit(i, code)

    def first_exit(self) -> tuple[int, int] | None:
        with self._lock:
            return self.exits[0] if self.exits else None

    def wait_first_healthy(self, timeout_s: float) -> list[str]:
        """The URLs that answer /health_generate once the first one does (SGLangStartupError when a server exits
        first, or none answers within timeout_s); then supervision (restarts) begins."""
        healthy = wait_first_healthy(self.urls, timeout_s, self)
        with self._lock:
            self.supervising = True
        return healthy

    def status(self) -> list[dict]:
        with self._lock:
            return [{"url": u, "pid": p.pid if p is not None else None, "restarts": r, "given_up": g}
                    for u, p, r, g in zip(self.urls, self.procs, self.restarts, self.given_up)]

    def stop(self, timeout_s: float = 20.0) -> None:
        """Stop supervising, then SIGTERM every server's group (SIGKILL what is left after timeout_s)."""
        with self._lock:
            self._stop.set()
            procs = [p for p in self.procs if p is not None]
        if self._thread is not None:
            self._thread.join(5.0)
        stop_sglang_servers(procs, timeout_s)


def wait_first_healthy(urls: list[str], timeout_s: float, fleet: SGLangFleet | None = None,
                       interval_s: float = 0.2) -> list[str]:
    """Block until at least one URL answers GET /health_generate with 200 and return those that do.

    SGLangStartupError, in one line, when none does within timeout_s, or at once when a server of `fleet` exits.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        if fleet is not None and fleet.first_exit() is not None:
            i, code = fleet.first_exit()
            raise SGLangStartupError(f"SGLang server {fleet.urls[i]} exited with status {code} before it answered "
                                     f"/health_generate: {shlex.join(fleet.commands[i])}")
        left = deadline - time.monotonic()
        healthy = [u for u in urls if _answers(u, max(0.2, min(5.0, left)))]
        if healthy:
            return healthy
        if time.monotonic() >= deadline:
            raise SGLangStartupError(f"no SGLang server answered /health_generate at {', '.join(urls)} "
                                     f"within {timeout_s:g} s")
        time.sleep(interval_s)


def launch_sglang_servers(model_path: str, max_context: int, n: int = 1, host: str = "127.0.0.1",
                          base_port: int = 30000, gpus: list[str] | None = None, weight_version: int = 0,
                          extra_args: list[str] | None = None, wait_s: float = 900.0,
                          module: str = "sglang.launch_server") -> tuple[list[subprocess.Popen], list[str]]:
    """Start n servers (launch_commands, as SGLangFleet: --context-length max_context; one GPU each through
    CUDA_VISIBLE_DEVICES) and wait until every one answers /health_generate. Unsupervised: the caller stops them
    with stop_sglang_servers."""
    ports = [base_port + i for i in range(n)]
    commands = launch_commands(model_path, host, ports, max_context, weight_version, extra_args, module)
    procs, urls = [], []
    try:
        for i, (port, cmd) in enumerate(zip(ports, commands)):
            procs.append(_spawn(cmd, gpus[i % len(gpus)] if gpus else None))
            urls.append(f"http://{host}:{port}")
        wait_healthy(urls, wait_s, procs=procs)
    except BaseException:
        stop_sglang_servers(procs)
        raise
    return procs, urls


def stop_sglang_servers(procs: list[subprocess.Popen], timeout_s: float = 20.0) -> None:
    """SIGTERM each server's process group, then SIGKILL what is left after timeout_s."""
    for p in procs:
        _kill_group(p, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        _kill_group(p, signal.SIGKILL)  # the group may outlive its leader (SGLang's scheduler processes)
        p.wait(5)


def wait_healthy(urls: list[str], timeout_s: float = 60.0, interval_s: float = 0.2, procs: list | None = None) -> None:
    """Block until every URL answers GET /health_generate with 200; TimeoutError otherwise (SGLangStartupError at
    once when one of `procs`, the servers behind the URLs, has exited)."""
    deadline = time.monotonic() + timeout_s
    pending = list(urls)
    while pending:
        dead = [getattr(p, "command", p.args) for p in procs or () if p.poll() is not None]
        if dead:
            raise SGLangStartupError(f"SGLang server exited before it was healthy: {shlex.join(map(str, dead[0]))}")
        for u in list(pending):
            if _answers(u, max(0.5, min(30.0, deadline - time.monotonic()))):
                pending.remove(u)
        if pending:
            if time.monotonic() > deadline:
                raise TimeoutError(f"SGLang servers not healthy within {timeout_s}s: {pending}")
            time.sleep(interval_s)

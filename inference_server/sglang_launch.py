"""Starting SGLang servers as subprocesses for the `sglang` engine, stopping them, and waiting for them to be healthy.

Each server is its own process group with PDEATHSIG (core.proc.die_with_parent), so stopping it (or this process
dying) takes SGLang's scheduler and detokenizer processes down with it.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

from inference_server.sglang_http import http_json


def launch_sglang_servers(model_path: str, n: int = 1, host: str = "127.0.0.1", base_port: int = 30000,
                          gpus: list[str] | None = None, weight_version: int = 0, extra_args: list[str] | None = None,
                          wait_s: float = 900.0, module: str = "sglang.launch_server") -> tuple[list[subprocess.Popen], list[str]]:
    """Start n `python -m sglang.launch_server` processes (one GPU each) and wait until they answer /health_generate.

    The flags are SGLang's: --skip-tokenizer-init for token-in-token-out, --weight-version so meta_info reports tars
    versions from the start. Each server is its own process group with PDEATHSIG, so stop_sglang_servers (or this
    process dying) takes its workers down too. `module` swaps in another launcher with the same flags (the tests use
    inference_server.sglang_conformance, which accepts them).
    """
    from core.proc import die_with_parent

    procs, urls = [], []
    try:
        for i in range(n):
            port = base_port + i
            env = dict(os.environ)
            if gpus:
                env["CUDA_VISIBLE_DEVICES"] = gpus[i % len(gpus)]
            cmd = [sys.executable, "-m", module, "--model-path", model_path, "--host", host, "--port", str(port),
                   "--skip-tokenizer-init", "--weight-version", str(weight_version), *(extra_args or [])]
            procs.append(subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=die_with_parent))
            urls.append(f"http://{host}:{port}")
        wait_healthy(urls, wait_s, procs=procs)
    except BaseException:
        stop_sglang_servers(procs)
        raise
    return procs, urls


def stop_sglang_servers(procs: list[subprocess.Popen], timeout_s: float = 20.0) -> None:
    """SIGTERM each server's process group, then SIGKILL what is left after timeout_s."""
    import signal

    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(p.pid, signal.SIGKILL)  # the group may outlive its leader (SGLang's scheduler processes)
        except (ProcessLookupError, PermissionError):
            pass
        p.wait(5)


def wait_healthy(urls: list[str], timeout_s: float = 60.0, interval_s: float = 0.2, procs: list | None = None) -> None:
    """Block until every URL answers GET /health_generate with 200; TimeoutError otherwise (RuntimeError at once
    when one of `procs`, the servers behind the URLs, has exited)."""
    deadline = time.monotonic() + timeout_s
    pending = list(urls)
    while pending:
        dead = [p.args for p in procs or () if p.poll() is not None]
        if dead:
            raise RuntimeError(f"SGLang server exited before it was healthy: {dead[0]}")
        for u in list(pending):
            try:
                if http_json(u, "/health_generate", timeout=max(0.5, min(30.0, deadline - time.monotonic())))[0] == 200:
                    pending.remove(u)
            except OSError:
                pass
        if pending:
            if time.monotonic() > deadline:
                raise TimeoutError(f"SGLang servers not healthy within {timeout_s}s: {pending}")
            time.sleep(interval_s)

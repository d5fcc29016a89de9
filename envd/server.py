"""envd: the environment daemon process. Serves the EnvService (envd/servicer.py) and the ControlService on one
gRPC server, with health and reflection; drains on request (no new sessions, existing ones keep working) and shuts
down gracefully on SIGTERM/SIGINT.

    port = await EnvServer(cfg).start()  ...  await server.stop()      in-process (tests, `tars eval`)
    main(cfg, ready_file)                                              the `tars envd` process
"""
from __future__ import annotations

import asyncio
import collections
import functools
import logging
import os
import secrets
import signal
import sys

import grpc

from envd import cgroups, scratch
from envd.servicer import ENV_SERVICE, EnvServicer
from envd.sessions import list_page
from core import auth, rpc
from core.config import EnvdConfig
from core.control import ControlServicer, add_control
from core.proc import write_ready
from core.v1 import env_pb2_grpc

log = logging.getLogger("envd")

CONTROL_SERVICE = "tars.v1.ControlService"


def check_bind(cfg: EnvdConfig, control_token: str | None) -> None:
    """core.auth.check_listener for envd: off loopback only with envd.auth_token and control.auth_token (sessions
    include shells and files: an open envd is a remote shell)."""
    control = cfg.auth_token if control_token is None else control_token
    auth.check_listener("envd", "the EnvService and its ControlService", cfg.host,
                        {"envd.auth_token": cfg.auth_token, "control.auth_token": control})


def metrics(sv: EnvServicer) -> dict:
    """The ControlService's Status of envd."""
    by_env = collections.Counter(s.env_id for s in sv.sessions.values())
    return {
        "sessions": len(sv.sessions), "max_sessions": sv.cfg.max_sessions, "draining": sv.draining,
        **{k: sv.counters[k] for k in ("sessions_created", "sessions_closed", "sessions_expired", "steps",
                                       "resets", "infra_errors", "action_errors")},
        "step_ms_p50": round(sv.latency.percentile(50), 4), "step_ms_p99": round(sv.latency.percentile(99), 4),
        "step_ms_window": len(sv.latency), "workers": sv.cfg.workers,
        "backend_calls_running": sv.workers.running, "sessions_by_env": dict(by_env),
        "budget": sv.admission.describe(), "memory_cgroups": cgroups.describe(),
    }


def sessions_kill(sv: EnvServicer, args: dict[str, str]):
    """The `sessions_kill` command: close session args["id"]."""
    sid = args["id"]  # KeyError -> INVALID_ARGUMENT via ControlServicer
    s = sv.sessions.get(sid)
    if s is None:
        return False, f"unknown session {sid!r}", {}
    sv._retire(s)
    return True, f"session {sid} closed", {"id": sid, "env_id": s.env_id}


class EnvServer:
    """envd in-process: `port = await EnvServer(cfg).start()`, then `await server.stop()`."""

    def __init__(self, cfg: EnvdConfig, control_token: str | None = None):
        self.cfg = cfg
        self.control_token = control_token  # control.auth_token for the ControlService; None = envd.auth_token
        self.run_id = secrets.token_hex(8)
        self.servicer = EnvServicer(cfg, self.run_id)
        self.server: grpc.aio.Server | None = None
        self.port = 0
        self._health = None

    @property
    def address(self) -> str:
        host = f"[{self.cfg.host}]" if ":" in self.cfg.host else self.cfg.host
        return f"{host}:{self.port}"

    async def start(self) -> int:
        check_bind(self.cfg, self.control_token)
        log.info("sandboxes' memory cgroups: %s", cgroups.configure(self.cfg.memory_cgroups))
        scratch.root()  # made now, which first removes the scratch roots a killed daemon left (envd/scratch.py)
        self.server = rpc.make_server(self.cfg.max_message_bytes, self.cfg.auth_token, self.control_token)
        env_pb2_grpc.add_EnvServiceServicer_to_server(self.servicer, self.server)
        sv = self.servicer
        control = ControlServicer("envd", status=functools.partial(metrics, sv), run_id=self.run_id)
        control.on("drain", lambda args: self.drain(True))
        control.on("undrain", lambda args: self.drain(False))
        control.on("sessions_list", lambda args: list_page(list(sv.sessions.values()), args))
        control.on("sessions_kill", functools.partial(sessions_kill, sv))
        add_control(self.server, control)
        self._health = rpc.add_health_and_reflection(self.server, [ENV_SERVICE, CONTROL_SERVICE])
        self.port = rpc.bind(self.server, self.cfg.host, self.cfg.port, "envd.port")
        await self.server.start()
        await rpc.set_serving(*self._health, [ENV_SERVICE, CONTROL_SERVICE])
        self.servicer.start_gc()
        log.info("envd run %s listening on %s", self.run_id, self.address)
        return self.port

    async def drain(self, on: bool = True) -> dict:
        """Refuse new sessions (existing ones keep working). The EnvService health entry reads NOT_SERVING while
        draining so that load balancers send new sessions elsewhere; the process itself ("") stays SERVING."""
        self.servicer.draining = on
        hs, health_pb2 = self._health
        st = health_pb2.HealthCheckResponse.NOT_SERVING if on else health_pb2.HealthCheckResponse.SERVING
        r = hs.set(ENV_SERVICE, st)
        if hasattr(r, "__await__"):
            await r
        return {"draining": on, "sessions": len(self.servicer.sessions)}

    async def stop(self, grace: float | None = None) -> None:
        if self.server is None:
            return
        grace = self.cfg.shutdown_grace_s if grace is None else grace
        await self.drain(True)
        await self.server.stop(grace)
        await self.servicer.shutdown(timeout=max(grace, 1.0))
        self.server = None
        log.info("envd run %s stopped", self.run_id)


async def serve(cfg: EnvdConfig, ready_file: str | None = None, stop: asyncio.Event | None = None,
                control_token: str | None = None) -> EnvServer:
    """Run envd until `stop` is set or SIGTERM/SIGINT arrives, then shut down gracefully."""
    stop = stop or asyncio.Event()
    server = EnvServer(cfg, control_token)
    await server.start()
    loop = asyncio.get_running_loop()
    installed = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
        except (NotImplementedError, RuntimeError, ValueError):
            pass  # not the main thread (tests) or no signal support: `stop` is the only way out
    try:
        write_ready(ready_file, {"role": "envd", "address": server.address, "run_id": server.run_id})
        await stop.wait()
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
        await server.stop(cfg.shutdown_grace_s)
    return server


def main(cfg: EnvdConfig, ready_file: str | None = None, control_token: str | None = None) -> int:
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s envd %(levelname)s %(message)s")
    try:
        server = asyncio.run(serve(cfg, ready_file, control_token=control_token))
    except (auth.InsecureBind, cgroups.CgroupError) as e:
        print(f"tars envd: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        log.error("envd could not start: %s", e)
        return 1
    if server.servicer.workers.running:
        # A backend stuck in a thread would block interpreter exit (the pool joins its threads at exit).
        log.warning("%d backend call(s) still stuck at exit; exiting hard", server.servicer.workers.running)
        logging.shutdown()
        from core import telemetry

        telemetry.shutdown()  # os._exit skips atexit: flush the spans now
        os._exit(0)
    return 0

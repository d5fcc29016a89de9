"""ControlService, served by every tars process: a status callback and named command handlers."""
from __future__ import annotations

import json
import os
import time
from typing import Any, Awaitable, Callable

import grpc

from core.rpc import clip_details
from core.v1 import control_pb2, control_pb2_grpc

Handler = Callable[[dict[str, str]], Awaitable[Any] | Any]


class CommandError(Exception):
    """Raised by a command handler: the call fails with this status code and message (ValueError and KeyError:
    INVALID_ARGUMENT)."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


class ControlServicer(control_pb2_grpc.ControlServiceServicer):
    def __init__(self, role: str, status: Callable[[], dict], version: Callable[[], int] = lambda: 0, run_id: str = ""):
        self.role, self._status, self._version, self.run_id = role, status, version, run_id
        self.started = time.monotonic()
        self.handlers: dict[str, Handler] = {}

    def on(self, name: str, handler: Handler) -> None:
        self.handlers[name] = handler

    async def Status(self, request, context):
        try:
            metrics = self._status()
        except Exception as e:  # a broken gauge must not take the control plane down
            metrics = {"status_error": f"{type(e).__name__}: {e}"}
        return control_pb2.StatusResponse(
            role=self.role, policy_version=int(self._version()), run_id=self.run_id,
            uptime_s=time.monotonic() - self.started, metrics_json=json.dumps(metrics, default=str), pid=os.getpid(),
        )

    async def Command(self, request, context):
        h = self.handlers.get(request.name)
        if h is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, clip_details(f"{self.role} has no command {request.name!r}; it knows {sorted(self.handlers)}"))
        try:
            r = h(dict(request.args))
            if hasattr(r, "__await__"):
                r = await r
        except CommandError as e:
            await context.abort(e.code, clip_details(f"{request.name}: {e.message}"))
        except (ValueError, KeyError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, clip_details(f"{request.name}: {e}"))
        if isinstance(r, tuple):
            ok, msg, result = r
        else:
            ok, msg, result = True, "ok", r
        return control_pb2.CommandResponse(ok=ok, message=msg, result_json=json.dumps(result, default=str))


def add_control(server, servicer: ControlServicer) -> None:
    control_pb2_grpc.add_ControlServiceServicer_to_server(servicer, server)

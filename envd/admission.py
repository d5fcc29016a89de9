"""Who may open an envd session: the session cap, the per-client cap and the host budget (envd/budget.py); and the
gRPC status a refusal (or any other handler error) carries: `Status` and the `rpc` handler wrapper.

The client, for the per-client cap, is the connection's peer address without its port (`peer_identity`): the auth
token is one shared secret that names nobody, and a request's client_id is whatever the caller writes (it is only
shown in listings, and bounded so that listings stay small).
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import urllib.parse
from typing import Any, Callable, Iterator

import grpc

from envd.base import Resources
from envd.budget import BudgetExhausted, HostBudget, host_totals
from core.config import EnvdConfig
from core.rpc import clip_details

log = logging.getLogger("envd")

MAX_CLIENT_ID = 256          # characters of a CreateSession's client_id (it is echoed in every session listing)
BUDGET_WAIT_S = 10.0         # how long a session that does not fit waits for closing sessions to give theirs back


class Status(Exception):
    """Raised inside a handler; the servicer's wrapper turns it into a gRPC status."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def rpc(fn):
    """An EnvService handler's wrapper: Status -> that gRPC status; any other exception (a bug in the daemon, not a
    backend) -> INTERNAL, logged. Messages are cut to about 1 KiB (core.rpc.clip_details): one echoing a long
    client-written field would otherwise arrive as RESOURCE_EXHAUSTED, not as its own code."""
    @functools.wraps(fn)
    async def wrapper(self, request, context):
        try:
            return await fn(self, request, context)
        except Status as e:
            await context.abort(e.code, clip_details(e.message))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.exception("envd %s failed", fn.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, clip_details(f"envd {fn.__name__}: {type(e).__name__}: {e}"))
    return wrapper


def peer_identity(peer: str) -> str:
    """The client a connection comes from: the gRPC peer without its port ('ipv4:10.0.0.5', 'ipv6:::1',
    'unix:/path')."""
    kind, _, addr = urllib.parse.unquote(peer or "").partition(":")
    if kind in ("ipv4", "ipv6") and ":" in addr:
        addr = addr.rsplit(":", 1)[0].strip("[]")
    return f"{kind}:{addr}" if addr else kind


class Admission:
    """The caps and the budget of one daemon. `sessions` is the servicer's live table (id -> Session); `closing`
    lists the tasks closing sessions (they give budget back when done)."""

    def __init__(self, cfg: EnvdConfig, sessions: dict[str, Any], closing: Callable[[], list[asyncio.Task]]):
        self.cfg, self.sessions, self.closing = cfg, sessions, closing
        self.budget = HostBudget(host_totals(cfg.max_total_pids, cfg.max_total_memory_mb,
                                                   cfg.max_total_disk_mb))
        self.opening = 0                                      # sessions being built (between check and registration)
        self.opening_by: collections.Counter[str] = collections.Counter()   # the same, per client

    def check(self, owner: str, client_id: str) -> None:
        """Status INVALID_ARGUMENT / RESOURCE_EXHAUSTED unless `owner` may start building one more session."""
        if len(client_id) > MAX_CLIENT_ID:
            raise Status(grpc.StatusCode.INVALID_ARGUMENT, f"client_id is {len(client_id)} characters; at most "
                                                           f"{MAX_CLIENT_ID}")
        if len(self.sessions) + self.opening >= self.cfg.max_sessions:
            raise Status(grpc.StatusCode.RESOURCE_EXHAUSTED, f"session cap reached ({self.cfg.max_sessions})")
        cap = self.cfg.max_sessions_per_client
        held = sum(1 for s in self.sessions.values() if s.owner == owner) + self.opening_by[owner]
        if cap > 0 and held >= cap:
            raise Status(grpc.StatusCode.RESOURCE_EXHAUSTED,
                         f"per-client session cap reached: {owner or 'this client'} holds {cap} sessions "
                         "(envd.max_sessions_per_client); close some first")

    @contextlib.contextmanager
    def building(self, owner: str) -> Iterator[None]:
        """Count a session being built against both caps until it is registered (or fails)."""
        self.opening += 1
        self.opening_by[owner] += 1
        try:
            yield
        finally:
            self.opening -= 1
            self.opening_by[owner] -= 1
            if self.opening_by[owner] <= 0:
                del self.opening_by[owner]

    async def charge(self, need: Resources, what: str, holder: Any = None) -> None:
        """Take `need` of the host budget (with `holder`, a session: make it hold `need`); RESOURCE_EXHAUSTED when
        it does not fit, after waiting up to BUDGET_WAIT_S for sessions being closed."""
        try:
            await self.budget.take(need, what, self.closing, min(BUDGET_WAIT_S, self.cfg.step_timeout_s), holder)
        except BudgetExhausted as e:
            raise Status(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from None

    def describe(self) -> dict:
        return {**self.budget.describe(), "max_sessions_per_client": self.cfg.max_sessions_per_client}

"""envd's Snapshot, Restore and Fork RPCs, a part of envd.servicer.EnvServicer (its sessions, workers, admission,
seal and idempotency keys): a session's state as sealed bytes, and new sessions made from such a state.

Restore and Fork make a session, as CreateSession does, so they take an idempotency key (request_id,
envd/idempotency.py): a retry whose first attempt made the session gets it, not a second one. A Fork's retry gets
the fork even if its source session has closed since.
"""
from __future__ import annotations

import grpc

from envd.admission import Status as _Status, peer_identity, rpc as _rpc
from envd.base import ActionError
from envd.sessions import BackendTimeout, Session, check_result
from core.v1 import env_pb2


class SnapshotRPCs:
    """Mixed into EnvServicer: uses its _open, _retire, _crash, _created, _get, _lookup, _alive, _ttl, _check_run,
    _check_accepting, workers, admission, seal, create_keys and cfg."""

    async def _snapshot(self, s: Session) -> bytes:
        async with s.lock:
            self._alive(s)
            s.renew()
            try:
                state = await self.workers.run(s.env.snapshot, timeout=self.cfg.step_timeout_s, session=s)
            except NotImplementedError as e:
                raise _Status(grpc.StatusCode.UNIMPLEMENTED, str(e) or f"{s.env_id} does not support snapshots")
            except ActionError as e:
                raise _Status(grpc.StatusCode.FAILED_PRECONDITION, f"snapshot: {e}")
            except (BackendTimeout, Exception) as e:
                # The backend broke or hangs: the session goes, as after a broken step. Left registered, a hung
                # call kept it busy, and the lease GC skips busy sessions: its slot and budget were held for good.
                self._crash(s, "snapshot", e)
                raise _Status(grpc.StatusCode.INTERNAL, f"snapshot of {s.env_id}: {type(e).__name__}: {e}")
        if not isinstance(state, (bytes, bytearray)):
            raise _Status(grpc.StatusCode.INTERNAL, f"{s.env_id}.snapshot returned {type(state).__name__}, not bytes")
        return bytes(state)

    async def _restore(self, env_id: str, options: dict[str, str], state: bytes, ttl_s: float,
                       client_id: str = "", owner: str = "") -> Session:
        s = await self._open(env_id, options, ttl_s, client_id, owner=owner)
        try:
            async with s.lock:
                r = await self.workers.run(s.env.restore, state, timeout=self.cfg.step_timeout_s, session=s)
                s.last = check_result(r)
                # The state brings limits of its own (a terminal snapshot's): charge what the session now has.
                await self.admission.charge(s.env.resources(), f"restored session {s.id} ({env_id})", s)
                return s
        except BaseException as e:
            # Whatever ends it, a cancelled RPC included: nobody has the new session's id, so it goes now (it
            # would otherwise hold its slot, budget and sandbox until its lease ran out).
            self._retire(s)
            if isinstance(e, _Status) or not isinstance(e, Exception):
                raise
            if isinstance(e, NotImplementedError):
                raise _Status(grpc.StatusCode.UNIMPLEMENTED, str(e) or f"{env_id} does not support restore") from None
            if isinstance(e, ValueError):  # ActionError included: the state blob is not one this backend made
                raise _Status(grpc.StatusCode.INVALID_ARGUMENT, f"restore {env_id}: {e}") from None
            raise _Status(grpc.StatusCode.INTERNAL, f"restore {env_id}: {type(e).__name__}: {e}") from None

    @_rpc
    async def Snapshot(self, request, context):
        self._check_run(request.run_id)
        s = self._get(request.session_id)
        r = env_pb2.SnapshotResponse(state=self.seal.seal(s.env_id, await self._snapshot(s)), env_id=s.env_id)
        if r.ByteSize() > self.cfg.max_message_bytes:  # else gRPC refuses to send it: RESOURCE_EXHAUSTED, "retry"
            raise _Status(grpc.StatusCode.FAILED_PRECONDITION, f"snapshot of {r.ByteSize()} bytes > envd.max_message_bytes")
        return r

    @_rpc
    async def Restore(self, request, context):
        try:
            state = self.seal.open(request.env_id, request.state)
        except ValueError as e:
            raise _Status(grpc.StatusCode.INVALID_ARGUMENT, f"restore {request.env_id}: {e}") from None
        owner = peer_identity(context.peer())
        return self._created(await self.create_keys.create(owner, request, lambda: self._restore(
            request.env_id, {}, state, self._ttl(request.lease_ttl_s), owner=owner), self._lookup))

    @_rpc
    async def Fork(self, request, context):
        self._check_run(request.run_id)
        self._check_accepting()  # before the snapshot, which may be expensive
        owner = peer_identity(context.peer())

        async def fork():
            src = self._get(request.session_id)  # a fork never leaves the daemon: its state is not sealed
            return await self._restore(src.env_id, dict(src.options), await self._snapshot(src), src.ttl_s,
                                       src.client_id, owner=owner)
        return self._created(await self.create_keys.create(owner, request, fork, self._lookup))

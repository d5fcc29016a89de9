"""asyncio client of InferenceService over one or more replicas, with sticky per-trajectory routing.

A trajectory sticks to one replica so its prefix cache is hit on every turn: on first sight it goes to the
replica with the fewest calls in flight from this client (ties broken by a stable hash of the id), and the
choice is remembered in a bounded LRU map. A replica that answers UNAVAILABLE loses the trajectory to another,
and so does one with more than `sticky_max_imbalance` calls in flight beyond the least loaded replica.

Coalescing (on by default): the Generate calls made in one turn of the event loop for one replica travel as one
GenerateBatch call, sent at the end of that turn (no timer, so a lone call waits for nothing); each keeps its own
deadline, outcome, retries and trace span, and its result comes back as soon as the server has it. A replica that
does not know GenerateBatch (UNIMPLEMENTED) is called one Generate at a time from then on. A caller that gives up
on a coalesced call stops waiting at once; the server's work for it runs on to its deadline (the batch call is
cancelled only when every caller in it has given up).
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import random
import time
import zlib
from dataclasses import dataclass
from typing import AsyncIterator, Sequence

import grpc
from grpc import aio

from core import rpc, telemetry
from core.v1 import inference_pb2, inference_pb2_grpc

_MARGIN_S = 1.0  # beyond a coalesced call's deadline, how long the client waits for the server to say it passed
_FINISH = {inference_pb2.STOP: "stop", inference_pb2.LENGTH: "length", inference_pb2.FINISH_UNSPECIFIED: ""}


@dataclass
class GenerateResult:
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str          # "stop" | "length"
    prompt_tokens: int
    cached_tokens: int
    interruptions: int
    replica: str


@dataclass
class Chunk:
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str = ""     # set on the last chunk only
    prompt_tokens: int = 0
    cached_tokens: int = 0
    replica: str = ""


@dataclass
class _Replica:
    address: str
    channel: aio.Channel
    stub: inference_pb2_grpc.InferenceServiceStub
    in_flight: int = 0
    batch: bool = True                   # False once the replica answered GenerateBatch with UNIMPLEMENTED


class InferenceClient:
    def __init__(self, addresses: list[str], auth_token: str = "", timeout_s: float = 30.0, retries: int = 3,
                 backoff_s: float = 0.05, sticky_capacity: int = 65536, max_message_bytes: int = 512 << 20,
                 sticky_max_imbalance: int = 8, unavailable_retry_s: float = 0.0, max_backoff_s: float = 2.0,
                 coalesce: bool = True):
        """unavailable_retry_s: beyond `retries`, keep retrying UNAVAILABLE (every replica down, e.g. restarting)
        for this long, backing off up to max_backoff_s, so an in-flight rollout resumes when a server is back.
        coalesce: Generate calls ready together go as one GenerateBatch call per replica (the module's doc)."""
        if not addresses:
            raise ValueError("InferenceClient needs at least one address")
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        self.unavailable_retry_s, self.max_backoff_s = unavailable_retry_s, max_backoff_s
        self.retried = 0  # calls repeated after a retryable failure (for status / fault reports)
        self._replicas = []
        for a in addresses:
            ch = rpc.channel(a, auth_token, max_message_bytes)
            self._replicas.append(_Replica(a, ch, inference_pb2_grpc.InferenceServiceStub(ch)))
        self._sticky: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._sticky_capacity = sticky_capacity
        self.sticky_max_imbalance = sticky_max_imbalance
        self.moved_for_load = 0
        self.coalesce = coalesce
        self.batches = self.batched_calls = 0  # GenerateBatch calls made, and the generations they carried
        self._pending: dict[int, list] = {}   # replica index -> [(request, timeout, future)] of this loop turn
        self._batch_tasks: set[asyncio.Task] = set()

    @property
    def addresses(self) -> list[str]:
        return [r.address for r in self._replicas]

    def route(self, trajectory_id: str, avoid: int | None = None) -> int:
        """The replica index for a trajectory (sticky); `avoid` moves it off a replica that failed."""
        n = len(self._replicas)
        cands = [j for j in range(n) if j != avoid] or list(range(n))
        i = self._sticky.get(trajectory_id)
        if i is not None and i != avoid:
            least = min(self._replicas[j].in_flight for j in cands)
            if self.sticky_max_imbalance <= 0 or self._replicas[i].in_flight - least <= self.sticky_max_imbalance:
                self._sticky.move_to_end(trajectory_id)
                return i
            self.moved_for_load += 1  # a hot replica: queueing there costs more than re-prefilling elsewhere
        h = zlib.crc32(trajectory_id.encode())
        i = min(cands, key=lambda j: (self._replicas[j].in_flight, (j - h) % n))
        if trajectory_id:
            self._sticky[trajectory_id] = i
            self._sticky.move_to_end(trajectory_id)
            while len(self._sticky) > self._sticky_capacity:
                self._sticky.popitem(last=False)
        return i

    async def _backoff(self, attempt: int) -> None:
        self.retried += 1
        await asyncio.sleep(min(self.max_backoff_s, self.backoff_s * (2 ** min(attempt, 30))) * (0.5 + random.random()))

    async def _call_routed(self, trajectory_id: str, method: str, request, timeout: float):
        """Call `method` on the trajectory's replica, retrying RETRYABLE statuses with exponential backoff."""
        avoid = None
        give_up = time.monotonic() + self.unavailable_retry_s
        for attempt in itertools.count():
            i = self.route(trajectory_id, avoid)
            rep = self._replicas[i]
            rep.in_flight += 1
            try:
                if method == "Generate" and self.coalesce and rep.batch:
                    return await self._coalesced(i, request, timeout), rep
                return await getattr(rep.stub, method)(request, timeout=timeout), rep
            except aio.AioRpcError as e:
                if e.code() not in rpc.RETRYABLE:
                    raise
                if attempt >= self.retries and not (e.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < give_up):
                    raise
                if e.code() == grpc.StatusCode.UNAVAILABLE and len(self._replicas) > 1:
                    avoid = i  # the replica is down: re-route (its prefix cache is lost anyway)
            finally:
                rep.in_flight -= 1
            await self._backoff(attempt)

    # ---- coalescing ------------------------------------------------------------------------------------------
    async def _coalesced(self, i: int, request, timeout: float):
        """One Generate, sent in the GenerateBatch call of this loop turn for replica i -> its GenerateResponse;
        raises its own AioRpcError. Falls back to a plain Generate where the replica has no GenerateBatch."""
        if not request.traceparent:  # the batch call goes from no caller's task: each request names its caller's span
            request.traceparent = telemetry.traceparent()
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        q = self._pending.setdefault(i, [])
        q.append((request, timeout, fut))
        if len(q) == 1:
            loop.call_soon(self._flush, i)
        try:  # the server answers by `timeout`; the margin covers a server that cannot (its loop stuck)
            return await asyncio.wait_for(fut, timeout + _MARGIN_S)
        except _Unbatched:
            return await self._replicas[i].stub.Generate(request, timeout=timeout)
        except asyncio.TimeoutError:
            raise aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, aio.Metadata(), aio.Metadata(),
                                  "no answer within the deadline from the GenerateBatch call") from None

    def _flush(self, i: int) -> None:
        batch = self._pending.pop(i, None)
        if batch:
            t = asyncio.get_running_loop().create_task(self._send_batch(self._replicas[i], batch))
            self._batch_tasks.add(t)
            t.add_done_callback(self._batch_tasks.discard)

    async def _send_batch(self, rep: _Replica, batch: list) -> None:
        """One GenerateBatch call: every item's future gets its result or its error, whatever happens to the call."""
        self.batches += 1
        self.batched_calls += len(batch)
        futs = [f for _, _, f in batch]
        req = inference_pb2.GenerateBatchRequest(requests=[r for r, _, _ in batch], timeout_s=[t for _, t, _ in batch])
        call = rep.stub.GenerateBatch(req, timeout=max(t for _, t, _ in batch))

        def abandoned(f: asyncio.Future) -> None:  # every caller in the batch gave up: stop the server's work
            if f.cancelled() and all(g.cancelled() for g in futs):
                call.cancel()

        for f in futs:
            f.add_done_callback(abandoned)
        err: BaseException | None = None
        try:
            async for msg in call:
                for it in msg.items:
                    f = futs[it.index] if 0 <= it.index < len(futs) else None
                    if f is None or f.done():
                        continue  # its caller gave up (or a malformed index: the call's end answers it)
                    if it.code == 0:
                        f.set_result(it.response)
                    else:
                        f.set_exception(_item_error(it.code, it.error))
        except aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                rep.batch = False
                err = _Unbatched()
            else:
                err = e
        except asyncio.CancelledError:  # the client is closing, or every caller gave up
            err = aio.AioRpcError(grpc.StatusCode.CANCELLED, details="the batch call was cancelled")
        finally:
            for f in futs:
                if not f.done():
                    f.set_exception(err or aio.AioRpcError(grpc.StatusCode.INTERNAL,
                                                           details="GenerateBatch ended without this request's result"))

    @staticmethod
    def _request(trajectory_id, input_ids, max_new_tokens, temperature, top_p, top_k, stop_token_ids, seed,
                 max_stale_versions, images, traceparent) -> inference_pb2.GenerateRequest:
        stale = {} if max_stale_versions is None else {"max_stale_versions": max_stale_versions}  # unset: the server's default
        return inference_pb2.GenerateRequest(
            trajectory_id=trajectory_id, input_ids=list(input_ids), **stale,
            traceparent=traceparent, images=list(images),
            sampling=inference_pb2.SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                                  top_k=top_k, stop_token_ids=list(stop_token_ids), seed=seed))

    async def generate(self, trajectory_id: str, input_ids: Sequence[int], max_new_tokens: int, temperature: float = 1.0,
                       stop_token_ids: Sequence[int] = (), max_stale_versions: int | None = None, top_p: float = 1.0, top_k: int = 0,
                       seed: int = 0, images: Sequence = (), traceparent: str = "", timeout_s: float | None = None) -> GenerateResult:
        """One generation. Raises grpc.aio.AioRpcError (non-retryable status, or retries exhausted)."""
        req = self._request(trajectory_id, input_ids, max_new_tokens, temperature, top_p, top_k, stop_token_ids, seed,
                            max_stale_versions, images, traceparent)
        r, rep = await self._call_routed(trajectory_id, "Generate", req, timeout_s or self.timeout_s)
        return GenerateResult(list(r.output_ids), list(r.logprobs), list(r.versions), _FINISH[r.finish_reason],
                              r.prompt_tokens, r.cached_tokens, r.interruptions, r.replica or rep.address)

    async def generate_stream(self, trajectory_id: str, input_ids: Sequence[int], max_new_tokens: int, temperature: float = 1.0,
                              stop_token_ids: Sequence[int] = (), max_stale_versions: int | None = None, top_p: float = 1.0,
                              top_k: int = 0, seed: int = 0, timeout_s: float | None = None) -> AsyncIterator[Chunk]:
        """Chunks as tokens are produced. Not retried: tokens already yielded cannot be taken back."""
        req = self._request(trajectory_id, input_ids, max_new_tokens, temperature, top_p, top_k, stop_token_ids, seed,
                            max_stale_versions, (), "")
        rep = self._replicas[self.route(trajectory_id)]
        rep.in_flight += 1
        try:
            async for c in rep.stub.GenerateStream(req, timeout=timeout_s or self.timeout_s):
                yield Chunk(list(c.output_ids), list(c.logprobs), list(c.versions), _FINISH[c.finish_reason],
                            c.prompt_tokens, c.cached_tokens, rep.address)
        finally:
            rep.in_flight -= 1

    async def _each(self, method: str, request, timeout: float) -> list:
        async def one(rep: _Replica):
            for attempt in range(self.retries + 1):
                try:
                    return await getattr(rep.stub, method)(request, timeout=timeout)
                except aio.AioRpcError as e:
                    if e.code() not in rpc.RETRYABLE or attempt >= self.retries:
                        raise
                await self._backoff(attempt)

        return await asyncio.gather(*(one(r) for r in self._replicas))

    async def update_weights(self, version: int, path: str | None = None, data: bytes | None = None,
                             timeout_s: float | None = None) -> list[dict]:
        """Install weights on every replica (a path they can all read, or inline safetensors bytes)."""
        req = inference_pb2.UpdateWeightsRequest(version=version, path=path or "", safetensors=data or b"")
        rs = await self._each("UpdateWeights", req, timeout_s or max(self.timeout_s, 120.0))
        return [{"address": rep.address, "version": r.version, "load_ms": r.load_ms, "interrupted_requests": r.interrupted_requests}
                for rep, r in zip(self._replicas, rs)]

    async def update_weights_streamed(self, version: int, state_dict: dict, piece_bytes: int = 4 << 20,
                                      timeout_s: float | None = None) -> list[dict]:
        """Install weights on every replica by streaming the tensors (no shared disk, no message-size limit)."""
        from core.weights_stream import chunks

        async def one(rep: _Replica):
            return await rep.stub.UpdateWeightsStream(chunks(version, state_dict, piece_bytes), timeout=timeout_s or max(self.timeout_s, 120.0))

        rs = await asyncio.gather(*(one(r) for r in self._replicas))
        return [{"address": rep.address, "version": r.version, "load_ms": r.load_ms, "interrupted_requests": r.interrupted_requests}
                for rep, r in zip(self._replicas, rs)]

    async def get_versions(self) -> dict[str, int]:
        rs = await self._each("GetVersion", inference_pb2.GetVersionRequest(), self.timeout_s)
        return {rep.address: r.version for rep, r in zip(self._replicas, rs)}

    async def get_version(self) -> int:
        """The oldest version any replica serves (what every new token is at least produced with)."""
        return min((await self.get_versions()).values())

    async def close(self) -> None:
        for t in list(self._batch_tasks):
            t.cancel()
        await asyncio.gather(*(r.channel.close() for r in self._replicas))


class _Unbatched(Exception):
    """The replica has no GenerateBatch: the call goes as a plain Generate."""


def _item_error(code: int, details: str) -> aio.AioRpcError:
    """A GenerateBatch item's failure as the AioRpcError its own Generate call would have raised."""
    status = _STATUS.get(code, grpc.StatusCode.UNKNOWN)
    return aio.AioRpcError(status, aio.Metadata(), aio.Metadata(), details)


_STATUS = {s.value[0]: s for s in grpc.StatusCode}

"""The gRPC front of the inference server: InferenceService over an engine, plus Control, health and reflection.

Engine calls that block stay off the event loop: update_weights (it waits for a step boundary) and the submit of a
request with images (decoding and resizing them takes ~0.4 s a screenshot: inference_server/image_prep.py, bounded
threads, a bounded admission, the call's deadline); a text submit is quick.
Results (concurrent Futures) and streamed tokens come back through one Mailbox per event loop: the engine's
thread appends to it and wakes the loop only when it was empty, so the requests a decode step finishes together
cost one wake-up of the loop, not one each. A call whose deadline passes or whose client goes away cancels its
engine request. GenerateBatch runs several requests in one call, each as its own Generate would (the client
coalesces the calls it has ready together: core/inference_client.py).
"""
from __future__ import annotations

import asyncio
import collections
import logging
import math
import signal
import sys

import grpc

from inference_server.engines import check_bind, make_engine
from inference_server.image_prep import LATE, ImagePrep, drop, prepared
from inference_server.answers import (FINISH, SUBMIT_ERRORS, abort, batch_item, code_of, confine, failure, outcome,
                                      params, response, update_refusal)
from inference_server.mailbox import Mailbox, expire, settle, wake
from inference_server.sglang_launch import SGLangStartupError  # standard library only
from inference_server.engine_types import WeightsRefused, check_version_step
from core.weights_stream import Assembler, BadChunk, WrongWeights
from core import weights_shm
from core import rpc, telemetry
from core.config import InferenceConfig
from core.control import CommandError, ControlServicer, add_control
from core.proc import die_with_parent, write_ready
from core.v1 import inference_pb2, inference_pb2_grpc

log = logging.getLogger("tars.inference.server")
SERVICE = "tars.v1.InferenceService"
CONTROL = "tars.v1.ControlService"
class InferenceServicer(inference_pb2_grpc.InferenceServiceServicer):
    def __init__(self, cfg: InferenceConfig, engine, model_name: str = ""):
        # engine: LocalEngine or SGLangEngine (inference_server.sglang_engine); same interface.
        self.cfg, self.engine, self.model_name = cfg, engine, model_name
        self.replica = ""
        self.images_ignored = 0
        self._mailbox: Mailbox | None = None
        self.prep = ImagePrep(cfg.image_threads, cfg.image_queue)

    def _prepared(self, request) -> bool:
        """Does this request's submit prepare images (so it runs on self.prep, off the loop)?"""
        return bool(request.images) and getattr(self.engine, "accepts_images", False)

    def _mail(self) -> Mailbox:
        loop = asyncio.get_running_loop()
        if self._mailbox is None or self._mailbox.loop is not loop:
            self._mailbox = Mailbox(loop)
        return self._mailbox

    async def _result(self, fut, context):
        """The engine Future's outcome, awaited on this loop; asyncio.TimeoutError once the call's deadline passes."""
        loop = asyncio.get_running_loop()
        mail, waiter = self._mail(), loop.create_future()
        fut.add_done_callback(lambda f: mail.post(settle, waiter, f))
        remaining = context.time_remaining()
        timer = None if remaining is None else loop.call_later(max(0.0, remaining), expire, waiter)
        try:
            return await waiter
        finally:
            if timer is not None:
                timer.cancel()

    def _engine_submit(self, request, on_token=None):
        """engine.submit for one GenerateRequest -> its concurrent Future; raises what submit raises (ValueError,
        QueueFull, EngineClosed: answers.SUBMIT_ERRORS)."""
        # Sizes first, before anything walks the ids on this event loop: a prompt of millions of ids (the message
        # limit is sized for inline weights) took seconds to list and validate, with every other call waiting.
        n, k, vocab = len(request.input_ids), len(request.sampling.stop_token_ids), getattr(self.engine, "vocab_size", None)
        if n > self.cfg.request_limit():
            raise ValueError(f"prompt ({n} tokens) exceeds max_context {self.cfg.request_limit()}")
        if vocab and k > vocab:
            raise ValueError(f"{k} stop_token_ids: more than the vocabulary's {vocab} tokens")
        kw = {}
        if request.images:
            if getattr(self.engine, "accepts_images", False):
                kw["images"] = [bytes(im.data) for im in request.images]
            else:  # an engine without an image path (sglang client): the prompt's text speaks for them
                self.images_ignored += len(request.images)
        return self.engine.submit(list(request.input_ids), params(request.sampling), request.trajectory_id,
                                  request.max_stale_versions if request.HasField("max_stale_versions") else self.cfg.max_stale_versions, on_token, **kw)

    async def _submit(self, request, context, on_token=None):
        try:
            if self._prepared(request):
                return await self.prep.run(lambda: self._engine_submit(request, on_token), context.time_remaining())
            return self._engine_submit(request, on_token)
        except SUBMIT_ERRORS as e:
            await abort(context, code_of(e), str(e))
        except asyncio.TimeoutError:
            await abort(context, *LATE)

    async def _abort_for(self, context, e: BaseException):
        await abort(context, *failure(e))

    async def Generate(self, request, context):
        with telemetry.server_span("inference.generate", context) as sp:
            r = await self._generate(request, context)
            if sp.is_recording():
                sp.set_attributes({"tars.trajectory_id": request.trajectory_id, "tars.prompt_tokens": r.prompt_tokens,
                                   "tars.cached_tokens": r.cached_tokens, "tars.completion_tokens": r.completion_tokens,
                                   "tars.interruptions": r.interruptions, "tars.replica": r.replica})
            return r

    async def _generate(self, request, context):
        fut = await self._submit(request, context)
        try:
            out = await self._result(fut, context)
        except asyncio.TimeoutError:
            await abort(context, grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed before generation finished")
        except Exception as e:  # what the engine raised for this request: the code GenerateStream/GenerateBatch give
            await self._abort_for(context, e)
        finally:
            fut.cancel()  # no-op when done; stops the engine work when the call was cancelled or timed out
        return response(out, self.replica)

    async def GenerateStream(self, request, context):
        with telemetry.server_span("inference.generate", context, {"tars.trajectory_id": request.trajectory_id,
                                                                   "core.stream": True}):
            async for chunk in self._generate_stream(request, context):
                yield chunk

    async def _generate_stream(self, request, context):
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()  # bounded by the request's max_new_tokens (+1 end marker)
        mail = self._mail()

        def on_token(t: int, lp: float, v: int) -> None:
            mail.post(q.put_nowait, (t, lp, v))

        fut = await self._submit(request, context, on_token)
        # Runs after the last on_token of this request, in the same thread, so the marker arrives last.
        fut.add_done_callback(lambda _f: mail.post(q.put_nowait, None))
        remaining = context.time_remaining()
        deadline = None if remaining is None else loop.time() + remaining
        try:
            while True:
                try:
                    item = await asyncio.wait_for(q.get(), None if deadline is None else max(0.0, deadline - loop.time()))
                except asyncio.TimeoutError:
                    await abort(context, grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed before generation finished")
                items = [item]
                while not q.empty():  # coalesce what arrived meanwhile into one chunk
                    items.append(q.get_nowait())
                toks = [x for x in items if x is not None]
                chunk = inference_pb2.GenerateChunk(output_ids=[t for t, _, _ in toks], logprobs=[lp for _, lp, _ in toks],
                                                    versions=[v for _, _, v in toks])
                if None in items:
                    if fut.cancelled() or fut.exception() is not None:
                        await abort(context, *outcome(fut))
                    out = fut.result()
                    chunk.finish_reason = FINISH[out.finish_reason]
                    chunk.prompt_tokens, chunk.cached_tokens = out.prompt_tokens, out.cached_tokens
                    yield chunk
                    return
                yield chunk
        finally:
            fut.cancel()

    async def GenerateBatch(self, request, context):
        """Each request runs as its own Generate would (its own outcome, deadline and span); every message holds
        the results that arrived together (one wake-up of this loop), so a decode step that finishes many costs one."""
        n = len(request.requests)
        if n > self.cfg.max_queue:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"a batch of {n} requests is more than inference.max_queue ({self.cfg.max_queue})")
        loop, mail = asyncio.get_running_loop(), self._mail()
        remaining = context.time_remaining()
        now = loop.time()
        call_end = math.inf if remaining is None else now + remaining
        arrived: collections.deque = collections.deque()  # (index, future), at most n
        prepped: collections.deque = collections.deque()  # (index, preparation task) of requests with images, at most n
        sleeping: list = [None]  # the loop future the handler sleeps on, woken by an arrival or the first deadline

        def arrive(i: int, f, into=arrived) -> None:
            into.append((i, f))
            if sleeping[0] is not None and not sleeping[0].done():
                sleeping[0].set_result(None)

        def submitted(i: int, fut, d: float, sp) -> None:
            live[i] = (fut, d, sp)
            fut.add_done_callback(lambda f, i=i: mail.post(arrive, i, f))

        items, live, preps = [], {}, {}  # live: index -> (engine future, deadline, span); preps: index -> (task, deadline, span)
        for i, r in enumerate(request.requests):
            t = request.timeout_s[i] if i < len(request.timeout_s) else 0.0
            d = min(call_end, now + t) if t > 0 else call_end
            sp = telemetry.start_server_span("inference.generate", r.traceparent, {"tars.trajectory_id": r.trajectory_id,
                                                                                   "tars.batch_size": n})
            if self._prepared(r):  # its images are prepared off the loop; it joins `live` when they are
                task = asyncio.ensure_future(self.prep.run(lambda r=r: self._engine_submit(r), None if d == math.inf else d - now))
                preps[i] = (task, d, sp)
                task.add_done_callback(lambda f, i=i: arrive(i, f, prepped))
                continue
            try:
                submitted(i, self._engine_submit(r), d, sp)
            except SUBMIT_ERRORS as e:
                items.append(batch_item(i, code_of(e), str(e)))
                sp.end()
        try:
            while True:
                while prepped:
                    i, task = prepped.popleft()
                    _, d, sp = preps.pop(i)
                    fut, refused = prepared(task)
                    if fut is None:
                        items.append(batch_item(i, *refused))
                        sp.end()
                    else:
                        submitted(i, fut, d, sp)
                while arrived:
                    i, f = arrived.popleft()
                    entry = live.pop(i, None)
                    if entry is not None:  # else it expired meanwhile
                        items.append(self._finished_item(i, f, entry[2]))
                if items:
                    yield inference_pb2.GenerateBatchResponse(items=items)
                    items = []
                    continue  # results that arrived while the message was sent are in `arrived`, not a wake-up
                if not live and not preps:
                    return
                first = min((d for _, d, _ in live.values()), default=math.inf)
                sleeping[0] = loop.create_future()
                timer = None if first == math.inf else loop.call_later(max(0.0, first - loop.time()), wake, sleeping[0])
                try:
                    await sleeping[0]
                finally:
                    sleeping[0] = None
                    if timer is not None:
                        timer.cancel()
                t = loop.time()
                for i, (fut, d, sp) in list(live.items()):
                    if d <= t:
                        fut.cancel()
                        del live[i]
                        sp.end()
                        items.append(batch_item(i, grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed before generation finished"))
        finally:
            for fut, _, sp in live.values():
                fut.cancel()  # the call was cancelled or ended: stop the engine work
                sp.end()
            for task, _, sp in preps.values():
                drop(task)
                sp.end()

    def _finished_item(self, i: int, fut, sp) -> inference_pb2.GenerateBatchItem:
        if fut.cancelled() or fut.exception() is not None:
            code, details = outcome(fut)
            sp.end()
            return batch_item(i, code, details)
        r = response(fut.result(0), self.replica)
        telemetry.set_attrs(sp, **{"tars.prompt_tokens": r.prompt_tokens, "tars.cached_tokens": r.cached_tokens,
                                   "tars.completion_tokens": r.completion_tokens, "tars.interruptions": r.interruptions})
        sp.end()
        return batch_item(i, grpc.StatusCode.OK, resp=r)

    async def UpdateWeights(self, request, context):
        sd = None
        if request.safetensors:
            try:
                from safetensors.torch import load as st_load

                sd = await asyncio.to_thread(st_load, bytes(request.safetensors))
            except Exception as e:
                await abort(context, grpc.StatusCode.FAILED_PRECONDITION, f"cannot read inline safetensors: {type(e).__name__}: {e}")
        elif request.shm:
            try:  # a bare segment name in this host's /dev/shm, never a path (core/weights_shm.py)
                version, sd = await asyncio.to_thread(weights_shm.read_segment, request.shm)
            except weights_shm.SegmentError as e:
                await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
            except OSError as e:  # no such segment here: the learner is on another host
                await abort(context, grpc.StatusCode.FAILED_PRECONDITION, f"cannot map weights segment {request.shm!r}: {e.strerror}")
            if version != request.version:
                await abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"segment {request.shm} holds version {version}, not {request.version}")
            try:
                return await self._update(context, request.version, None, sd)
            finally:
                del sd  # the mapping goes when the engine has copied the tensors (or dropped the update)
        elif not request.path:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, "UpdateWeights needs a path, a shm segment or inline safetensors")
        return await self._update(context, request.version, request.path or None, sd)

    async def UpdateWeightsStream(self, request_iterator, context):
        shapes = getattr(self.engine, "weight_shapes", None)
        if shapes is None:
            await abort(context, grpc.StatusCode.FAILED_PRECONDITION, "this engine takes no streamed weights: use UpdateWeights with a path (or a shm segment)")
        asm = Assembler(shapes)
        remaining = context.time_remaining()

        async def receive():
            async for c in request_iterator:
                asm.add(c)
                if asm.version is not None:  # refuse a version that cannot be installed before reading gigabytes
                    check_version_step(self.engine.version, asm.version, self.cfg.max_version_jump)
            return asm.finish()

        try:
            version, sd = await asyncio.wait_for(receive(), remaining)
        except asyncio.TimeoutError:
            await abort(context, grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed before the weights stream ended")
        except (BadChunk, WeightsRefused) as e:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except (WrongWeights, ValueError) as e:
            await abort(context, grpc.StatusCode.FAILED_PRECONDITION, str(e))
        return await self._update(context, version, None, sd)

    async def _update(self, context, version: int, path: str | None, sd: dict | None):
        remaining = context.time_remaining()
        timeout = self.cfg.update_timeout_s if remaining is None else max(0.01, min(self.cfg.update_timeout_s, remaining))
        try:
            confine(path, self.cfg.weights_root)
            info = await asyncio.to_thread(self.engine.update_weights, version, path, sd, timeout)
        except Exception as e:
            if (why := update_refusal(e, path, timeout)) is None:
                raise
            await abort(context, *why)
        if "apply_ms" in info:  # where an install's time went (the part decoding waits for is apply_ms)
            log.info("weights v%d installed in %.0f ms (checks and queue %.0f ms, copy into the model %.0f ms)",
                     info["version"], info["load_ms"], info["load_ms"] - info["apply_ms"], info["apply_ms"])
        return inference_pb2.UpdateWeightsResponse(version=info["version"], load_ms=info["load_ms"],
                                                   interrupted_requests=info["interrupted_requests"])

    async def GetVersion(self, request, context):
        return inference_pb2.GetVersionResponse(version=self.engine.version, model=self.model_name)


class InferenceServer:
    """InferenceService + ControlService + health + reflection on one grpc.aio server. Owns no engine lifetime."""

    def __init__(self, cfg: InferenceConfig, engine, model_name: str = "", control_token: str | None = None):
        self.cfg, self.engine = cfg, engine
        self.control_token = control_token  # control.auth_token for the ControlService; None = inference.auth_token
        self.servicer = InferenceServicer(cfg, engine, model_name)
        self.control = ControlServicer("inference", self.status, lambda: engine.version)
        self.control.on("update_weights", self._cmd_update)
        m = lambda k: (lambda: self.engine.metrics().get(k))  # noqa: E731 (one reading per instrument)
        telemetry.observe("tars.inference.tokens_per_s", m("tokens_per_s"), "1/s", "tokens generated per second")
        telemetry.observe("tars.inference.tokens", m("tokens_generated"), description="tokens generated", kind="counter")
        telemetry.observe("tars.inference.idle_share", m("idle_share"), description="share of time the engine had no work")
        telemetry.observe("tars.inference.waiting", m("waiting"), description="requests queued")
        telemetry.observe("tars.inference.running", m("running"), description="requests decoding")
        telemetry.observe("tars.inference.version", lambda: self.engine.version, description="policy version served")
        self.server: grpc.aio.Server | None = None
        self.address = ""
        self._health = None
        self._health_task: asyncio.Task | None = None

    def status(self) -> dict:
        return {**self.engine.metrics(), "images_ignored": self.servicer.images_ignored, "address": self.address}

    async def _cmd_update(self, args: dict[str, str]):
        version, path, timeout = int(args["version"]), args["path"], self.cfg.update_timeout_s
        try:
            confine(path, self.cfg.weights_root)
            return await asyncio.to_thread(self.engine.update_weights, version, path, None, timeout)
        except Exception as e:  # the same answers as the UpdateWeights RPC
            if (why := update_refusal(e, path, timeout)) is None:
                raise
            raise CommandError(*why) from None

    async def start(self) -> int:
        check_bind(self.cfg, self.control_token)
        self.server = rpc.make_server(self.cfg.max_message_bytes, self.cfg.auth_token, self.control_token)
        inference_pb2_grpc.add_InferenceServiceServicer_to_server(self.servicer, self.server)
        add_control(self.server, self.control)
        self._health = rpc.add_health_and_reflection(self.server, [SERVICE, CONTROL])
        port = rpc.bind(self.server, self.cfg.host, self.cfg.port, "inference.port")
        self.address = f"{self.cfg.host}:{port}"
        self.servicer.replica = self.address
        await self.server.start()
        await rpc.set_serving(*self._health, [SERVICE, CONTROL], True)
        if callable(getattr(self.engine, "healthy", None)):  # the sglang engine: its replicas can all be down
            self._health_task = asyncio.create_task(self._follow_engine_health())
        return port

    async def _follow_engine_health(self, every_s: float = 0.25) -> None:
        """grpc.health.v1 for the InferenceService follows engine.healthy(): NOT_SERVING while no replica is in
        rotation (readiness probes take the pod out), SERVING again when one is. "" (the process is alive, what
        liveness probes ask) and the ControlService stay SERVING."""
        hs, pb2 = self._health
        serving = True
        while True:
            ok = bool(self.engine.healthy())  # a look at the replicas' flags: cheap, no I/O
            if ok != serving:
                serving = ok
                log.warning("InferenceService health: %s", "SERVING" if ok else "NOT_SERVING (no healthy replica)")
                r = hs.set(SERVICE, pb2.HealthCheckResponse.SERVING if ok else pb2.HealthCheckResponse.NOT_SERVING)
                if hasattr(r, "__await__"):
                    await r
            await asyncio.sleep(every_s)

    async def stop(self, grace: float = 5.0) -> None:
        """Stop taking calls; in-flight ones get `grace` seconds to finish."""
        if self.server is None:
            return
        if self._health_task is not None:
            self._health_task.cancel()
            self._health_task = None
        await rpc.set_serving(*self._health, [SERVICE, CONTROL], False)
        await self.server.stop(grace)
        self.server = None
        self.servicer.prep.close()


async def serve(cfg: InferenceConfig, model_path: str, version: int = 0, ready_file=None, stop: asyncio.Event | None = None,
                control_token: str | None = None) -> None:
    """Run an inference server until `stop` is set (or SIGTERM / SIGINT), then shut down gracefully."""
    check_bind(cfg, control_token)  # before the model loads: a refused bind is an immediate error
    engine = await asyncio.to_thread(make_engine, cfg, model_path, version)
    srv = InferenceServer(cfg, engine, model_name=model_path, control_token=control_token)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no signals here
            pass
    try:
        await srv.start()
        write_ready(ready_file, {"role": "inference", "address": srv.address, "version": engine.version})
        where = f", {engine.device} {str(engine.dtype).removeprefix('torch.')}" if hasattr(engine, "device") else ""
        log.info("inference server on %s (version %d%s)", srv.address, engine.version, where)
        await stop.wait()
    finally:
        await srv.stop()
        await asyncio.to_thread(engine.close)


def main(cfg: InferenceConfig, model_path: str, version: int = 0, ready_file=None, control_token: str | None = None) -> int:
    die_with_parent()
    try:
        asyncio.run(serve(cfg, model_path, version, ready_file, control_token=control_token))
    except (ValueError, OSError, SGLangStartupError) as e:
        print(f"inference_server: {e}", file=sys.stderr)
        return 2
    return 0

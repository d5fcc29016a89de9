"""The gRPC front of the inference server: InferenceService over an engine, plus Control, health and reflection.

Engine calls that block (submit is quick; update_weights waits for a step boundary) stay off the event loop.
Results (concurrent Futures) and streamed tokens come back through one _Mailbox per event loop: the engine's
thread appends to it and wakes the loop only when it was empty, so the requests a decode step finishes together
cost one wake-up of the loop, not one each. A call whose deadline passes or whose client goes away cancels its
engine request.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import signal
import sys

import grpc

from inference_server.engine import LocalEngine
from inference_server.sglang_launch import SGLangStartupError  # standard library only
from inference_server.engine_types import (EngineClosed, GenerateOutput, QueueFull, SamplingParams, WeightLoadError,
                                           WeightsRefused, check_version_step)
from core.weights_stream import Assembler, BadChunk, WrongWeights
from core import weights_shm
from core import auth, rpc, telemetry
from core.config import InferenceConfig
from core.control import ControlServicer, add_control
from core.proc import die_with_parent, write_ready
from core.v1 import inference_pb2, inference_pb2_grpc

log = logging.getLogger("tars.inference.server")
SERVICE = "tars.v1.InferenceService"
CONTROL = "tars.v1.ControlService"
_FINISH = {"stop": inference_pb2.STOP, "length": inference_pb2.LENGTH}


def _params(s: inference_pb2.SamplingParams) -> SamplingParams:
    # proto3 zero values: top_p 0 means "off"; max_new_tokens 0 is left to validation (INVALID_ARGUMENT).
    return SamplingParams(max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p if s.top_p > 0 else 1.0,
                          top_k=s.top_k, stop_token_ids=tuple(s.stop_token_ids), seed=s.seed)


def _response(out: GenerateOutput, replica: str) -> inference_pb2.GenerateResponse:
    return inference_pb2.GenerateResponse(
        output_ids=out.output_ids, logprobs=out.logprobs, versions=out.versions, finish_reason=_FINISH[out.finish_reason],
        prompt_tokens=out.prompt_tokens, cached_tokens=out.cached_tokens, completion_tokens=len(out.output_ids),
        interruptions=out.interruptions, replica=replica)


class _Mailbox:
    """Calls posted from any thread, run in order on one event loop; the loop is woken once per batch of posts.

    post() appends, then arms a wake-up unless one is pending; _drain disarms before it empties the deque, so a
    post that races with a drain is either seen by it or arms the next one (an extra, empty drain at worst)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._q: collections.deque = collections.deque()
        self._armed = False

    def post(self, fn, *args) -> None:
        self._q.append((fn, args))
        if not self._armed:
            self._armed = True
            try:
                self.loop.call_soon_threadsafe(self._drain)
            except RuntimeError:  # the loop is closed: nobody is left to hear the result
                pass

    def _drain(self) -> None:
        self._armed = False
        q = self._q
        while q:
            fn, args = q.popleft()
            try:
                fn(*args)
            except Exception:
                log.exception("posted callback failed")


def _settle(waiter: asyncio.Future, fut) -> None:
    """Copy a finished concurrent Future's outcome onto the loop's waiter (unless it expired or was cancelled)."""
    if waiter.done():
        return
    if fut.cancelled():
        waiter.cancel()
    elif fut.exception() is not None:
        waiter.set_exception(fut.exception())
    else:
        waiter.set_result(fut.result(0))  # done: no wait


def _expire(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_exception(asyncio.TimeoutError())


class InferenceServicer(inference_pb2_grpc.InferenceServiceServicer):
    def __init__(self, cfg: InferenceConfig, engine, model_name: str = ""):
        # engine: LocalEngine or SGLangEngine (inference_server.sglang_engine); same interface.
        self.cfg, self.engine, self.model_name = cfg, engine, model_name
        self.replica = ""
        self.images_ignored = 0
        self._mailbox: _Mailbox | None = None

    def _mail(self) -> _Mailbox:
        loop = asyncio.get_running_loop()
        if self._mailbox is None or self._mailbox.loop is not loop:
            self._mailbox = _Mailbox(loop)
        return self._mailbox

    async def _result(self, fut, context):
        """The engine Future's outcome, awaited on this loop; asyncio.TimeoutError once the call's deadline passes."""
        loop = asyncio.get_running_loop()
        mail, waiter = self._mail(), loop.create_future()
        fut.add_done_callback(lambda f: mail.post(_settle, waiter, f))
        remaining = context.time_remaining()
        timer = None if remaining is None else loop.call_later(max(0.0, remaining), _expire, waiter)
        try:
            return await waiter
        finally:
            if timer is not None:
                timer.cancel()

    async def _submit(self, request, context, on_token=None):
        kw = {}
        if request.images:
            if getattr(self.engine, "accepts_images", False):
                kw["images"] = [bytes(im.data) for im in request.images]
            else:  # an engine without an image path (sglang client): the prompt's text speaks for them
                self.images_ignored += len(request.images)
        try:
            return self.engine.submit(list(request.input_ids), _params(request.sampling), request.trajectory_id,
                                      request.max_stale_versions if request.HasField("max_stale_versions") else self.cfg.max_stale_versions, on_token, **kw)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except QueueFull as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except EngineClosed as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))

    async def _abort_for(self, context, e: BaseException):
        if isinstance(e, EngineClosed):
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        await context.abort(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")

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
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed before generation finished")
        except (EngineClosed, RuntimeError) as e:
            await self._abort_for(context, e)
        finally:
            fut.cancel()  # no-op when done; stops the engine work when the call was cancelled or timed out
        return _response(out, self.replica)

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
                    await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed before generation finished")
                items = [item]
                while not q.empty():  # coalesce what arrived meanwhile into one chunk
                    items.append(q.get_nowait())
                toks = [x for x in items if x is not None]
                chunk = inference_pb2.GenerateChunk(output_ids=[t for t, _, _ in toks], logprobs=[lp for _, lp, _ in toks],
                                                    versions=[v for _, _, v in toks])
                if None in items:
                    if fut.cancelled():
                        await context.abort(grpc.StatusCode.CANCELLED, "request cancelled")
                    if fut.exception() is not None:
                        await self._abort_for(context, fut.exception())
                    out = fut.result()
                    chunk.finish_reason = _FINISH[out.finish_reason]
                    chunk.prompt_tokens, chunk.cached_tokens = out.prompt_tokens, out.cached_tokens
                    yield chunk
                    return
                yield chunk
        finally:
            fut.cancel()

    async def UpdateWeights(self, request, context):
        sd = None
        if request.safetensors:
            try:
                from safetensors.torch import load as st_load

                sd = await asyncio.to_thread(st_load, bytes(request.safetensors))
            except Exception as e:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"cannot read inline safetensors: {type(e).__name__}: {e}")
        elif request.shm:
            try:  # a bare segment name in this host's /dev/shm, never a path (core/weights_shm.py)
                version, sd = await asyncio.to_thread(weights_shm.read_segment, request.shm)
            except weights_shm.SegmentError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            except OSError as e:  # no such segment here: the learner is on another host
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"cannot map weights segment {request.shm!r}: {e.strerror}")
            if version != request.version:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"segment {request.shm} holds version {version}, not {request.version}")
            try:
                return await self._update(context, request.version, None, sd)
            finally:
                del sd  # the mapping goes when the engine has copied the tensors (or dropped the update)
        elif not request.path:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "UpdateWeights needs a path, a shm segment or inline safetensors")
        return await self._update(context, request.version, request.path or None, sd)

    async def UpdateWeightsStream(self, request_iterator, context):
        shapes = getattr(self.engine, "weight_shapes", None)
        if shapes is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this engine loads weights from disk only: use UpdateWeights with a path")
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
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed before the weights stream ended")
        except (BadChunk, WeightsRefused) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except (WrongWeights, ValueError) as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        return await self._update(context, version, None, sd)

    async def _update(self, context, version: int, path: str | None, sd: dict | None):
        remaining = context.time_remaining()
        timeout = self.cfg.update_timeout_s if remaining is None else max(0.01, min(self.cfg.update_timeout_s, remaining))
        try:
            info = await asyncio.to_thread(self.engine.update_weights, version, path, sd, timeout)
        except WeightsRefused as e:  # non-finite weights, a version jump past inference.max_version_jump
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except (ValueError, WeightLoadError) as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except OSError as e:  # a path that cannot even be looked at (name too long, ...)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"cannot read {(path or '')[:200]!r}: {e.strerror}")
        except TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"update not applied within {timeout:.1f}s (it still will be)")
        except EngineClosed as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
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
        info = await asyncio.to_thread(self.engine.update_weights, int(args["version"]), args["path"], None, self.cfg.update_timeout_s)
        return info

    async def start(self) -> int:
        check_bind(self.cfg, self.control_token)
        self.server = rpc.make_server(self.cfg.max_message_bytes, self.cfg.auth_token, self.control_token)
        inference_pb2_grpc.add_InferenceServiceServicer_to_server(self.servicer, self.server)
        add_control(self.server, self.control)
        self._health = rpc.add_health_and_reflection(self.server, [SERVICE, CONTROL])
        port = rpc.bind(self.server, self.cfg.host, self.cfg.port)
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


def check_bind(cfg: InferenceConfig, control_token: str | None) -> None:
    """core.auth.check_listener for this server (InsecureBind off loopback without its tokens)."""
    control = cfg.auth_token if control_token is None else control_token
    auth.check_listener("inference", "the InferenceService (UpdateWeights included) and its ControlService", cfg.host,
                        {"inference.auth_token": cfg.auth_token, "control.auth_token": control})


def make_engine(cfg: InferenceConfig, model_path: str, version: int = 0):
    """The engine cfg.engine names: `local` (LocalEngine over model_path) or `sglang` (SGLangEngine over the servers it
    launches on model_path, cfg.sglang_launch, or over cfg.sglang_urls; model_path's config.json supplies the
    vocabulary size for validation)."""
    if cfg.engine == "local":
        return LocalEngine(cfg, model_path, version)
    if cfg.engine == "sglang":
        import json
        import pathlib

        from inference_server.sglang_engine import open_sglang_engine

        conf = pathlib.Path(model_path or ".") / "config.json"
        vocab = json.loads(conf.read_text()).get("vocab_size") if model_path and conf.is_file() else None
        return open_sglang_engine(cfg, model_path, version, vocab)  # launched or attached; waits for a first replica
    raise ValueError(f"engine {cfg.engine!r} is not available in this server; use engine=local or engine=sglang")


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
        log.info("inference server on %s (version %d)", srv.address, engine.version)
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

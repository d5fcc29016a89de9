"""The `sglang` engine: a pool of SGLang servers behind LocalEngine's interface, over SGLang's native HTTP API.

Standard library only (http.client, through inference_server.sglang_http, in a bounded thread pool), importable
without the `sglang` package.

- Generation: POST /generate {rid, input_ids, sampling_params, return_logprob: true, logprob_start_len: -1}, top_k
  -1 for "off"; never ignore_eos, which turns stop_token_ids off too (so the model's EOS ids also end a generation).
- Partial rollouts: a weight update is pause_generation(mode) -> update_weights_from_disk(weight_version) ->
  continue_generation on every replica. A request that comes back with finish_reason "abort" (pause mode "abort",
  an operator's abort, or a replica that died mid-request) is resumed: re-submitted with input_ids + the tokens it
  already has and max_new_tokens reduced, keeping the earlier tokens, logprobs and versions. The caller never sees
  "abort". With mode "retract" / "in_place" the server keeps the request itself and reports weight_versions spans.
- Versions: per-token versions come from meta_info.weight_versions spans ({version, start, end}, end exclusive),
  else meta_info.weight_version, else the version this engine last installed. tars versions are sent as strings
  of integers; a non-integer server version ("default") counts as the version the pool was attached at.
- rids: f"{engine_uid}-{sha1(trajectory)[:10]}-{seq:012d}-{segment:04d}", all of one fixed length, so no rid is
  a prefix of another (SGLang's /abort_request aborts every rid that starts with the given one).
- Routing, health and installing weights on every replica: inference_server.sglang_pool; reading one answer:
  inference_server.sglang_answer. This module is the request path: one generation per worker thread, resumed across
  aborts and failed replicas. A 4xx (SGLang refused the request as invalid) fails it with RequestRefused
  (INVALID_ARGUMENT, SGLang's message); a 5xx or a connection failure takes the replica out and resumes elsewhere.

Starting (launch or attach, then this engine over the servers): inference_server.sglang_start. `healthy()` (some
replica in rotation) is what the gRPC front's health service reports for the InferenceService.
"""
from __future__ import annotations

import collections
import hashlib
import logging
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from core.config import InferenceConfig
from inference_server.engine_types import (EngineClosed, GenerateOutput, QueueFull, SamplingParams, TokenCallback, WeightLoadError,
                                           check_finite, check_request)
from inference_server.sglang_answer import generate_body, overloaded, read_segment, refused
from inference_server.sglang_http import error_message, http_json, post_abort
from inference_server.sglang_pool import NoHealthyReplica, Replica, ReplicaPool, Stats

log = logging.getLogger("tars.inference.sglang")


@dataclass(eq=False)
class _Call:
    seq: int
    input_ids: list[int]
    params: SamplingParams
    trajectory_id: str
    future: Future
    on_token: TokenCallback | None
    out: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    segment: int = 0
    rid: str = ""
    replica: Replica | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    interruptions: int = 0
    recomputed_tokens: int = 0
    posting: str = ""   # the rid whose /generate is in flight ("" between segments)


class SGLangEngine:
    """LocalEngine's interface (submit / update_weights / version / metrics / validate / close) over SGLang servers."""

    def __init__(self, cfg: InferenceConfig, urls: list[str], version: int = 0, vocab_size: int | None = None,
                 name: str = "sglang", health_thread: bool = True):
        if not urls:
            raise ValueError("engine=sglang needs at least one URL in sglang_urls")
        self.cfg, self.name = cfg, name
        self.vocab_size = vocab_size
        self.stats = Stats()
        self.pool = ReplicaPool(cfg, urls, version, self.stats)
        self.uid = uuid.uuid4().hex[:8]
        self.fleet = None  # the launched servers (SGLangFleet), stopped by close(); None when attached
        self._seq = 0
        self._lock = threading.Lock()
        self._calls: dict[int, _Call] = {}
        self._closed = threading.Event()
        self.started = time.monotonic()
        self._max_runners = max(2, cfg.sglang_max_concurrency)
        self._workers = ThreadPoolExecutor(max_workers=self._max_runners, thread_name_prefix="tars-sglang")
        # Calls not started, taken in order by at most _max_runners runners (_runner); one cancelled while waiting
        # leaves at once: waiting calls are bounded by max_queue, the executor's queue by _max_runners.
        self._waiting: collections.deque[_Call] = collections.deque()
        self._runners = 0
        if health_thread:
            self.pool.start_health_thread()

    @property
    def version(self) -> int:
        """The version installed on every healthy replica."""
        return self.pool.version

    @property
    def replicas(self) -> list[Replica]:
        return self.pool.replicas

    def route(self, trajectory_id: str, avoid: Replica | None = None) -> Replica:
        """The replica a trajectory's next request goes to (see ReplicaPool.route)."""
        return self.pool.route(trajectory_id, avoid)

    def check_health(self) -> None:
        """One health round over the replicas (the health thread runs these every sglang_health_interval_s)."""
        self.pool.check_health()

    def healthy(self) -> bool:
        """Some replica is in rotation (what grpc.health.v1 reports for the InferenceService)."""
        return any(r.healthy for r in self.pool.replicas)

    def in_flight(self) -> int:
        """Generations submitted and not finished."""
        with self._lock:
            return len(self._calls)

    # ---- requests ------------------------------------------------------------------------------------
    def validate(self, input_ids: list[int], p: SamplingParams) -> None:
        """Raise ValueError (INVALID_ARGUMENT) with a message naming the offending field (engine_types.check_request;
        the length limit is SGLang's rule, docs/sglang.md)."""
        check_request(input_ids, p, self.vocab_size, self.cfg.request_limit())
        # The gRPC field is a uint64; the local engine takes any int, as it also serves the conformance server,
        # which reads SGLang's (int64) sampling_seed.
        if not 0 <= p.seed < 1 << 64:
            raise ValueError(f"seed must be in [0, 2**64) (a uint64), got {p.seed}")

    def submit(self, input_ids: list[int], params: SamplingParams | None = None, trajectory_id: str = "",
               max_stale_versions: int | None = None, on_token: TokenCallback | None = None) -> Future:
        """Queue a generation; the Future resolves to a GenerateOutput. Cancelling it aborts the request on its server.

        max_stale_versions is accepted for interface parity: with pause mode abort or retract SGLang flushes its cache
        on every update, so resumed requests re-prefill under the new weights. With in_place it does not: a request
        carried across an update keeps the KV its prefix got from the old weights, and its next tokens (labelled with
        the new version) are conditioned on it, as max_stale_versions > 0 allows on the local engine. on_token is called per token as each segment (the part
        generated between two interruptions) comes back, in the worker thread, before the Future resolves.
        """
        params = params or SamplingParams()
        input_ids = [int(t) for t in input_ids]
        self.validate(input_ids, params)
        with self._lock:  # closed is looked at under the lock close() takes its snapshot of the calls under
            if self._closed.is_set():
                raise EngineClosed("engine closed")
            if len(self._calls) >= self.cfg.max_queue:
                self.stats.add("rejected_queue_full")
                raise QueueFull(f"{len(self._calls)} requests in flight (max_queue={self.cfg.max_queue})")
            self._seq += 1
            call = _Call(self._seq, input_ids, params, trajectory_id, Future(), on_token, prompt_tokens=len(input_ids))
            self._calls[call.seq] = call
            self.stats.add("requests")
            self._waiting.append(call)
            start = self._runners < self._max_runners
            self._runners += start
        call.future.add_done_callback(lambda f, c=call: self._on_done(c, f))
        if start:
            self._workers.submit(self._runner)
        return call.future

    def generate(self, input_ids, params=None, trajectory_id="", max_stale_versions=None, timeout: float | None = 60.0) -> GenerateOutput:
        fut = self.submit(input_ids, params, trajectory_id, max_stale_versions)
        try:
            return fut.result(timeout)
        except TimeoutError:
            fut.cancel()
            raise

    def _on_done(self, call: _Call, f: Future) -> None:
        with self._lock:
            self._calls.pop(call.seq, None)
            if f.cancelled() and call in self._waiting:  # not started: it goes now, with its tokens
                self._waiting.remove(call)
        if f.cancelled():
            self.stats.add("cancelled")
            rep, rid = call.replica, call.rid
            if rep is not None and rid and not self._closed.is_set():
                threading.Thread(target=self._abort_rid, args=(call, rep, rid), name="tars-sglang-abort", daemon=True).start()

    def _abort_rid(self, call: _Call, rep: Replica, rid: str) -> None:
        """Abort `rid` until its /generate returns: one abort can be lost (SGLang drops an abort for a rid its
        scheduler has not registered yet, and a paused server holds the request), and a request nobody waits for
        would run to max_new_tokens on the server. Bounded by the request timeout."""
        deadline = time.monotonic() + self.cfg.sglang_request_timeout_s
        while not self._closed.is_set() and time.monotonic() < deadline:
            post_abort(rep.url, rid)
            if call.posting != rid:
                return
            time.sleep(0.2)

    def _rid(self, call: _Call) -> str:
        h = hashlib.sha1(call.trajectory_id.encode()).hexdigest()[:10]
        return f"{self.uid}-{h}-{call.seq:012d}-{call.segment:04d}"

    # ---- the per-request loop (a worker thread) ------------------------------------------------------
    def _runner(self) -> None:
        while True:
            with self._lock:
                if not self._waiting or self._closed.is_set():
                    self._runners -= 1
                    return
                call = self._waiting.popleft()
            self._run(call)

    def _run(self, call: _Call) -> None:
        try:
            out = self._generate(call)
        except BaseException as e:  # noqa: BLE001 - every failure goes to the caller's Future
            if not call.future.done():
                try:
                    call.future.set_exception(e)
                except Exception:
                    pass
            return
        if not call.future.done():
            try:
                call.future.set_result(out)
                self.stats.add("finished")
            except Exception:
                pass

    def _generate(self, call: _Call) -> GenerateOutput:
        p = call.params
        avoid, conn_failures = None, 0
        full: set[str] = set()  # replicas that answered "queue full" for this segment
        busy = 0                # rounds a resumed generation found every replica full
        deadline = time.monotonic() + self.cfg.sglang_request_timeout_s
        while True:
            if call.future.cancelled():
                raise EngineClosed("cancelled")
            if self._closed.is_set():
                raise EngineClosed("engine closed")
            if time.monotonic() > deadline:
                raise TimeoutError(f"generation not finished within sglang_request_timeout_s={self.cfg.sglang_request_timeout_s}")
            remaining = p.max_new_tokens - len(call.out)
            rep = self.pool.route(call.trajectory_id, avoid, full)
            call.rid, call.replica = self._rid(call), rep
            body = generate_body(call.rid, call.input_ids + call.out, p, remaining)
            call.posting = call.rid
            try:
                if call.future.cancelled():  # cancelled while the body was built: the abort may already be gone
                    raise EngineClosed("cancelled")
                try:
                    with self.pool.serving(rep):
                        status, resp = http_json(rep.url, "/generate", body, timeout=max(1.0, deadline - time.monotonic()))
                finally:
                    call.posting = ""
            except TimeoutError as e:  # the socket waited all the time left: the request's deadline, not the replica's fault
                post_abort(rep.url, call.rid)
                raise TimeoutError(f"generation not finished within sglang_request_timeout_s={self.cfg.sglang_request_timeout_s}") from e
            except OSError as e:
                # Refused / reset: take the replica out and go on elsewhere with the tokens we have.
                self.pool.mark_down(rep, f"{type(e).__name__}: {e}")
                avoid, conn_failures = rep, conn_failures + 1
                call.segment += 1
                if conn_failures > self.cfg.sglang_max_resumes:
                    raise NoHealthyReplica(f"generation failed on {conn_failures} replicas: {e}") from e
                continue
            if status != 200 or not isinstance(resp, dict):
                if overloaded(status, error_message(resp)):
                    # Load, not death: the replica stays in rotation. Another one may have room; when none has, a new
                    # generation fails RESOURCE_EXHAUSTED (the caller backs off and retries), a resumed one waits and
                    # tries again until its deadline.
                    full.add(rep.url)
                    call.segment += 1  # a fresh rid for the next try
                    self.stats.add("rejected_queue_full")
                    if self.pool.has_other(full):
                        continue
                    if call.out:  # a resumed generation (all of an update's aborts come back at once): keep its tokens
                        full.clear()
                        busy += 1
                        self._closed.wait(min(1.0, 0.05 * 2 ** min(busy, 5)))
                        continue
                    raise QueueFull(f"SGLang is overloaded: {error_message(resp)[:200]} (HTTP {status} from {rep.url})")
                if status >= 500:
                    self.pool.mark_down(rep, f"HTTP {status}")
                    avoid, call.segment = rep, call.segment + 1
                    conn_failures += 1
                    if conn_failures <= self.cfg.sglang_max_resumes:
                        continue
                elif 400 <= status < 500 and status not in (408, 429):  # refused as invalid: the request, not the replica
                    raise refused(error_message(resp))
                raise RuntimeError(f"SGLang /generate on {rep.url} failed: HTTP {status}: {str(resp)[:300]}")
            avoid = None
            full.clear()
            seg = read_segment(resp, self.pool.base_version)
            ids, vers, fr, kind = seg.ids, seg.versions, seg.finish, seg.kind
            if not call.out and call.segment == 0:
                call.cached_tokens = seg.cached_tokens
            elif call.out:
                call.recomputed_tokens += len(call.input_ids) + len(call.out)
            call.out += ids
            call.logprobs += seg.logprobs
            call.versions += vers
            if len(set(vers)) > 1:  # retract / in_place: the server carried the request across an update itself
                call.interruptions += sum(1 for a, b in zip(vers, vers[1:]) if a != b)
            if call.on_token is not None:
                for t, lp, v in zip(ids, call.logprobs[-len(ids):] if ids else [], vers):
                    try:
                        call.on_token(t, lp, v)
                    except Exception:
                        log.exception("on_token callback failed")
            self.stats.add("tokens", len(ids))
            done_by_stop = bool(call.out) and call.out[-1] in p.stop_token_ids
            if kind == "stop" or done_by_stop:
                return self._output(call, "stop")
            if kind == "length" or len(call.out) >= p.max_new_tokens or len(call.input_ids) + len(call.out) >= self.cfg.request_limit():
                return self._output(call, "length")
            if kind != "abort":
                raise RuntimeError(f"SGLang finish_reason {fr or kind!r} not understood")
            # Aborted (a weight update in mode=abort, or someone else's abort): resume with what we have.
            if call.future.cancelled():
                raise EngineClosed("cancelled")
            if fr.get("status_code") not in (None, 200) and int(fr.get("status_code") or 0) < 500:
                raise refused(str(fr.get("message")))
            call.interruptions += 1
            call.segment += 1
            self.stats.add("resumed")
            if call.interruptions > self.cfg.sglang_max_resumes:
                raise RuntimeError(f"request aborted {call.interruptions} times; giving up (sglang_max_resumes)")
            # Do not race the update that caused the abort: wait for its continue_generation.
            self.pool.wait_no_update(self.cfg.update_timeout_s)

    def _output(self, call: _Call, reason: str) -> GenerateOutput:
        return GenerateOutput(call.out, call.logprobs, call.versions, reason, call.prompt_tokens, call.cached_tokens,
                              call.interruptions, call.recomputed_tokens)

    # ---- weights -------------------------------------------------------------------------------------
    def update_weights(self, version: int, path: str | None = None, state_dict: dict | None = None,
                       timeout: float | None = 120.0, wait: bool = True):
        """pause_generation -> update_weights_from_disk -> continue_generation on every healthy replica.

        `path` must be readable by every server (update_weights_from_disk); a `state_dict` goes through
        update_weights_from_tensor as shared-memory handles, to servers on loopback only.
        Returns {version, load_ms, interrupted_requests, replicas}; raises ValueError when the version is not newer,
        WeightLoadError when a replica refuses the weights (the others keep the new ones; the failing one is
        taken out until it can be brought up to date).
        """
        if not wait:  # its own thread: the request pool may be full of generations waiting for this update
            fut: Future = Future()

            def run():
                try:
                    fut.set_result(self.update_weights(version, path, state_dict, timeout, True))
                except BaseException as e:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(e)

            threading.Thread(target=run, name="tars-sglang-update", daemon=True).start()
            return fut
        version = int(version)
        if state_dict is not None:
            from inference_server import sglang_tensors  # torch: only where weights come in memory

            # In memory: POST /update_weights_from_tensor with shared-memory handles (inference_server/sglang_tensors.py),
            # which only a server on this host can map, and whose pickle only a trusted one should read.
            far = [r.url for r in self.pool.replicas if not sglang_tensors.same_host(r.url)]
            if far:
                raise WeightLoadError(f"in-memory weights go only to SGLang servers on loopback, not {far[:3]}: "
                                      "publish with learner.publish.mode=disk (a path every server can read)")
            check_finite(state_dict)  # WeightsRefused: SGLang would load NaNs as they come
            try:
                named = sglang_tensors.share(state_dict)
                entry = sglang_tensors.serialize(named)
            except (RuntimeError, OSError) as e:
                raise WeightLoadError(f"cannot put the weights in shared memory: {type(e).__name__}: {e}") from e
            return self.pool.update_weights(version, None, timeout, self.in_flight,
                                            ([entry] * max(1, self.cfg.sglang_tp_size), named))
        if not path:
            raise WeightLoadError("update_weights needs a path or a state_dict")
        return self.pool.update_weights(version, path, timeout, self.in_flight)

    # ---- metrics / lifecycle -------------------------------------------------------------------------
    def metrics(self) -> dict:
        s = self.stats.snapshot()
        elapsed = max(time.monotonic() - self.started, 1e-9)
        with self._lock:  # waiting: not yet taken by a runner (at most sglang_max_concurrency run at once)
            in_flight, waiting = len(self._calls), len(self._waiting)
        reps = self.pool.snapshot()
        return {
            "engine": self.name, "version": self.version, "requests": s["requests"], "requests_finished": s["finished"],
            "requests_cancelled": s["cancelled"], "requests_rejected_queue_full": s["rejected_queue_full"],
            "waiting": waiting, "running": in_flight - waiting, "tokens_generated": s["tokens"], "tokens_per_s": s["tokens"] / elapsed,
            "weight_updates": s["weight_updates"], "interrupted_requests": s["interrupted"], "resumed_requests": s["resumed"],
            "replicas_healthy": sum(r["healthy"] for r in reps), "replica_down_events": s["replica_down"],
            "replica_up_events": s["replica_up"], "sticky_moved_for_load": s["sticky_moved_for_load"], "replicas": reps, "pause_mode": self.cfg.sglang_pause_mode,
            **({"server_restarts": sum(f["restarts"] for f in self.fleet.status())} if self.fleet is not None else {}),
        }

    def close(self, timeout: float = 10.0) -> None:
        """Stop: abort this engine's requests on their servers and fail their Futures with EngineClosed."""
        if self._closed.is_set():
            return
        self._closed.set()
        with self._lock:
            calls = list(self._calls.values())
        for c in calls:
            if c.replica is not None and c.rid and c.posting == c.rid:  # one abort each: the engine is going
                post_abort(c.replica.url, c.rid)
            if not c.future.done():
                try:
                    c.future.set_exception(EngineClosed("engine closed"))
                except Exception:
                    pass
        self._workers.shutdown(wait=False, cancel_futures=True)
        self.pool.close(timeout)
        if self.fleet is not None:
            self.fleet.stop()


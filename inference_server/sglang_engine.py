"""The `sglang` engine: a pool of SGLang servers behind LocalEngine's interface, over SGLang's native HTTP API.

Standard library only (http.client in a bounded thread pool), importable without the `sglang` package.

- Generation: POST /generate {rid, input_ids, sampling_params, return_logprob: true, logprob_start_len: -1} with
  ignore_eos (tars passes its stop ids explicitly, as LocalEngine does) and top_k -1 for "off".
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
- Routing: a trajectory sticks to one replica (prefix cache); new ones go to the healthy replica with the fewest
  requests in flight. A replica that refuses a connection or fails GET /health_generate is taken out; the health
  thread puts it back when it answers again (after re-installing the current weights if it missed an update).

Launching (inference_server.sglang_launch): `launch_sglang_servers` starts `python -m sglang.launch_server
--model-path M --host H --port P --skip-tokenizer-init --weight-version V` per replica (one GPU each through
CUDA_VISIBLE_DEVICES, own process group, PDEATHSIG) and waits for /health_generate; the tests run the same code
with the conformance server as the module.
Or attach to running servers with SGLangEngine(cfg, ["http://host:port", ...]).
"""
from __future__ import annotations

import collections
import hashlib
import http.client
import json
import logging
import threading
import time
import urllib.parse
import uuid
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from inference_server.engine import EngineClosed, GenerateOutput, QueueFull, SamplingParams, TokenCallback, WeightLoadError
from core.config import InferenceConfig

log = logging.getLogger("tars.inference.sglang")


class NoHealthyReplica(EngineClosed):
    """Every SGLang replica is down (UNAVAILABLE)."""


def http_json(url: str, path: str, body: dict | None = None, timeout: float = 30.0, method: str | None = None):
    """One HTTP call -> (status, parsed JSON or text). Raises OSError (incl. timeouts) when the server is unreachable."""
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=timeout)
    try:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        conn.request(method or ("GET" if data is None else "POST"), (u.path.rstrip("/") or "") + path, data, headers)
        resp = conn.getresponse()
        raw = resp.read()
        try:
            return resp.status, json.loads(raw) if raw.strip() else None
        except ValueError:
            return resp.status, raw.decode(errors="replace")
    except http.client.HTTPException as e:  # a reply cut short: the server went away
        raise ConnectionError(f"{url}{path}: {type(e).__name__}: {e}") from e
    finally:
        conn.close()


@dataclass
class Replica:
    url: str
    healthy: bool = True
    in_flight: int = 0
    version: int = 0
    failures: int = 0
    requests: int = 0


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


def parse_version(v, default: int) -> int:
    try:
        return int(str(v))
    except (TypeError, ValueError):
        return default


def token_versions(meta: dict, n: int, default: int) -> list[int]:
    """Per-token versions of one /generate response's n output tokens (spans first, then weight_version)."""
    spans = meta.get("weight_versions")
    fallback = parse_version(meta.get("weight_version"), default)
    out = [fallback] * n
    if isinstance(spans, list):
        for s in spans:
            v = parse_version(s.get("version"), default)
            for i in range(max(0, int(s.get("start", 0))), min(n, int(s.get("end", 0)))):
                out[i] = v
    return out


class SGLangEngine:
    """LocalEngine's interface (submit / update_weights / version / metrics / validate / close) over SGLang servers."""

    def __init__(self, cfg: InferenceConfig, urls: list[str], version: int = 0, vocab_size: int | None = None,
                 name: str = "sglang", health_thread: bool = True):
        if not urls:
            raise ValueError("engine=sglang needs at least one URL in sglang_urls")
        self.cfg, self.name = cfg, name
        self.version = int(version)
        self.base_version = int(version)          # what a server's non-integer weight_version ("default") means
        self.vocab_size = vocab_size
        self.replicas = [Replica(u.rstrip("/"), version=self.version) for u in urls]
        self.uid = uuid.uuid4().hex[:8]
        self._seq = 0
        self._lock = threading.Lock()
        self._calls: dict[int, _Call] = {}
        self._sticky: collections.OrderedDict[str, Replica] = collections.OrderedDict()
        self._update_lock = threading.Lock()
        self._updating = threading.Event()
        self._no_update = threading.Event()      # the complement of _updating, to wait on
        self._no_update.set()
        self._last_weights: tuple[int, str] | None = None
        self._closed = threading.Event()
        self.stats = collections.Counter()
        self.started = time.monotonic()
        self._pool = ThreadPoolExecutor(max_workers=max(2, cfg.sglang_max_concurrency), thread_name_prefix="tars-sglang")
        self._health: threading.Thread | None = None
        if health_thread:
            self._health = threading.Thread(target=self._health_loop, name="tars-sglang-health", daemon=True)
            self._health.start()

    # ---- requests ------------------------------------------------------------------------------------
    def validate(self, input_ids: list[int], p: SamplingParams) -> None:
        """Raise ValueError (INVALID_ARGUMENT) with a message naming the offending field."""
        if not input_ids:
            raise ValueError("input_ids is empty")
        V = self.vocab_size
        bad = next((t for t in input_ids if t < 0 or (V is not None and t >= V)), None)
        if bad is not None:
            raise ValueError(f"input_ids contains {bad}, outside the vocabulary [0, {V})")
        if p.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be > 0, got {p.max_new_tokens}")
        if len(input_ids) + p.max_new_tokens > self.cfg.max_context:
            raise ValueError(f"prompt ({len(input_ids)} tokens) + max_new_tokens ({p.max_new_tokens}) exceeds max_context {self.cfg.max_context}")
        if not p.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {p.temperature}")
        if not 0 <= p.top_p <= 1:
            raise ValueError(f"top_p must be in [0, 1], got {p.top_p}")
        if p.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {p.top_k}")

    def submit(self, input_ids: list[int], params: SamplingParams | None = None, trajectory_id: str = "",
               max_stale_versions: int | None = None, on_token: TokenCallback | None = None) -> Future:
        """Queue a generation; the Future resolves to a GenerateOutput. Cancelling it aborts the request on its server.

        max_stale_versions is accepted for interface parity: SGLang flushes its cache on every update, so resumed
        requests always re-prefill under the new weights. on_token is called per token as each segment (the part
        generated between two interruptions) comes back, in the worker thread, before the Future resolves.
        """
        params = params or SamplingParams()
        input_ids = [int(t) for t in input_ids]
        self.validate(input_ids, params)
        if self._closed.is_set():
            raise EngineClosed("engine closed")
        with self._lock:
            if len(self._calls) >= self.cfg.max_queue:
                self.stats["rejected_queue_full"] += 1
                raise QueueFull(f"{len(self._calls)} requests in flight (max_queue={self.cfg.max_queue})")
            self._seq += 1
            call = _Call(self._seq, input_ids, params, trajectory_id, Future(), on_token, prompt_tokens=len(input_ids))
            self._calls[call.seq] = call
            self.stats["requests"] += 1
        call.future.add_done_callback(lambda f, c=call: self._on_done(c, f))
        self._pool.submit(self._run, call)
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
        if f.cancelled():
            self.stats["cancelled"] += 1
            rep, rid = call.replica, call.rid
            if rep is not None and rid and not self._closed.is_set():
                self._pool.submit(self._abort_rid, rep, rid)

    def _abort_rid(self, rep: Replica, rid: str) -> None:
        try:
            http_json(rep.url, "/abort_request", {"rid": rid}, timeout=5.0)
        except OSError:
            pass

    def _rid(self, call: _Call) -> str:
        h = hashlib.sha1(call.trajectory_id.encode()).hexdigest()[:10]
        return f"{self.uid}-{h}-{call.seq:012d}-{call.segment:04d}"

    # ---- routing -------------------------------------------------------------------------------------
    def route(self, trajectory_id: str, avoid: Replica | None = None) -> Replica:
        """The trajectory's replica: sticky while healthy and not overloaded, else the least loaded healthy one.

        Load-aware stickiness: a trajectory leaves its replica (and the prefix cached there) only when that replica
        has more than cfg.sticky_max_imbalance requests in flight beyond the least loaded one; queueing behind a
        hot replica costs more than re-prefilling one prompt elsewhere.
        """
        with self._lock:
            live = [r for r in self.replicas if r.healthy and r is not avoid] or [r for r in self.replicas if r.healthy]
            if not live:
                raise NoHealthyReplica(f"no healthy SGLang replica among {[r.url for r in self.replicas]}")
            least = min(r.in_flight for r in live)
            rep = self._sticky.get(trajectory_id) if trajectory_id else None
            slack = self.cfg.sticky_max_imbalance
            if rep is not None and rep in live and (slack <= 0 or rep.in_flight - least <= slack):
                self._sticky.move_to_end(trajectory_id)
                return rep
            if rep is not None and rep in live:
                self.stats["sticky_moved_for_load"] += 1
            n, h = len(self.replicas), zlib.crc32(trajectory_id.encode())
            rep = min(live, key=lambda r: (r.in_flight, (self.replicas.index(r) - h) % n))
            if trajectory_id:
                self._sticky[trajectory_id] = rep
                self._sticky.move_to_end(trajectory_id)
                while len(self._sticky) > self.cfg.cache_capacity:
                    self._sticky.popitem(last=False)
            return rep

    def _mark_down(self, rep: Replica, why: str) -> None:
        with self._lock:
            if rep.healthy:
                log.warning("SGLang replica %s taken out: %s", rep.url, why)
                self.stats["replica_down"] += 1
            rep.healthy = False

    # ---- the per-request loop (a pool thread) --------------------------------------------------------
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
                self.stats["finished"] += 1
            except Exception:
                pass

    def _generate(self, call: _Call) -> GenerateOutput:
        p = call.params
        avoid, conn_failures = None, 0
        deadline = time.monotonic() + self.cfg.sglang_request_timeout_s
        while True:
            if call.future.cancelled():
                raise EngineClosed("cancelled")
            if self._closed.is_set():
                raise EngineClosed("engine closed")
            if time.monotonic() > deadline:
                raise TimeoutError(f"generation not finished within sglang_request_timeout_s={self.cfg.sglang_request_timeout_s}")
            remaining = p.max_new_tokens - len(call.out)
            rep = self.route(call.trajectory_id, avoid)
            call.rid, call.replica = self._rid(call), rep
            body = {
                "rid": call.rid, "input_ids": call.input_ids + call.out, "return_logprob": True, "logprob_start_len": -1,
                "sampling_params": {"max_new_tokens": remaining, "temperature": p.temperature,
                                    "top_p": p.top_p if p.top_p > 0 else 1.0, "top_k": p.top_k if p.top_k > 0 else -1,
                                    "stop_token_ids": list(p.stop_token_ids), "ignore_eos": True, "no_stop_trim": True,
                                    **({"sampling_seed": p.seed} if p.seed else {})},
            }
            with self._lock:
                rep.in_flight += 1
                rep.requests += 1
            try:
                status, resp = http_json(rep.url, "/generate", body, timeout=max(1.0, deadline - time.monotonic()))
            except OSError as e:
                # Refused / reset / timed out: take the replica out and go on elsewhere with the tokens we have.
                self._mark_down(rep, f"{type(e).__name__}: {e}")
                avoid, conn_failures = rep, conn_failures + 1
                call.segment += 1
                if conn_failures > self.cfg.sglang_max_resumes:
                    raise NoHealthyReplica(f"generation failed on {conn_failures} replicas: {e}") from e
                continue
            finally:
                with self._lock:
                    rep.in_flight -= 1
            if status != 200 or not isinstance(resp, dict):
                if status >= 500:
                    self._mark_down(rep, f"HTTP {status}")
                    avoid, call.segment = rep, call.segment + 1
                    conn_failures += 1
                    if conn_failures <= self.cfg.sglang_max_resumes:
                        continue
                raise RuntimeError(f"SGLang /generate on {rep.url} failed: HTTP {status}: {str(resp)[:300]}")
            avoid = None
            meta = resp.get("meta_info") or {}
            ids = [int(t) for t in resp.get("output_ids") or []]
            lps = meta.get("output_token_logprobs") or []
            if len(lps) != len(ids):
                raise RuntimeError(f"SGLang returned {len(ids)} tokens but {len(lps)} logprobs")
            vers = token_versions(meta, len(ids), self.base_version)
            if not call.out and call.segment == 0:
                call.cached_tokens = int(meta.get("cached_tokens") or 0)
            elif call.out:
                call.recomputed_tokens += len(call.input_ids) + len(call.out)
            call.out += ids
            call.logprobs += [float(x[0]) for x in lps]
            call.versions += vers
            if len(set(vers)) > 1:  # retract / in_place: the server carried the request across an update itself
                call.interruptions += sum(1 for a, b in zip(vers, vers[1:]) if a != b)
            if call.on_token is not None:
                for t, lp, v in zip(ids, call.logprobs[-len(ids):] if ids else [], vers):
                    try:
                        call.on_token(t, lp, v)
                    except Exception:
                        log.exception("on_token callback failed")
            self.stats["tokens"] += len(ids)
            fr = meta.get("finish_reason") or {}
            kind = fr.get("type") if isinstance(fr, dict) else str(fr)
            done_by_stop = bool(call.out) and call.out[-1] in p.stop_token_ids
            if kind == "stop" or done_by_stop:
                return self._output(call, "stop")
            if kind == "length" or len(call.out) >= p.max_new_tokens or len(call.input_ids) + len(call.out) >= self.cfg.max_context:
                return self._output(call, "length")
            if kind != "abort":
                raise RuntimeError(f"SGLang finish_reason {fr!r} not understood")
            # Aborted (a weight update in mode=abort, or someone else's abort): resume with what we have.
            if call.future.cancelled():
                raise EngineClosed("cancelled")
            if fr.get("status_code") not in (None, 200) and int(fr.get("status_code") or 0) < 500:
                raise RuntimeError(f"SGLang rejected the request: {fr.get('message')}")
            call.interruptions += 1
            call.segment += 1
            self.stats["resumed"] += 1
            if call.interruptions > self.cfg.sglang_max_resumes:
                raise RuntimeError(f"request aborted {call.interruptions} times; giving up (sglang_max_resumes)")
            # Do not race the update that caused the abort: wait for its continue_generation.
            self._no_update.wait(self.cfg.update_timeout_s)

    def _output(self, call: _Call, reason: str) -> GenerateOutput:
        return GenerateOutput(call.out, call.logprobs, call.versions, reason, call.prompt_tokens, call.cached_tokens,
                              call.interruptions, call.recomputed_tokens)

    # ---- weights -------------------------------------------------------------------------------------
    def update_weights(self, version: int, path: str | None = None, state_dict: dict | None = None,
                       timeout: float | None = 120.0, wait: bool = True):
        """pause_generation -> update_weights_from_disk -> continue_generation on every healthy replica.

        `path` must be readable by every server (SGLang loads from disk; inline state dicts are not supported).
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
        if state_dict is not None and not path:
            raise WeightLoadError("the sglang engine loads weights from disk: pass a path all SGLang servers can read")
        if not path:
            raise WeightLoadError("update_weights needs a path")
        with self._update_lock:
            if version <= self.version:
                raise ValueError(f"version {version} is not newer than the current version {self.version}")
            t0 = time.monotonic()
            self._updating.set()
            self._no_update.clear()
            try:
                with self._lock:
                    interrupted = len(self._calls)
                    live = [r for r in self.replicas if r.healthy]
                if not live:
                    raise NoHealthyReplica("no healthy SGLang replica to update")
                with ThreadPoolExecutor(max_workers=len(live), thread_name_prefix="tars-sglang-update") as ex:
                    results = list(ex.map(lambda r: self._update_one(r, version, path, timeout or 120.0), live))
            finally:
                self._updating.clear()
                self._no_update.set()
            errors = [(r.url, e) for r, e in zip(live, results) if e]
            for r, e in zip(live, results):
                if e:
                    self._mark_down(r, f"weight update failed: {e}")
            if len(errors) == len(live):
                raise WeightLoadError(f"no replica accepted the weights: {errors[0][1]}")
            self.version = version
            self._last_weights = (version, path)
            self.stats["weight_updates"] += 1
            self.stats["interrupted"] += interrupted
            info = {"version": version, "load_ms": (time.monotonic() - t0) * 1e3, "interrupted_requests": interrupted,
                    "replicas": {r.url: (e or "ok") for r, e in zip(live, results)}}
            if errors:
                log.warning("weight update %d failed on %s", version, errors)
            return info

    def _update_one(self, rep: Replica, version: int, path: str, timeout: float) -> str:
        """'' on success, else the reason. Always tries to continue generation, even after a failed load."""
        err = ""
        try:
            s, r = http_json(rep.url, "/pause_generation", {"mode": self.cfg.sglang_pause_mode}, timeout=timeout)
            if s != 200:
                return f"pause_generation: HTTP {s}: {r}"
            try:
                s, r = http_json(rep.url, "/update_weights_from_disk", {"model_path": path, "weight_version": str(version),
                                                                         "flush_cache": True, "abort_all_requests": False}, timeout=timeout)
                if s != 200 or not (isinstance(r, dict) and r.get("success")):
                    err = f"update_weights_from_disk: HTTP {s}: {(r or {}).get('message') if isinstance(r, dict) else r}"
                else:
                    rep.version = version
            finally:
                s, r = http_json(rep.url, "/continue_generation", {}, timeout=timeout)
                if s != 200 and not err:
                    err = f"continue_generation: HTTP {s}: {r}"
        except OSError as e:
            err = f"{type(e).__name__}: {e}"
        return err

    # ---- health --------------------------------------------------------------------------------------
    def check_health(self) -> None:
        """One round: GET /health_generate on every replica; bring back ones that answer (with current weights)."""
        if self._updating.is_set():  # SGLang answers 503 while paused: not a sign of death
            return
        for rep in list(self.replicas):
            try:
                s, _ = http_json(rep.url, "/health_generate", timeout=self.cfg.sglang_health_timeout_s)
                ok = s == 200
            except OSError:
                ok = False
            if self._updating.is_set():
                return
            if not ok:
                rep.failures += 1
                if rep.healthy and rep.failures >= self.cfg.sglang_health_failures:
                    self._mark_down(rep, "health check failed")
                continue
            rep.failures = 0
            if not rep.healthy:
                self._readmit(rep)

    def _readmit(self, rep: Replica) -> None:
        with self._update_lock:  # no update may run while we bring this one up to date
            try:
                s, info = http_json(rep.url, "/get_model_info", timeout=self.cfg.sglang_health_timeout_s)
            except OSError:
                return
            v = parse_version((info or {}).get("weight_version") if isinstance(info, dict) else None, self.base_version)
            if v != self.version and self._last_weights is not None:
                if self._update_one(rep, *self._last_weights, self.cfg.update_timeout_s):
                    return
                v = self.version
            if v != self.version:
                return
            rep.version = v
            with self._lock:
                rep.healthy = True
                self.stats["replica_up"] += 1
            log.info("SGLang replica %s back in", rep.url)

    def _health_loop(self) -> None:
        while not self._closed.wait(self.cfg.sglang_health_interval_s):
            try:
                self.check_health()
            except Exception:
                log.exception("health check round failed")

    # ---- metrics / lifecycle -------------------------------------------------------------------------
    def metrics(self) -> dict:
        s = self.stats
        elapsed = max(time.monotonic() - self.started, 1e-9)
        with self._lock:
            in_flight = len(self._calls)
            reps = [{"url": r.url, "healthy": r.healthy, "in_flight": r.in_flight, "version": r.version, "requests": r.requests} for r in self.replicas]
        return {
            "engine": self.name, "version": self.version, "requests": s["requests"], "requests_finished": s["finished"],
            "requests_cancelled": s["cancelled"], "requests_rejected_queue_full": s["rejected_queue_full"],
            "waiting": 0, "running": in_flight, "tokens_generated": s["tokens"], "tokens_per_s": s["tokens"] / elapsed,
            "weight_updates": s["weight_updates"], "interrupted_requests": s["interrupted"], "resumed_requests": s["resumed"],
            "replicas_healthy": sum(r["healthy"] for r in reps), "replica_down_events": s["replica_down"],
            "replica_up_events": s["replica_up"], "sticky_moved_for_load": s["sticky_moved_for_load"], "replicas": reps, "pause_mode": self.cfg.sglang_pause_mode,
        }

    def close(self, timeout: float = 10.0) -> None:
        """Stop: abort this engine's requests on their servers and fail their Futures with EngineClosed."""
        if self._closed.is_set():
            return
        self._closed.set()
        with self._lock:
            calls = list(self._calls.values())
        for c in calls:
            if c.replica is not None and c.rid:
                self._abort_rid(c.replica, c.rid)
            if not c.future.done():
                try:
                    c.future.set_exception(EngineClosed("engine closed"))
                except Exception:
                    pass
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._health is not None:
            self._health.join(timeout)


# Launching servers lives in inference_server.sglang_launch; re-exported here for callers of the old place.
from inference_server.sglang_launch import launch_sglang_servers, stop_sglang_servers, wait_healthy  # noqa: E402,F401

"""The replicas behind the `sglang` engine: routing, health, and installing new weights on every one of them.

- Routing: a trajectory sticks to one replica (prefix cache); new ones go to the healthy replica with the fewest
  requests in flight. A replica that refuses a connection or fails GET /health_generate is taken out; the health
  thread puts it back when it answers again (after re-installing the current weights if it missed an update).
- Weight updates: pause_generation(mode) -> update_weights_from_disk(weight_version) -> continue_generation on every
  healthy replica, all at once. While one runs, `updating` is set: health checks do not count a paused replica's
  503 as death, and a request the update aborted waits (wait_no_update) before it is resumed. A replica whose update
  fails is taken out at once, before its continue_generation (not when the slowest replica is done: new requests
  would meet the old weights there), unless every replica fails (then all keep serving the old weights).

The request path (inference_server.sglang_engine) owns the generations; this pool owns the replicas' state, under
its own lock, and shares the engine's counters.
"""
from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterator

from core.config import InferenceConfig
from inference_server.engine_types import EngineClosed, UpdateBusy, WeightLoadError, check_version_step
from inference_server.sglang_http import http_json, parse_version

log = logging.getLogger("tars.inference.sglang")


class NoHealthyReplica(EngineClosed):
    """Every SGLang replica is down (UNAVAILABLE)."""


class Stats:
    """The engine's and the pool's counters, updated from worker, health and update threads: each update under one
    lock (a Counter's `c[k] += n` reads, then writes; two threads that both read first lose an update)."""

    def __init__(self):
        self._counts: collections.Counter = collections.Counter()
        self._lock = threading.Lock()

    def add(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._counts[key] += n

    def snapshot(self) -> collections.Counter:
        """A copy of every counter (missing ones read 0)."""
        with self._lock:
            return collections.Counter(self._counts)

    def __getitem__(self, key: str) -> int:
        return self.snapshot()[key]


@dataclass
class Replica:
    url: str
    healthy: bool = True
    in_flight: int = 0
    version: int = 0
    failures: int = 0
    requests: int = 0


class ReplicaPool:
    def __init__(self, cfg: InferenceConfig, urls: list[str], version: int, stats: Stats):
        self.cfg = cfg
        self.version = int(version)               # installed on every healthy replica
        self.base_version = int(version)          # what a server's non-integer weight_version ("default") means
        self.stats = stats
        self.replicas = [Replica(u.rstrip("/"), version=self.version) for u in urls]
        self._lock = threading.Lock()
        self._sticky: collections.OrderedDict[str, Replica] = collections.OrderedDict()
        self._update_lock = threading.Lock()
        self._updating = threading.Event()
        self._no_update = threading.Event()      # the complement of _updating, to wait on
        self._no_update.set()
        self._last_weights: tuple[int, str | None, tuple | None] | None = None
        self._closed = threading.Event()
        self._health: threading.Thread | None = None

    # ---- routing -------------------------------------------------------------------------------------
    def has_other(self, urls: set[str]) -> bool:
        """Some healthy replica whose URL is not in urls."""
        with self._lock:
            return any(r.healthy and r.url not in urls for r in self.replicas)

    def route(self, trajectory_id: str, avoid: Replica | None = None, skip: set[str] | None = None) -> Replica:
        """The trajectory's replica: sticky while healthy and not overloaded, else the least loaded healthy one.

        Load-aware stickiness: a trajectory leaves its replica (and the prefix cached there) only when that replica
        has more than cfg.sticky_max_imbalance requests in flight beyond the least loaded one; queueing behind a
        hot replica costs more than re-prefilling one prompt elsewhere. `skip`: replicas whose queue is full for this
        request (avoided while another healthy one is left).
        """
        with self._lock:
            live = [r for r in self.replicas if r.healthy and r.url not in (skip or ())]
            live = [r for r in live if r is not avoid] or live or [r for r in self.replicas if r.healthy]
            if not live:
                raise NoHealthyReplica(f"no healthy SGLang replica among {[r.url for r in self.replicas]}")
            least = min(r.in_flight for r in live)
            rep = self._sticky.get(trajectory_id) if trajectory_id else None
            slack = self.cfg.sticky_max_imbalance
            if rep is not None and rep in live and (slack <= 0 or rep.in_flight - least <= slack):
                self._sticky.move_to_end(trajectory_id)
                return rep
            if rep is not None and rep in live:
                self.stats.add("sticky_moved_for_load")
            n, h = len(self.replicas), zlib.crc32(trajectory_id.encode())
            rep = min(live, key=lambda r: (r.in_flight, (self.replicas.index(r) - h) % n))
            if trajectory_id:
                self._sticky[trajectory_id] = rep
                self._sticky.move_to_end(trajectory_id)
                while len(self._sticky) > self.cfg.cache_capacity:
                    self._sticky.popitem(last=False)
            return rep

    @contextlib.contextmanager
    def serving(self, rep: Replica) -> Iterator[None]:
        """Count one request in flight on rep for the duration of the block (routing balances on it)."""
        with self._lock:
            rep.in_flight += 1
            rep.requests += 1
        try:
            yield
        finally:
            with self._lock:
                rep.in_flight -= 1

    def mark_down(self, rep: Replica, why: str) -> None:
        with self._lock:
            if rep.healthy:
                log.warning("SGLang replica %s taken out: %s", rep.url, why)
                self.stats.add("replica_down")
            rep.healthy = False

    def snapshot(self) -> list[dict]:
        """One dict per replica (url, healthy, in_flight, version, requests), for metrics."""
        with self._lock:
            return [{"url": r.url, "healthy": r.healthy, "in_flight": r.in_flight, "version": r.version, "requests": r.requests}
                    for r in self.replicas]

    # ---- weights -------------------------------------------------------------------------------------
    def wait_no_update(self, timeout: float) -> bool:
        """Block until no weight update is running (at most timeout seconds); True if none is."""
        return self._no_update.wait(timeout)

    def update_weights(self, version: int, path: str | None, timeout: float | None, requests_in_flight: Callable[[], int],
                       tensors: tuple[list[str], object] | None = None) -> dict:
        """Install `path` (update_weights_from_disk), or `tensors` = (serialized_named_tensors, the shared tensors they
        point to) through update_weights_from_tensor, as `version` on every healthy replica; {version, load_ms,
        interrupted_requests, replicas}. The shared tensors are kept until the next update (a replica brought back
        in is brought up to date from them).

        requests_in_flight() is asked once the update has the pool to itself: the engine's generations it interrupts.
        Raises UpdateBusy when another update (or a replica being brought up to date) held the pool past `timeout`
        (never installed then), ValueError when the version is not newer, WeightsRefused when it jumps past cfg.max_version_jump,
        NoHealthyReplica when none is up, WeightLoadError when no replica accepts the weights (all keep serving the
        old ones; one that refuses what others took is taken out until it can be brought up to date). SGLang reads the weights itself: they are not checked for
        non-finite values here (the local engine does).
        """
        # Another update (or a replica being brought up to date) holds the pool: wait at most this update's own
        # deadline, then refuse it for good (UpdateBusy), rather than install it after its caller was told it failed.
        if not self._update_lock.acquire(timeout=-1 if timeout is None else max(timeout, 0.0)):
            raise UpdateBusy(f"version {version} not installed: another weight update held the SGLang pool for {timeout}s")
        try:
            check_version_step(self.version, version, self.cfg.max_version_jump)
            t0 = time.monotonic()
            self._updating.set()
            self._no_update.clear()
            try:
                interrupted = requests_in_flight()
                with self._lock:
                    live = [r for r in self.replicas if r.healthy]
                if not live:
                    raise NoHealthyReplica("no healthy SGLang replica to update")
                pending, taken = [len(live)], []  # replicas of this update not failed; those taken out on failing

                def failed(r: Replica, e: str) -> None:
                    """Out of rotation at once, before it serves (old weights) again, unless every replica has failed:
                    then the weights are at fault, and all keep serving the old ones."""
                    with self._lock:
                        pending[0] -= 1
                        if not pending[0]:
                            return
                        taken.append(r)
                    self.mark_down(r, f"weight update failed: {e}")

                with ThreadPoolExecutor(max_workers=len(live), thread_name_prefix="tars-sglang-update") as ex:
                    results = list(ex.map(lambda r: self._update_one(r, version, path, timeout or 120.0, tensors,
                                                                     failed), live))
            finally:
                self._updating.clear()
                self._no_update.set()
            errors = [(r.url, e) for r, e in zip(live, results) if e]
            if len(errors) == len(live):  # the weights, not the replicas: all keep serving the old ones
                with self._lock:
                    for r in taken:  # taken out while another could still take the weights: back in, as it was
                        r.healthy = True
                        self.stats.add("replica_up")
                raise WeightLoadError(f"no replica accepted the weights: {errors[0][1]}")
            for r, e in zip(live, results):
                if e:  # the others took them: this one is behind until it is brought up to date
                    self.mark_down(r, f"weight update failed: {e}")
            self.version = version
            self._last_weights = (version, path, tensors)
            self.stats.add("weight_updates")
            self.stats.add("interrupted", interrupted)
            info = {"version": version, "load_ms": (time.monotonic() - t0) * 1e3, "interrupted_requests": interrupted,
                    "replicas": {r.url: (e or "ok") for r, e in zip(live, results)}}
            if errors:
                log.warning("weight update %d failed on %s", version, errors)
            return info
        finally:
            self._update_lock.release()

    def _update_one(self, rep: Replica, version: int, path: str | None, timeout: float,
                    tensors: tuple[list[str], object] | None = None,
                    failed: Callable[[Replica, str], None] | None = None) -> str:
        """'' on success, else the reason. Always tries to continue generation, even after a failed load or a pause
        that failed or timed out (the server may be paused all the same: it would answer no /health_generate, so no
        health round would ever let it back in). failed(rep, reason) is called before that continue_generation when
        the pause or the load failed."""
        err = self._load_one(rep, version, path, timeout, tensors)
        if err and failed is not None:
            failed(rep, err)
        try:
            s, r = http_json(rep.url, "/continue_generation", {}, timeout=timeout)
            if s != 200 and not err:
                err = f"continue_generation: HTTP {s}: {r}"
        except OSError as e:
            err = err or f"{type(e).__name__}: {e}"
        return err

    def _load_one(self, rep: Replica, version: int, path: str | None, timeout: float,
                  tensors: tuple[list[str], object] | None) -> str:
        """pause_generation, then the weights from `path` or `tensors`: '' on success, else the reason."""
        try:
            s, r = http_json(rep.url, "/pause_generation", {"mode": self.cfg.sglang_pause_mode}, timeout=timeout)
            if s != 200:
                return f"pause_generation: HTTP {s}: {r}"
            common = {"weight_version": str(version), "flush_cache": True, "abort_all_requests": False}
            if tensors is not None:
                route, body = "/update_weights_from_tensor", {"serialized_named_tensors": tensors[0], "load_format": None, **common}
            else:
                route, body = "/update_weights_from_disk", {"model_path": path, **common}
            s, r = http_json(rep.url, route, body, timeout=timeout)
            if s != 200 or not (isinstance(r, dict) and r.get("success")):
                return f"{route[1:]}: HTTP {s}: {(r or {}).get('message') if isinstance(r, dict) else r}"
        except OSError as e:
            return f"{type(e).__name__}: {e}"
        rep.version = version
        return ""

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
                    self.mark_down(rep, "health check failed")
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
                v_, path_, tensors_ = self._last_weights
                if self._update_one(rep, v_, path_, self.cfg.update_timeout_s, tensors_):
                    return
                v = self.version
            if v != self.version:
                return
            rep.version = v
            with self._lock:
                rep.healthy = True
                self.stats.add("replica_up")
            log.info("SGLang replica %s back in", rep.url)

    def start_health_thread(self) -> None:
        """Check every cfg.sglang_health_interval_s in a daemon thread until close()."""
        if self._health is None:
            self._health = threading.Thread(target=self._health_loop, name="tars-sglang-health", daemon=True)
            self._health.start()

    def _health_loop(self) -> None:
        while not self._closed.wait(self.cfg.sglang_health_interval_s):
            try:
                self.check_health()
            except Exception:
                log.exception("health check round failed")

    def close(self, timeout: float = 10.0) -> None:
        """Stop the health thread (waiting up to timeout seconds for a round in progress)."""
        self._closed.set()
        if self._health is not None:
            self._health.join(timeout)

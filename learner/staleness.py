"""Staleness control for asynchronous RL: AReaL's admission rule plus a per-token lag histogram.

The learner trains on batches of B trajectories; every update bumps the policy version. Actors start episodes only
when the manager admits them, and admission obeys

    accepted + running <= B * (version + 1 + eta)          (and running <= max_concurrent, when set)

which bounds how far *starting* runs ahead of training: at most B * (1 + eta) episodes are started beyond what has
been trained (eta = 0: synchronous RL, exactly one batch's worth of episodes per version, lag 0). It does not bound the
lag on arrival when episode lengths vary: a slow episode is overtaken by ones started after it and can be trained
several versions later (tars bench async measured lags up to 6 at eta = 2 on a long-tail workload). The hard bound is
the learner's max_lag, which drops and counts anything older.

Who calls what (nothing may be counted twice):
  try_admit   the stream receiver, answering an actor's ADMIT          running += granted
  adopt       the stream receiver, for trajectories it did not admit    running += n
              (WAL replay after a learner restart, an arrival no admission covers)
  adopt_claim the stream receiver, for the in-flight episodes an actor  running += min(n, capacity)
              says (HELLO) a previous learner admitted: taken on its word, so never more than could be admitted
              now (a lying HELLO cannot push running past the bound and hold admissions shut)
  on_lost     the stream receiver, for FINISHED_LOST / dead actors      running -= n
  on_rejected the stream receiver for a NACKed (undecodable) frame,     running -= n, rejected += n
              the training loop for a delivered trajectory it drops (infra_error, too stale)
  on_accepted the training loop, once per delivered trajectory it keeps running -= n, accepted += n
  on_dropped  the training loop, for kept ones it drops after all       accepted -= n, rejected += n
              (a GRPO member that fell past max_lag while its group was incomplete)
  set_version the training loop after each update
"""
from __future__ import annotations

import threading

import numpy as np


class StalenessManager:
    """Thread-safe (one lock) admission control; all methods are O(1) except record_staleness (O(tokens))."""

    def __init__(self, batch_size: int, eta: int, max_concurrent: int | None = None, max_lag: int = 8):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if eta < 0:
            raise ValueError(f"eta must be >= 0, got {eta}")
        if max_concurrent is not None and max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1 or None, got {max_concurrent}")
        self._lock = threading.Lock()
        self.batch_size = batch_size
        self._eta = eta
        self.max_concurrent = max_concurrent
        self._version = 0
        self._running = 0
        self._accepted = 0
        self._rejected = 0
        self._lost = 0
        self._admitted = 0      # total ever granted (for stats)
        self._asked = 0         # total ever asked for
        # Histogram of per-token lag (train_version - generating version): bins 0..max_lag, then overflow.
        self.max_lag = max_lag
        self._hist = np.zeros(max_lag + 1, np.int64)
        self._overflow = 0
        self._negative = 0      # tokens "from the future": a bookkeeping bug somewhere, counted not hidden
        self._lag_sum = 0
        self._lag_max = 0

    # --- admission ------------------------------------------------------------------------------------------------
    def _capacity_locked(self) -> int:
        cap = (self._eta + self._version + 1) * self.batch_size - (self._accepted + self._running)
        if self.max_concurrent is not None:
            cap = min(cap, self.max_concurrent - self._running)
        return max(cap, 0)

    def capacity(self) -> int:
        """How many more episodes may start now."""
        with self._lock:
            return self._capacity_locked()

    def try_admit(self, n: int = 1) -> int:
        """Grant up to n episode starts (never more than capacity); the granted ones count as running."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        with self._lock:
            g = min(n, self._capacity_locked())
            self._running += g
            self._admitted += g
            self._asked += n
            return g

    def skip_versions(self, n: int) -> None:
        """The policy version jumps n ahead without n updates (a resume behind what the servers serve: the
        learner's next version follows theirs): those versions' batches count as accepted, so the admission bound
        (capacity) stays where it was."""
        with self._lock:
            self._accepted += max(0, n) * self.batch_size

    def adopt(self, n: int = 1) -> None:
        """Count n episodes as running that were admitted elsewhere (a previous learner); no capacity check."""
        with self._lock:
            self._running += n

    def adopt_claim(self, n: int) -> int:
        """Count as running up to n episodes an actor claims a previous learner admitted, never more than the
        capacity (what it could be admitted now); returns how many were taken. The receiver gives back (on_lost)
        what no arrival bears out in time; an arrival beyond the claim is adopted on its own."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        with self._lock:
            g = min(n, self._capacity_locked())
            self._running += g
            return g

    def _finish_locked(self, n: int, what: str) -> None:
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if n > self._running:
            # More finishes than starts means a double count somewhere; fail loudly rather than drift.
            raise ValueError(f"{what}({n}) with only {self._running} running")
        self._running -= n

    def on_accepted(self, n: int = 1) -> None:
        """n running episodes finished and were kept for training."""
        with self._lock:
            self._finish_locked(n, "on_accepted")
            self._accepted += n

    def on_rejected(self, n: int = 1) -> None:
        """n running episodes finished but will not be trained on (infra_error, too stale, undecodable)."""
        with self._lock:
            self._finish_locked(n, "on_rejected")
            self._rejected += n

    def on_dropped(self, n: int = 1) -> None:
        """n accepted episodes will not be trained after all (too stale by the time their group is released)."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        with self._lock:
            if n > self._accepted:
                raise ValueError(f"on_dropped({n}) with only {self._accepted} accepted")
            self._accepted -= n
            self._rejected += n

    def on_lost(self, n: int) -> None:
        """n admitted episodes will never finish (their actor died or abandoned them): give the admission back."""
        with self._lock:
            self._finish_locked(n, "on_lost")
            self._lost += n

    def set_version(self, v: int) -> None:
        with self._lock:
            if v < 0:
                raise ValueError(f"version must be >= 0, got {v}")
            self._version = v

    def set_eta(self, eta: int) -> None:
        """Change the staleness bound live; lowering it only stops new admissions, running episodes are kept."""
        if eta < 0:
            raise ValueError(f"eta must be >= 0, got {eta}")
        with self._lock:
            self._eta = eta

    @property
    def version(self) -> int:
        with self._lock:
            return self._version

    @property
    def eta(self) -> int:
        with self._lock:
            return self._eta

    def state_dict(self) -> dict:
        """What a checkpoint keeps; `running` is not kept (a restarted learner re-learns it through adopt)."""
        with self._lock:
            return {"version": self._version, "accepted": self._accepted, "rejected": self._rejected,
                    "lost": self._lost, "eta": self._eta, "batch_size": self.batch_size}

    def load_state_dict(self, d: dict) -> None:
        """A ledger kept under another batch size (a resume with another learner.batch_size) is re-based: `accepted`
        keeps its surplus over version x the old batch size, counted against this one, so the bound stays (eta + 1)
        batches ahead of training (as it was, it shut admissions for good when the size shrank: capacity 0 at a
        version no update could reach without admissions; and opened many batches at once when it grew)."""
        with self._lock:
            self._version = int(d["version"])
            self._accepted = int(d["accepted"])
            old_b = int(d.get("batch_size", self.batch_size))
            if old_b != self.batch_size:
                self._accepted = max(0, self._accepted + self._version * (self.batch_size - old_b))
            self._rejected = int(d.get("rejected", 0))
            self._lost = int(d.get("lost", 0))
            self._eta = int(d.get("eta", self._eta))

    def stats(self) -> dict:
        with self._lock:
            return {"version": self._version, "eta": self._eta, "batch_size": self.batch_size,
                    "max_concurrent": self.max_concurrent, "running": self._running, "accepted": self._accepted,
                    "rejected": self._rejected, "lost": self._lost, "admitted": self._admitted,
                    "asked": self._asked, "capacity": self._capacity_locked()}

    # --- per-token staleness histogram ----------------------------------------------------------------------------
    def record_staleness(self, token_versions: np.ndarray, train_version: int) -> None:
        """Add the lag of every generated token (version >= 0; -1 marks prompt/env tokens) trained at train_version."""
        v = np.asarray(token_versions).reshape(-1)
        v = v[v >= 0]
        if not len(v):
            return
        lag = train_version - v.astype(np.int64)                              # [n]
        neg = int((lag < 0).sum())
        ok = lag[(lag >= 0) & (lag <= self.max_lag)]
        counts = np.bincount(ok, minlength=self.max_lag + 1)                  # [max_lag + 1]
        over = int((lag > self.max_lag).sum())
        with self._lock:
            self._hist += counts
            self._overflow += over
            self._negative += neg
            self._lag_sum += int(lag[lag >= 0].sum())
            self._lag_max = max(self._lag_max, int(lag.max()))

    def histogram(self) -> dict:
        """{"bins": counts for lag 0..max_lag, "overflow", "negative", "tokens", "mean", "max"}."""
        with self._lock:
            n_nonneg = int(self._hist.sum()) + self._overflow
            return {"bins": self._hist.tolist(), "overflow": self._overflow, "negative": self._negative,
                    "tokens": n_nonneg + self._negative,
                    "mean": self._lag_sum / n_nonneg if n_nonneg else 0.0, "max": self._lag_max}

"""The backend contract every environment in envd implements.

A backend is a plain, synchronous, stateful object: the daemon owns its lifetime (one per session), runs its
blocking calls in a worker thread, hands `step` the request's action decoded once (core.action.Action: a known
type, points of two numbers; whether it applies here is the backend's to check), reports how the episode stands
as a core.outcome.Outcome (running, terminated or truncated: a backend that broke raises instead of reporting
INFRA_ERROR), and maps its exceptions to statuses:
  ActionError        -> INVALID_ARGUMENT (the session keeps working)
  NotImplementedError from snapshot/restore/fork -> UNIMPLEMENTED
  any other exception -> the episode ends as INFRA_ERROR (never a reward of 0)
and says what it may use of the host (`resources`): the daemon sums that over its sessions against a host-wide
budget (envd.max_total_pids / max_total_memory_mb / max_total_disk_mb) before a session is let in.

Every backend takes the session option `screenshots` (core.session_options: 1, the default, or 0). envd.registry.make
takes it out before the backend parses the rest and sets `Env.screenshots`; a backend that captures screenshots skips
the capture when it is False, and envd sends no image for such a session whatever a backend returns.
"""
from __future__ import annotations

import abc
import hashlib
import threading
import time
from dataclasses import dataclass, field
from typing import Any

# ActionError is part of the backend contract (raise it for an action that does not apply: the session is
# unchanged and keeps working); it lives with the Action type, which raises it for a malformed one.
from core.action import Action, ActionError
from core.outcome import Outcome

__all__ = ["Action", "ActionError", "Env", "Outcome", "Resources", "Screenshot", "StepResult", "call_time_left",
           "refuse_unknown"]

_call = threading.local()  # .deadline: the monotonic time by which envd stops waiting for this thread's backend call


def call_deadline(deadline: float | None) -> None:
    """Set (or clear, None) envd's deadline for the backend call the current thread runs (envd/sessions.py)."""
    _call.deadline = deadline


def call_time_left(limit: float) -> float:
    """How long a wait inside a backend call may last: `limit` (the backend's own per-command timeout), cut to what
    is left of envd's deadline for the call when the daemon runs it (0 once that has passed). Past that deadline
    the daemon has answered and gone; a wait longer than it only kept a worker thread from other sessions."""
    deadline = getattr(_call, "deadline", None)
    return limit if deadline is None else max(0.0, min(limit, deadline - time.monotonic()))


def refuse_unknown(backend: str, options, known) -> None:
    """ValueError naming the option names `backend` does not take, and the ones it does (a typo must not be
    ignored: a run would go on with the option unapplied)."""
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(f"unknown {backend} option(s) {unknown}; known: {sorted(known)}")


def typed_content(action: Action, limit: int) -> str:
    """A type() action's content, or ActionError: empty, or over `limit` characters (what one type() may carry)."""
    if not action.content:
        raise ActionError("type needs non-empty content")
    if len(action.content) > limit:
        raise ActionError(f"content is {len(action.content)} characters; at most {limit} per type()")
    return action.content


@dataclass
class Screenshot:
    data: bytes
    mime: str = "image/png"
    width: int = 0
    height: int = 0

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()


@dataclass
class StepResult:
    text: str                          # what a text policy reads: accessibility tree, terminal screen, ...
    instruction: str = ""              # the task in words
    reward: float = 0.0
    outcome: Outcome = Outcome.RUNNING  # running | terminated | truncated
    images: list[Screenshot] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)   # e.g. {"success": True}
    width: int = 0
    height: int = 0
    step: int = 0


@dataclass(frozen=True)
class Resources:
    """What one session may use of the host at most: processes (threads included), memory (MiB) and disk (MiB on
    the file system of envd's scratch root, envd/scratch.py). For a sandbox these are the limits it is given; for a
    backend without one, a documented estimate."""

    pids: int = 0
    memory_mb: int = 0
    disk_mb: int = 0

    def __add__(self, other: "Resources") -> "Resources":
        return Resources(self.pids + other.pids, self.memory_mb + other.memory_mb, self.disk_mb + other.disk_mb)

    def __sub__(self, other: "Resources") -> "Resources":
        return Resources(self.pids - other.pids, self.memory_mb - other.memory_mb, self.disk_mb - other.disk_mb)

    def most(self, other: "Resources") -> "Resources":
        """The larger of the two in each resource (`Resources()` as `other`: no negative figure)."""
        return Resources(max(self.pids, other.pids), max(self.memory_mb, other.memory_mb),
                         max(self.disk_mb, other.disk_mb))

    def __str__(self) -> str:
        return f"{self.pids} processes, {self.memory_mb} MiB of memory, {self.disk_mb} MiB of disk"


class Env(abc.ABC):
    """One stateful environment instance (one session)."""

    env_id: str = ""
    action_space: str = "UI-TARS actions"
    # True only for backends whose reset/step are pure in-memory computation that cannot block (microseconds):
    # the daemon then calls them on its event loop instead of a worker thread, so they get no deadline.
    nonblocking: bool = False
    # What a session of this backend may use of the host (see `resources`); in-process backends use nothing beyond
    # the daemon's own memory, which envd.max_sessions bounds.
    claim: Resources = Resources()
    # False: observations carry no screenshot (the session option screenshots=0, set by envd.registry.make); a
    # backend that captures them skips the capture.
    screenshots: bool = True

    @abc.abstractmethod
    def reset(self, seed: int, options: dict[str, str]) -> StepResult: ...

    @abc.abstractmethod
    def step(self, action: Action) -> StepResult: ...

    def resources(self, options: dict[str, str] | None = None) -> Resources:
        """The host resources this session may use, now (options None) or after a Reset with `options` (ValueError
        when it would refuse them). The daemon charges it against its host-wide budget before it lets the session
        in and before such a Reset, and gives it back when the session is gone."""
        return self.claim

    def observe(self) -> StepResult:
        raise NotImplementedError(f"{self.env_id} cannot re-render its observation")

    def close(self) -> None:
        pass

    def snapshot(self) -> bytes:
        raise NotImplementedError(f"{self.env_id} does not support snapshots")

    def restore(self, state: bytes) -> StepResult:
        raise NotImplementedError(f"{self.env_id} does not support restore")

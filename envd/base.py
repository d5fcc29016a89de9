"""The backend contract every environment in envd implements.

A backend is a plain, synchronous, stateful object: the daemon owns its lifetime (one per session), runs its
blocking calls in a worker thread, hands `step` the request's action decoded once (core.action.Action: a known
type, points of two numbers; whether it applies here is the backend's to check), reports how the episode stands
as a core.outcome.Outcome (running, terminated or truncated: a backend that broke raises instead of reporting
INFRA_ERROR), and maps its exceptions to statuses:
  ActionError        -> INVALID_ARGUMENT (the session keeps working)
  NotImplementedError from snapshot/restore/fork -> UNIMPLEMENTED
  any other exception -> the episode ends as INFRA_ERROR (never a reward of 0)
"""
from __future__ import annotations

import abc
import hashlib
from dataclasses import dataclass, field
from typing import Any

# ActionError is part of the backend contract (raise it for an action that does not apply: the session is
# unchanged and keeps working); it lives with the Action type, which raises it for a malformed one.
from core.action import Action, ActionError
from core.outcome import Outcome

__all__ = ["Action", "ActionError", "Env", "Outcome", "Screenshot", "StepResult"]


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


class Env(abc.ABC):
    """One stateful environment instance (one session)."""

    env_id: str = ""
    action_space: str = "UI-TARS actions"
    # True only for backends whose reset/step are pure in-memory computation that cannot block (microseconds):
    # the daemon then calls them on its event loop instead of a worker thread, so they get no deadline.
    nonblocking: bool = False

    @abc.abstractmethod
    def reset(self, seed: int, options: dict[str, str]) -> StepResult: ...

    @abc.abstractmethod
    def step(self, action: Action) -> StepResult: ...

    def observe(self) -> StepResult:
        raise NotImplementedError(f"{self.env_id} cannot re-render its observation")

    def close(self) -> None:
        pass

    def snapshot(self) -> bytes:
        raise NotImplementedError(f"{self.env_id} does not support snapshots")

    def restore(self, state: bytes) -> StepResult:
        raise NotImplementedError(f"{self.env_id} does not support restore")

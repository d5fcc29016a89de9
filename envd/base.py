"""The backend contract every environment in envd implements.

A backend is a plain, synchronous, stateful object: the daemon owns its lifetime (one per session), runs its
blocking calls in a worker thread, and maps its exceptions to statuses:
  ActionError        -> INVALID_ARGUMENT (the session keeps working)
  NotImplementedError from snapshot/restore/fork -> UNIMPLEMENTED
  any other exception -> the episode ends as INFRA_ERROR (never a reward of 0)
"""
from __future__ import annotations

import abc
import hashlib
from dataclasses import dataclass, field
from typing import Any

RUNNING, TERMINATED, TRUNCATED, INFRA_ERROR = "running", "terminated", "truncated", "infra_error"

# Action dicts mirror tars.v1.Action: {"type": ..., "point": [x, y], "end_point": [x, y], "content": str,
# "key": str, "direction": str, "target": str}. Unset fields may be absent.
ACTION_TYPES = ("click", "left_double", "right_single", "drag", "hotkey", "type", "scroll", "wait", "finished", "call_user")


class ActionError(ValueError):
    """The action is malformed or not applicable here; the session is unchanged and keeps working."""


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
    outcome: str = RUNNING             # running | terminated | truncated
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
    def step(self, action: dict[str, Any]) -> StepResult: ...

    def observe(self) -> StepResult:
        raise NotImplementedError(f"{self.env_id} cannot re-render its observation")

    def close(self) -> None:
        pass

    def snapshot(self) -> bytes:
        raise NotImplementedError(f"{self.env_id} does not support snapshots")

    def restore(self, state: bytes) -> StepResult:
        raise NotImplementedError(f"{self.env_id} does not support restore")

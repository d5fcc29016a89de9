"""How a step or an episode stands: one enum from envd's backends through the wire and the stream to the loss filter.

A `str` enum, so it is its own msgpack and JSON form ("terminated", ...) and compares equal to those strings.
`INFRA_ERROR` means the environment broke: never a reward of 0, never trained on.
"""
from __future__ import annotations

import enum


class Outcome(enum.StrEnum):
    RUNNING = "running"          # the episode goes on
    TERMINATED = "terminated"    # the task is over (success or failure): bootstrap 0
    TRUNCATED = "truncated"      # a step, turn or time limit cut it: the last state still has a value
    INFRA_ERROR = "infra_error"  # the environment or the plumbing broke: kept out of the loss

    @property
    def ended(self) -> bool:
        return self is not Outcome.RUNNING

    def to_proto(self) -> int:
        from core.v1 import common_pb2

        return {Outcome.RUNNING: common_pb2.RUNNING, Outcome.TERMINATED: common_pb2.TERMINATED,
                Outcome.TRUNCATED: common_pb2.TRUNCATED, Outcome.INFRA_ERROR: common_pb2.INFRA_ERROR}[self]

    @classmethod
    def from_proto(cls, value: int) -> "Outcome":
        """tars.v1.Outcome -> Outcome; an unknown or unspecified value is an infra error (the peer is broken)."""
        from core.v1 import common_pb2

        return {common_pb2.RUNNING: cls.RUNNING, common_pb2.TERMINATED: cls.TERMINATED,
                common_pb2.TRUNCATED: cls.TRUNCATED}.get(value, cls.INFRA_ERROR)


# The outcomes an episode can end with (what a trajectory on the stream may carry).
ENDED = (Outcome.TERMINATED, Outcome.TRUNCATED, Outcome.INFRA_ERROR)


class Fault(enum.StrEnum):
    """Which part broke, for an episode that ended INFRA_ERROR (NONE for every other episode).

    Typed so that a caller reacts to the kind of failure (the actor avoids a daemon that failed it) without reading
    the error text; on the stream it is its string value, like Outcome.
    """
    NONE = ""
    ENVD = "envd"              # the env daemon: unreachable, restarted, or it lost the session
    ENV = "env"                # the backend broke and envd reported the step as INFRA_ERROR
    INFERENCE = "inference"    # the inference servers failed past the client's retries
    JUDGE = "judge"            # the LLM judge gave no verdict (judge_on_error = infra_error)

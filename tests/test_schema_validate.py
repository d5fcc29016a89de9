"""Trajectory.validate's array checks (one or two numpy passes each, the receiver runs them on every trajectory) against
a plain per-element reference, on trajectories with one corruption each, over several dtypes."""
import math

import numpy as np
import pytest

from core.outcome import Outcome
from core.schema import InvalidTrajectory, Trajectory, Turn


def _reference_ok(tokens, mask, versions, logprobs, vocab) -> bool:
    for i, t in enumerate(tokens):
        if t < 0 or (vocab is not None and t >= vocab):
            return False
    for i, m in enumerate(mask):
        if m not in (0, 1):
            return False
        if m == 1 and versions[i] < 0:
            return False
    return all(math.isfinite(float(x)) and float(x) <= 1e-4 for x in logprobs)


def _traj(tokens, mask, versions, logprobs) -> Trajectory:
    n = len(tokens)
    return Trajectory(id="t", env_id="e", tokens=tokens, logprobs=logprobs, versions=versions, mask=mask,
                      turns=[Turn("o", "x", {}, 0.0, 0, n)], outcome=Outcome.TERMINATED, ret=0.0)


def _corrupt(rng, tokens, mask, versions, logprobs, vocab):
    n = len(tokens)
    i = int(rng.integers(n))
    kind = rng.integers(9)
    if kind == 0:
        tokens[i] = -int(rng.integers(1, 2**31 - 1))
    elif kind == 1:
        tokens[i] = vocab + int(rng.integers(0, 5))
    elif kind == 2:
        mask[i] = int(rng.integers(2, 100))
    elif kind == 3:
        mask[i], versions[i] = 1, -int(rng.integers(1, 5))
    elif kind == 4:
        versions[i] = -1  # on a prompt token (mask 0): fine
        mask[i] = 0
    elif kind == 5:
        logprobs[i] = float(rng.choice([np.nan, np.inf, -np.inf]))
    elif kind == 6:
        logprobs[i] = float(rng.uniform(0.01, 3.0))
    elif kind == 7 and mask.dtype.kind == "i":
        mask[i] = -1
    # kind 8 (and 7 on unsigned masks): left valid


@pytest.mark.parametrize("tok_dt,mask_dt", [("<i4", "u1"), ("<i8", "u1"), ("<i4", "i1"), ("<i8", "i8")])
def test_validate_agrees_with_reference(tok_dt, mask_dt):
    rng = np.random.default_rng(7)
    vocab = 500
    seen = {True: 0, False: 0}
    for trial in range(400):
        n = int(rng.integers(1, 60))
        tokens = rng.integers(0, vocab, n).astype(tok_dt)
        mask = rng.integers(0, 2, n).astype(mask_dt)
        versions = np.where(mask == 1, rng.integers(0, 9, n), -1).astype("<i4")
        logprobs = -rng.exponential(1.0, n).astype("<f4")
        for _ in range(int(rng.integers(0, 3))):
            _corrupt(rng, tokens, mask, versions, logprobs, vocab)
        for v in (vocab, None):
            ok = _reference_ok(tokens, mask, versions, logprobs, v)
            seen[ok] += 1
            tr = _traj(tokens, mask, versions, logprobs)
            if ok:
                tr.validate(v)
            else:
                with pytest.raises(InvalidTrajectory):
                    tr.validate(v)
    assert seen[True] > 100 and seen[False] > 100


def test_messages_name_the_fault():
    base = dict(tokens=np.array([1, 2, 3], "<i4"), mask=np.array([0, 1, 1], "u1"),
                versions=np.array([-1, 0, 0], "<i4"), logprobs=np.array([0, -1, -2], "<f4"))
    cases = [("tokens", np.array([1, -5, 3], "<i4"), "token id -5 at position 1 is negative"),
             ("tokens", np.array([1, 2, 900], "<i4"), "token id 900 at position 2 outside the vocabulary [0, 500)"),
             ("mask", np.array([0, 3, 1], "u1"), "mask must be 0 or 1"),
             ("versions", np.array([-1, -1, 0], "<i4"), "a generated token has no policy version"),
             ("logprobs", np.array([0, np.nan, -1], "<f4"), "logprobs must be finite and <= 0"),
             ("logprobs", np.array([0, -np.inf, -1], "<f4"), "logprobs must be finite and <= 0"),
             ("logprobs", np.array([0, 0.5, -1], "<f4"), "logprobs must be finite and <= 0")]
    for field, value, message in cases:
        with pytest.raises(InvalidTrajectory, match=message.replace("[", r"\[").replace(")", r"\)")):
            _traj(**{**base, field: value}).validate(500)


def test_decode_keeps_enum_types():
    """The wire form of outcome and fault comes back as the enums (set lookups, not tuple scans, now)."""
    tr = _traj(np.array([1, 2], "<i4"), np.array([0, 1], "u1"), np.array([-1, 0], "<i4"), np.array([0, -1], "<f4"))
    back = Trajectory.decode(tr.encode())
    assert back.outcome is Outcome.TERMINATED and type(back.fault).__name__ == "Fault"
    d = tr.to_dict()
    d["outcome"] = "exploded"
    with pytest.raises(InvalidTrajectory, match="outcome 'exploded'"):
        Trajectory.from_dict(d)

"""Trajectories on disk, and the data flywheel's split into an SFT set and a CT (continued-training) set.

A trajectory file is the learner's write-ahead-log format (core/stream/wal.py): crc-checked records of the exact
Trajectory.encode() bytes, keyed by id. The learner's stream.wal is one (until compacted), and with
learner.archive=true the learner appends every trajectory it receives to run_dir/trajectories.twl.

The split (UI-TARS-2's data flywheel): trajectories that pass validation go to the SFT set, the rest to the CT set.
Validation: the episode terminated (not truncated) with success, or, given min_return, its return is at least that.
infra_error episodes say nothing about the policy (the environment broke), so they go to neither set; they are
counted.
"""
from __future__ import annotations

import json
import logging
import os
import pathlib
from collections.abc import Iterator
from dataclasses import dataclass

from core.outcome import Outcome
from core.schema import SchemaError, Trajectory
from core.stream.wal import WriteAheadLog, scan, tail_kind

log = logging.getLogger(__name__)


class TrajectoryFileError(ValueError):
    """A trajectory file that cannot be read whole: not a trajectory log, or damaged at a byte offset."""


def read_trajectories(paths) -> Iterator[Trajectory]:
    """Every valid trajectory in these files, first occurrence of each id only, in file order.

    Read-only: an input is never modified (the learner may be appending to it). A file whose records stop before
    its end is an error naming the file and the offset (TrajectoryFileError), unless what follows is an append not
    yet finished (a live learner's uncommitted tail or the zero padding of its log writer's last block, or an
    append a crash cut short: never acked): those records are left out with a warning that gives the count read."""
    seen: set[str] = set()
    for p in paths:
        if not os.path.isfile(p):
            raise FileNotFoundError(f"trajectory file {p} does not exist")
        with open(p, "rb") as f:
            fd = f.fileno()
            size = os.fstat(fd).st_size
            read = lambda n, off: os.pread(fd, n, off)  # noqa: E731
            records, good = scan(read, size)
            if good < size:
                kind = tail_kind(read, size, good)
                if kind == "corrupt" and not records and good == 0:
                    raise TrajectoryFileError(f"{p} is not a trajectory file (no trajectory-log record at its start)")
                if kind == "corrupt":
                    raise TrajectoryFileError(
                        f"{p} is damaged at byte offset {good} of {size}: {len(records)} valid record(s) before it, "
                        f"{size - good} byte(s) from there on that do not check out (the file is left as it is)")
                log.warning("%s: %d record(s) read; the %d byte(s) from offset %d are an append not yet finished "
                            "(a live learner's uncommitted tail or its log writer's block padding, or an append cut "
                            "short by a crash), left out",
                            p, len(records), size - good, good)
            for tid, off, n in records:
                if tid in seen:
                    continue
                seen.add(tid)
                try:
                    yield Trajectory.decode(read(n, off))
                except (SchemaError, ValueError) as e:
                    raise ValueError(f"{p}: trajectory {tid} does not decode: {e}") from None


def write_trajectories(path, trajs) -> int:
    """A new trajectory file (replaced if it exists, atomically); returns the number written."""
    path = pathlib.Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    wal = WriteAheadLog(tmp, fsync=True).open()
    n = 0
    try:
        for tr in trajs:
            wal.append(tr.id, tr.encode())
            n += 1
        wal.sync()
    finally:
        wal.close()
    os.replace(tmp, path)
    return n


def passes_validation(tr: Trajectory, min_return: float | None = None) -> bool:
    if tr.outcome == Outcome.INFRA_ERROR:
        return False
    if tr.outcome == Outcome.TERMINATED and tr.success:
        return True
    return min_return is not None and tr.ret >= min_return


def split(paths, out_dir, min_return: float | None = None) -> dict:
    """-> out_dir/sft.twl, out_dir/ct.twl and out_dir/split.json (the counts); returns the counts."""
    out = pathlib.Path(out_dir)
    sft, ct, infra = [], [], 0
    for tr in read_trajectories(paths):
        if tr.outcome == Outcome.INFRA_ERROR:
            infra += 1
        elif passes_validation(tr, min_return):
            sft.append(tr)
        else:
            ct.append(tr)
    out.mkdir(parents=True, exist_ok=True)  # after the inputs were read: a missing one leaves no empty directory
    counts = {"inputs": [str(p) for p in paths], "min_return": min_return,
              "sft": write_trajectories(out / "sft.twl", sft), "ct": write_trajectories(out / "ct.twl", ct),
              "infra_error_dropped": infra}
    (out / "split.json").write_text(json.dumps(counts, indent=2))
    return counts


@dataclass
class ExampleImages:
    """A vision-language example's images, as its trajectory carries them (core/schema.py): segment starts, the
    image bound to each framed run in token order, and the bytes by sha256. learner.sft binds them per segment.
    generated: the trajectory's own mask (every token the policy wrote, in the loss or not), which the binding
    needs to tell a vision token the policy sampled from an image run."""
    segments: list[int]
    image_refs: list[str]
    images: dict[str, bytes]
    generated: list[int] | None = None


def sft_examples(trajs) -> list[tuple]:
    """Trajectories -> (tokens, loss mask) pairs for train_sft: the loss on the policy's own tokens only, and not on
    an answer that did not parse (a turn with parse_error: imitating it would teach the invalid format, even in an
    episode that went on to succeed). A vision-language trajectory (segments / image_refs) gives (tokens, loss
    mask, ExampleImages)."""
    out = []
    for tr in trajs:
        loss = tr.mask.astype(int)
        for t in tr.turns:
            if t.parse_error:
                loss[t.start:t.end] = 0
        if loss.sum() == 0:
            continue  # nothing generated (or nothing valid): nothing to imitate
        ex = (tr.tokens.astype(int).tolist(), loss.tolist())
        if tr.segments or tr.image_refs:
            ex += (ExampleImages(list(tr.segments), list(tr.image_refs), dict(tr.images), tr.mask.astype(int).tolist()),)
        out.append(ex)
    return out

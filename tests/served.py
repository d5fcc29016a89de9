"""`tars serve` as its own process for tests, through the launcher the benchmarks and `tars up` use
(tars.topology.daemon_spec + Process: its own session, a ready file, SIGTERM then SIGKILL of its group)."""
from __future__ import annotations

import contextlib
import os
import pathlib

from tars.topology import LaunchError, Process, daemon_spec, pythonpath

ROOT = pathlib.Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def served(workdir: str | os.PathLike, *options: str, ready_s: float = 120.0):
    """`tars serve OPTIONS --ready-file WORKDIR/inference.json`, its output in WORKDIR/inference.log; yields its
    address and stops it on exit. A server that exits or is not ready within ready_s fails with its log's tail."""
    spec = daemon_spec("inference", list(options), pathlib.Path(workdir), {"PYTHONPATH": pythonpath(ROOT)}, ROOT)
    p = Process(spec)
    try:
        try:
            info = p.wait_ready(ready_s)
        except LaunchError as e:
            raise AssertionError(f"{e}\n{spec.log.read_text()[-3000:]}") from None
        yield info["address"]
    finally:
        p.stop()

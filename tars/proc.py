"""Process conventions shared by the roles: ready files, signals, parent-death."""
from __future__ import annotations

import ctypes
import json
import os
import pathlib
import signal


def write_ready(path: str | os.PathLike | None, info: dict) -> None:
    """Announce a started server: atomically write {role, address, pid, ...} as JSON to `path` (if given)."""
    if not path:
        return
    p = pathlib.Path(path)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), **info}))
    os.replace(tmp, p)


def die_with_parent() -> None:
    """Linux: get SIGTERM when the parent dies, so a killed `tars up` leaves no orphans."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass

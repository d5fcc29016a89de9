"""The learner's ControlService (`tars ctl`): status, `set_eta`, `checkpoint`, `stop`.

It runs its own asyncio loop on a thread beside the (blocking) training loop and binds loopback only; every call
needs `control.auth_token` when one is set. Commands only set flags or the staleness bound: the training loop acts
on them between updates.
"""
from __future__ import annotations

import asyncio
import threading
from typing import Callable

from core import rpc
from core.control import ControlServicer, add_control

CONTROL_HOST = "127.0.0.1"  # loopback only: `tars ctl` runs on the learner's machine (or through a tunnel)
START_TIMEOUT_S = 10.0
STOP_POLL_S = 0.2


def learner_control(status: Callable[[], dict], version: Callable[[], int], staleness,
                    checkpoint_requested: threading.Event, last_checkpoint: Callable[[], dict],
                    stop: threading.Event) -> ControlServicer:
    c = ControlServicer("learner", status, version)
    c.on("set_eta", lambda a: (staleness.set_eta(int(a["eta"])), {"eta": int(a["eta"])})[1])
    c.on("checkpoint", lambda a: (checkpoint_requested.set(), {
        "requested": True, "version": version(), "last_checkpoint": last_checkpoint(),
        "when": "after the update in progress, or within 0.5 s if none is"})[1])
    c.on("stop", lambda a: (stop.set(), {"stopping": True})[1])
    return c


def serve_control(servicer: ControlServicer, auth_token: str, stop: threading.Event, ready: dict,
                  port: int = 0) -> threading.Thread:
    """Serve `servicer` on CONTROL_HOST:port until `stop` is set; ready["control"] = its address once it listens."""
    started = threading.Event()

    def run():
        async def main():
            server = rpc.make_server(auth_token=auth_token)
            add_control(server, servicer)
            ready["control"] = f"{CONTROL_HOST}:{rpc.bind(server, CONTROL_HOST, port)}"
            await server.start()
            started.set()
            while not stop.is_set():
                await asyncio.sleep(STOP_POLL_S)
            await server.stop(0.5)

        asyncio.run(main())

    t = threading.Thread(target=run, name="learner-control", daemon=True)
    t.start()
    if not started.wait(START_TIMEOUT_S):
        raise TimeoutError("learner control server did not start")
    return t

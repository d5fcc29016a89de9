"""Per-run tokens for the processes a launcher starts (`tars up`, `tars eval`, the fault and soak benchmarks).

tars.topology.plan() calls issue() for every run: each empty token gets a fresh secrets.token_urlsafe value, one
per service the run starts (envd.auth_token, inference.auth_token), a separate control.auth_token for every
process's ControlService and a telemetry.prometheus_token for every role's /metrics (a scrape sends it as a bearer
token), and the config is saved again as the run's config.yaml, mode 0600. The roles read their tokens from that
file (`--config`), never from their command line (which any local user can read in /proc/PID/cmdline); `tars ctl`
reads control.auth_token from it too. Tokens the user set (directly or through an
`*_file` setting) are kept.

A run that starts the learner also gets a CURVE keypair for its trajectory stream (learner.stream.curve_*), when
libzmq has CURVE and the user set no key: the stream is then encrypted, and a local process that cannot read the
run's config.yaml (another user) does not get past the handshake, so it cannot send the learner trajectories. Its
actors then share a client keypair too (actor.stream_curve_*), the only key on the learner's allowlist
(learner.stream.curve_client_keys), unless the user set an actor keypair or an allowlist.
"""
from __future__ import annotations

import os
import pathlib
import secrets

TOKEN_BYTES = 32


def new_token() -> str:
    return secrets.token_urlsafe(TOKEN_BYTES)


def issue(cfg, config_path: str | os.PathLike, *, envd: bool = True, inference: bool = True,
          learner: bool = False) -> dict[str, bool]:
    """Fill the empty tokens of `cfg` (in place) for a run that starts envd / the inference server / the learner, and
    save it to `config_path` readable by its owner only. Returns {setting: whether this call made it}."""
    import zmq

    from core import config as C

    made = {}
    for setting, section, wanted in (("envd.auth_token", cfg.envd, envd),
                                     ("inference.auth_token", cfg.inference, inference),
                                     ("control.auth_token", cfg.control, True)):
        made[setting] = wanted and not section.auth_token
        if made[setting]:
            section.auth_token = new_token()
    t = cfg.telemetry  # every role's /metrics: a scrape needs it as a bearer token (core.metrics_http)
    made["telemetry.prometheus_token"] = not t.prometheus_token
    if made["telemetry.prometheus_token"]:
        t.prometheus_token = new_token()
    stream = cfg.learner.stream
    made["learner.stream.curve"] = (learner and zmq.has("curve") and not stream.curve_secret_key
                                    and not stream.curve_public_key)
    if made["learner.stream.curve"]:
        public, secret = zmq.curve_keypair()
        stream.curve_public_key, stream.curve_secret_key = public.decode(), secret.decode()
    a = cfg.actor  # the actors' keypair and the learner's allowlist of it (ZAP: core/stream/curve.py)
    made["learner.stream.curve_client_keys"] = (learner and bool(stream.curve_secret_key) and zmq.has("curve")
                                                and not stream.curve_client_keys and not a.stream_curve_secret_key)
    if made["learner.stream.curve_client_keys"]:
        public, secret = zmq.curve_keypair()
        a.stream_curve_public_key, a.stream_curve_secret_key = public.decode(), secret.decode()
        stream.curve_client_keys = a.stream_curve_public_key
    C.validate(cfg)
    C.save(cfg, pathlib.Path(config_path))
    return made

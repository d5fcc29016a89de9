"""telemetry.prometheus_token: a process's /metrics behind a bearer token (what Prometheus sends with its scrape
config's `authorization`), required off loopback unless telemetry.prometheus_allow_no_token, issued by `tars up`."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from core import config as C
from core import metrics_http, telemetry
from core.config import ConfigError, TelemetryConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKEN = "metrics-test-token-0123456789"


@pytest.fixture(autouse=True)
def _shutdown():
    yield
    telemetry.shutdown()


def _get(address: str, auth: str | None) -> tuple[int, dict, str]:
    """(status, headers, body) of GET /metrics with this Authorization header (None: no header)."""
    req = urllib.request.Request(f"http://{address}/metrics", headers={} if auth is None else {"Authorization": auth})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, dict(e.headers), e.read().decode()


def test_a_scrape_without_the_token_gets_401_and_no_metrics():
    calls = []

    def collect():
        calls.append(1)
        return None

    srv = metrics_http.MetricsServer(collect, "127.0.0.1", 0, token=TOKEN)
    try:
        for auth in (None, "", f"Bearer {TOKEN}x", f"Bearer {TOKEN[:-1]}", "Bearer", f"Basic {TOKEN}", TOKEN,
                     f"Token {TOKEN}", "Bearer wrong"):
            status, headers, body = _get(srv.address, auth)
            assert status == 401, auth
            assert headers["WWW-Authenticate"].startswith('Bearer realm="tars metrics"'), headers
            assert ('error="invalid_token"' in headers["WWW-Authenticate"]) == bool(auth), (auth, headers)
            assert body == "" and TOKEN not in str(headers)
        assert calls == []  # refused before the exposition was computed
        for auth in (f"Bearer {TOKEN}", f"bearer {TOKEN}"):  # the scheme is case-insensitive (RFC 7235)
            status, headers, body = _get(srv.address, auth)
            assert status == 200 and headers["Content-Type"].startswith("text/plain"), (auth, status)
            assert TOKEN not in body
        assert len(calls) == 2
    finally:
        srv.close()


def test_the_connection_bounds_hold_with_a_token(monkeypatch):
    """The slot limit and the per-connection deadline stay: a trickling client (it never sends a whole request, so
    it never reaches the token check) is cut at its deadline, refused scrapes free their slot, and the token's
    scrape then gets through the one slot."""
    import socket
    import threading

    from core.proc import wait_for

    monkeypatch.setattr(metrics_http, "MAX_CONNS", 1, raising=False)
    monkeypatch.setattr(metrics_http, "CONN_DEADLINE_S", 1.0, raising=False)
    srv = metrics_http.MetricsServer(lambda: None, "127.0.0.1", 0, token=TOKEN)
    host, port = srv.address.rsplit(":", 1)
    c = socket.create_connection((host, int(port)), timeout=5)
    stop = threading.Event()

    def trickle():
        c.sendall(b"GET /metrics HTTP/1.1\r\nX-Slow: ")
        while not stop.wait(0.2):
            try:
                c.sendall(b"a")
            except OSError:
                return
    t = threading.Thread(target=trickle, daemon=True)
    try:
        t.start()
        c.settimeout(15.0)
        try:
            assert c.recv(1) == b""  # cut by the server
        except ConnectionResetError:
            pass

        def got(auth):
            try:
                return _get(srv.address, auth)[0]
            except (ConnectionError, urllib.error.URLError):
                return None  # the slot still held by the thread being cut: closed at once
        wait_for(lambda: got(None) == 401, 10, "a refused scrape after the trickling client was cut", every=0.05)
        for _ in range(10):
            wait_for(lambda: got("Bearer nope") == 401, 10, "a refused scrape", every=0.05)
        wait_for(lambda: got(f"Bearer {TOKEN}") == 200, 10, "the token's scrape", every=0.05)
    finally:
        stop.set()
        t.join(5.0)
        c.close()
        srv.close()


def test_telemetry_setup_serves_the_exposition_to_the_token_only(tmp_path, caplog):
    (tmp_path / "metrics-token").write_text(TOKEN + "\n")
    (tmp_path / "metrics-token").chmod(0o600)
    cfg = C.load(None, None, ["telemetry.prometheus_port=0", f"telemetry.prometheus_token_file={tmp_path / 'metrics-token'}"])
    assert cfg.telemetry.prometheus_token == TOKEN
    got = telemetry.setup(cfg.telemetry, "envd")
    telemetry.counter("tars.test.auth", description="a counter").add(2)
    assert _get(got["metrics"], None)[0] == 401
    status, _, body = _get(got["metrics"], f"Bearer {TOKEN}")
    fams = {f.name: f for f in text_string_to_metric_families(body)}
    assert status == 200 and fams["tars_test_auth"].samples[0].value == 2.0
    assert TOKEN not in body and TOKEN not in caplog.text


def test_no_token_on_loopback_is_unchanged():
    got = telemetry.setup(TelemetryConfig(prometheus_port=0), "envd")
    assert _get(got["metrics"], None)[0] == 200


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.0.0.11"])
def test_a_non_loopback_bind_needs_a_token_or_the_explicit_opt_out(host):
    with pytest.raises(ConfigError, match=r"/metrics.*not a loopback address.*telemetry.prometheus_token.*"
                                          r"prometheus_allow_no_token=true"):
        telemetry.setup(TelemetryConfig(prometheus_port=0, prometheus_host=host), "learner")
    assert telemetry.S.http is None and not telemetry.S.metrics  # nothing left half set up


def test_the_opt_out_serves_without_a_token_and_a_token_wins():
    got = telemetry.setup(TelemetryConfig(prometheus_port=0, prometheus_host="0.0.0.0",
                                          prometheus_allow_no_token=True), "envd")
    port = got["metrics"].rsplit(":", 1)[1]
    assert _get(f"127.0.0.1:{port}", None)[0] == 200
    got = telemetry.setup(TelemetryConfig(prometheus_port=0, prometheus_host="0.0.0.0", prometheus_token=TOKEN,
                                          prometheus_allow_no_token=True), "envd")
    port = got["metrics"].rsplit(":", 1)[1]
    assert _get(f"127.0.0.1:{port}", None)[0] == 401 and _get(f"127.0.0.1:{port}", f"Bearer {TOKEN}")[0] == 200


def test_a_token_an_http_header_cannot_carry_is_a_config_error():
    with pytest.raises(ConfigError, match="telemetry.prometheus_token: a token must be visible ASCII"):
        C.load(None, None, ["telemetry.prometheus_token=caf\u00e9"])


def test_a_role_refuses_a_public_metrics_bind_without_a_token(tmp_path):
    """A real envd process (its gRPC on loopback): /metrics on 0.0.0.0 without a token stops it with exit 2 and one
    line, before it announces itself."""
    ready = tmp_path / "envd.json"
    argv = [sys.executable, "-m", "tars.cli", "envd", "--port", "0", "--ready-file", str(ready),
            "--set", "telemetry.prometheus_port=0", "--set", "telemetry.prometheus_host=0.0.0.0"]
    env = {**os.environ, "PYTHONPATH": ROOT, "OTEL_TRACES_EXPORTER": "none"}
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    assert r.returncode == 2 and "config error" in r.stderr and "telemetry.prometheus_token" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and not ready.exists()


def test_tars_config_masks_the_metrics_token(capsys):
    from tars import cli

    assert cli.main(["config", "--set", f"telemetry.prometheus_token={TOKEN}"]) == 0
    out = capsys.readouterr().out
    assert TOKEN not in out and '"prometheus_token": "<set>"' in out


def test_a_run_placed_as_tars_up_places_it_scrapes_with_its_token(tmp_path):
    """tars.topology.plan() (what `tars up` runs) issues a per-run metrics token into the 0600 config.yaml; a real
    envd it starts serves /metrics to that token only, and the token is on no command line and in no log."""
    from tars.topology import Topology, plan

    out = tmp_path / "run"
    out.mkdir()
    cfg = C.load("quickstart", None, ["telemetry.prometheus_port=0"])
    assert not cfg.telemetry.prometheus_token
    C.save(cfg, out / "config.yaml")
    with Topology(plan(cfg, out, None, inference=False, learner=False, n_actors=0)) as topo:
        token = cfg.telemetry.prometheus_token
        assert len(token) >= 32 and token not in (cfg.control.auth_token, cfg.envd.auth_token)
        assert C.load(None, str(out / "config.yaml")).telemetry.prometheus_token == token
        topo.launch("envd")
        info = topo.await_ready("envd", 0, timeout=120)
        status, headers, body = _get(info["metrics"], None)
        assert status == 401 and body == "" and "Bearer" in headers["WWW-Authenticate"]
        assert _get(info["metrics"], f"Bearer {cfg.control.auth_token}")[0] == 401  # another token of the run
        status, _, body = _get(info["metrics"], f"Bearer {token}")
        assert status == 200 and 'role="envd"' in body and token not in body
        spec = topo.spec("envd", 0)
        assert not any(token in a for a in spec.argv)
        pid = topo.procs[("envd", 0)].pid
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            assert token.encode() not in f.read()
    log = (out / "logs" / "envd.log").read_text()
    assert log and token not in log
    assert token not in json.dumps(info)

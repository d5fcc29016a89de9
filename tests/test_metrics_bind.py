"""telemetry.prometheus_host: where a process's /metrics listener binds (127.0.0.1 unless set), scraped for real;
a bind that cannot work is a config error (exit 2) of the role, not a traceback."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from core import config as C
from core import telemetry
from core.config import ConfigError, TelemetryConfig
from test_sglang_pool import _free_port_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _shutdown():
    yield
    telemetry.shutdown()


def _scrape(url: str, token: str = "") -> set[str]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200
        return {f.name for f in text_string_to_metric_families(r.read().decode())}


def _count_something():
    telemetry.counter("tars.test.bind", description="a counter for the bind test").add(1)


def _private_ipv4() -> str | None:
    """An address of this machine that is not loopback (the one a default route would use), if there is one."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: nothing is sent (UDP connect only picks a source address)
            ip = s.getsockname()[0]
    except OSError:
        return None
    return None if ip.startswith("127.") or ip == "0.0.0.0" else ip


def test_default_binds_loopback_only():
    assert TelemetryConfig().prometheus_host == "127.0.0.1"
    got = telemetry.setup(TelemetryConfig(prometheus_port=0), "envd")
    assert telemetry.S.http.httpd.server_address[0] == "127.0.0.1" and got["metrics"].startswith("127.0.0.1:")
    ip = _private_ipv4()
    if ip is not None:  # not reachable on the machine's other address
        port = telemetry.S.http.httpd.server_address[1]
        with pytest.raises(OSError):
            socket.create_connection((ip, port), timeout=2).close()


def test_prometheus_host_binds_all_addresses_and_is_scraped():
    """prometheus_host=0.0.0.0 (what a pod needs, with its token): the listener is on every address, scraped on
    loopback and on the machine's own non-loopback address."""
    cfg = C.load(None, None, ["telemetry.prometheus_host=0.0.0.0", "telemetry.prometheus_port=0",
                              "telemetry.prometheus_token=bind-test-token"]).telemetry
    got = telemetry.setup(cfg, "envd")
    _count_something()
    host, port = telemetry.S.http.httpd.server_address[:2]
    assert host == "0.0.0.0" and got["metrics"] == f"0.0.0.0:{port}"
    assert "tars_test_bind" in _scrape(f"http://127.0.0.1:{port}/metrics", "bind-test-token")
    ip = _private_ipv4()
    if ip is not None:
        assert "tars_test_bind" in _scrape(f"http://{ip}:{port}/metrics", "bind-test-token")


def test_prometheus_host_ipv6_loopback():
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    try:
        socket.socket(socket.AF_INET6, socket.SOCK_STREAM).bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    got = telemetry.setup(TelemetryConfig(prometheus_port=0, prometheus_host="::1"), "learner")
    _count_something()
    port = telemetry.S.http.httpd.server_address[1]
    assert got["metrics"] == f"[::1]:{port}"  # an address a client can use as host:port
    assert "tars_test_bind" in _scrape(f"http://[::1]:{port}/metrics")


def test_accelerate_ranks_get_a_port_each(monkeypatch):
    """Under `accelerate launch` every rank reads the same config: LOCAL_RANK n > 0 serves PORT + n."""
    base = _free_port_run(4)  # base and base + 3 both free (base + 3 was never checked), below the ephemeral range
    monkeypatch.setenv("LOCAL_RANK", "3")
    got = telemetry.setup(TelemetryConfig(prometheus_port=base), "learner")
    assert got["metrics"] == f"127.0.0.1:{base + 3}"
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert telemetry.setup(TelemetryConfig(prometheus_port=base), "learner")["metrics"] == f"127.0.0.1:{base}"
    monkeypatch.setenv("LOCAL_RANK", "2")  # port 0 stays "any free port"
    assert telemetry.setup(TelemetryConfig(prometheus_port=0), "learner")["metrics"] != "127.0.0.1:2"


@pytest.mark.parametrize("sets,msg", [
    (["telemetry.prometheus_port=70000"], "telemetry.prometheus_port=70000"),
    (["telemetry.prometheus_port=-2"], "telemetry.prometheus_port=-2"),
    (["telemetry.prometheus_port=9464", "telemetry.prometheus_host="], "telemetry.prometheus_host is empty"),
])
def test_bad_metrics_settings_are_config_errors(sets, msg):
    with pytest.raises(ConfigError, match=msg):
        C.load(None, None, sets)


def _envd(*sets: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "tars.cli", "envd", "--port", "0"]
    for s in sets:
        argv += ["--set", s]
    env = {**os.environ, "PYTHONPATH": ROOT, "OTEL_TRACES_EXPORTER": "none"}
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)


def test_role_with_unusable_metrics_address_exits_with_a_config_error():
    """A real envd process: a taken port, or an address that is not this machine's, stops it with exit 2 and one
    line naming the setting (not a traceback)."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = _envd(f"telemetry.prometheus_port={port}")
    assert r.returncode == 2, r.stderr[-2000:]
    assert "telemetry.prometheus_host='127.0.0.1'" in r.stderr and f"prometheus_port={port}" in r.stderr
    assert "Traceback" not in r.stderr
    r = _envd("telemetry.prometheus_port=0", "telemetry.prometheus_host=192.0.2.77",  # TEST-NET-1: not ours
              "telemetry.prometheus_token=t")
    assert r.returncode == 2 and "cannot serve /metrics" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]

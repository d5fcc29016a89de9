"""Operational bounds: telemetry.shutdown() with a hung or absent OTLP collector, idle /metrics connections, the
learner.step link limit, telemetry config errors as one line."""
import http.client
import json
import os
import pathlib
import socket
import threading
import time
import urllib.request

import pytest

from core import telemetry
from core.proc import wait_for
from core.config import ConfigError, TelemetryConfig


@pytest.fixture(autouse=True)
def _reset():
    yield
    telemetry.shutdown()


@pytest.mark.parametrize("kind,mode", [("otlp-http", "hung"), ("otlp-grpc", "hung"), ("otlp-grpc", "down")])
def test_shutdown_is_bounded_when_the_collector_hangs_or_is_down(kind, mode, caplog):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    if mode == "hung":
        s.listen(64)  # accepts (backlog), never answers
    else:
        s.close()
    try:
        telemetry.setup(TelemetryConfig(enabled=True, exporter=kind, otlp_endpoint=f"http://127.0.0.1:{port}",
                                        sample_ratio=1.0), "actor")
        for _ in range(3000):
            with telemetry.span("episode"):
                pass
        t0 = time.monotonic()
        with caplog.at_level("WARNING", logger="core.telemetry"):
            telemetry.shutdown()  # every role's exit path: bounded by telemetry.SHUTDOWN_S (3 s), not 30 s
        took = time.monotonic() - t0
    finally:
        s.close()
    assert took < 15.0, f"shutdown took {took:.1f}s"  # SHUTDOWN_S (3 s) with room for a slow host; was 30 s
    if mode == "hung":
        assert "queued spans dropped" in caplog.text
    assert not telemetry.S.tracing


def test_idle_metrics_connections_time_out_and_are_bounded(monkeypatch):
    from core import metrics_http

    monkeypatch.setattr(metrics_http, "CONN_TIMEOUT_S", 0.5, raising=False)
    monkeypatch.setattr(metrics_http, "MAX_CONNS", 4, raising=False)
    srv = metrics_http.MetricsServer(lambda: None, "127.0.0.1", 0)
    socks = []
    try:
        base = threading.active_count()
        host, port = srv.address.rsplit(":", 1)
        for _ in range(20):  # half-sent requests, never finished
            c = socket.create_connection((host, int(port)), timeout=5)
            c.sendall(b"GET /metrics HTTP/1.1\r\n")
            socks.append(c)
        assert threading.active_count() <= base + 4 + 1
        for c in socks:  # every one is accepted and closed by the server: refused at once, or timed out when idle
            c.settimeout(10.0)
            try:
                assert c.recv(1) == b""
            except ConnectionResetError:
                pass  # refused with its request unread: closed by a reset
        wait_for(lambda: threading.active_count() <= base, 10.0, "the idle connections' threads to end", every=0.05)
        with urllib.request.urlopen(f"http://{srv.address}/metrics", timeout=5) as r:
            assert r.status == 200
    finally:
        for c in socks:
            c.close()
        srv.close()


def test_learner_step_links_every_sampled_episode_of_a_large_batch(tmp_path):
    telemetry.setup(TelemetryConfig(exporter="file", dir=str(tmp_path), sample_ratio=1.0), "learner")
    tps = []
    for _ in range(300):  # > the SDK's default limit of 128 links per span
        with telemetry.span("episode"):
            tps.append(telemetry.traceparent())
    unsampled = tps[0][:-2] + "00"  # an episode that was not sampled: no span to link to
    links, unlinked = telemetry.links_from([*tps, unsampled, ""])
    assert len(links) == 300 and unlinked == 0
    with telemetry.span("learner.step", links=links):
        pass
    telemetry.shutdown()
    spans = [json.loads(line) for f in tmp_path.glob("*.jsonl") for line in open(f)]
    step = next(s for s in spans if s["name"] == "learner.step")
    assert len(step["links"]) == 300
    assert {lk["span_id"] for lk in step["links"]} == {s["span_id"] for s in spans if s["name"] == "episode"}
    many = [tps[0]] * (telemetry.MAX_LINKS + 7)
    assert [len(x) if isinstance(x, list) else x for x in telemetry.links_from(many)] == [telemetry.MAX_LINKS, 7]


def test_a_small_span_queue_is_accepted(tmp_path):
    """telemetry.max_queued_spans below the SDK's batch size (512): the batch size follows it."""
    telemetry.setup(TelemetryConfig(exporter="file", dir=str(tmp_path), sample_ratio=1.0, max_queued_spans=100),
                    "envd")
    for _ in range(50):
        with telemetry.span("envd.step"):
            pass
    telemetry.shutdown()
    assert sum(1 for f in tmp_path.glob("*.jsonl") for _ in open(f)) == 50


@pytest.mark.parametrize("env,cfg,match", [
    ({"OTEL_EXPORTER_OTLP_TIMEOUT": "abc"}, {"exporter": "otlp-grpc"}, "otlp-grpc exporter.*'abc'"),
    ({"OTEL_EXPORTER_OTLP_COMPRESSION": "zstd"}, {"exporter": "otlp-grpc"}, "zstd"),
    ({}, {"exporter": "file", "dir": "/proc/no-such-dir/x"}, "telemetry.dir='/proc/no-such-dir/x': cannot write"),
])
def test_telemetry_setup_errors_are_config_errors(monkeypatch, env, cfg, match):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ConfigError, match=match):
        telemetry.setup(TelemetryConfig(**cfg), "envd")
    assert not telemetry.S.tracing


@pytest.mark.parametrize("limit", [None, 100])
def test_a_mebibyte_attribute_is_exported_truncated(tmp_path, limit, caplog):
    """A caller-sent string (a trajectory id of 1 MiB) on a span, through set_attrs, on a batch request's server span
    and on an event is exported cut to telemetry.max_attribute_length (4096 by default), with one warning."""
    cfg = TelemetryConfig(exporter="file", dir=str(tmp_path), sample_ratio=1.0)
    if limit is not None:
        cfg.max_attribute_length = limit
    big = "x" * (1 << 20)
    with caplog.at_level("WARNING"):
        telemetry.setup(cfg, "inference")
        with telemetry.span("episode", attributes={"tars.trajectory_id": big}) as sp:
            telemetry.set_attrs(sp, **{"tars.other": big, "tars.ids": [big, "short"]})
            sp.add_event("e", {"tars.trajectory_id": big})
            srv = telemetry.start_server_span("inference.generate", telemetry.traceparent(),
                                              attributes={"tars.trajectory_id": big})
            srv.end()
        telemetry.shutdown()
    rows = {r["name"]: r for f in tmp_path.glob("*.jsonl") for r in map(json.loads, open(f))}
    n = limit or 4096
    ep, gen = rows["episode"], rows["inference.generate"]
    assert ep["attributes"] == {"tars.trajectory_id": "x" * n, "tars.other": "x" * n, "tars.ids": ["x" * n, "short"]}
    assert ep["events"][0]["attributes"] == {"tars.trajectory_id": "x" * n}
    assert gen["attributes"] == {"tars.trajectory_id": "x" * n}
    assert sum(f.stat().st_size for f in tmp_path.glob("*.jsonl")) < 10 * n + 10_000
    assert caplog.text.count("exceeds max length") <= 1


def test_span_file_cap_drops_are_logged_once_and_counted_in_metrics(tmp_path, caplog):
    from prometheus_client.parser import text_string_to_metric_families

    cfg = TelemetryConfig(exporter="file", dir=str(tmp_path), sample_ratio=1.0, max_file_mb=0.002,
                          prometheus_port=0)
    with caplog.at_level("WARNING", logger="core.telemetry"):
        info = telemetry.setup(cfg, "envd")
        for _ in range(60):
            with telemetry.span("envd.step", attributes={"pad": "x" * 100}):
                pass
        assert telemetry.force_flush(5.0)
    assert caplog.text.count("reached its cap") == 1
    with urllib.request.urlopen(f"http://{info['metrics']}/metrics", timeout=5) as r:
        fams = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
    dropped = fams["tars_telemetry_spans_dropped"].samples[0].value
    assert dropped > 0 and dropped + sum(1 for _ in open(telemetry.S.span_file)) == 60


def test_a_trickling_metrics_client_is_cut_at_its_deadline(monkeypatch):
    """Slowloris: the per-read timeout never fires for a client that sends a byte now and then, so MAX_CONNS of them
    held every slot for ever and no scrape got through. Each connection now has a deadline."""
    from core import metrics_http

    monkeypatch.setattr(metrics_http, "CONN_TIMEOUT_S", 1.0, raising=False)
    monkeypatch.setattr(metrics_http, "MAX_CONNS", 1, raising=False)
    monkeypatch.setattr(metrics_http, "CONN_DEADLINE_S", 1.0, raising=False)
    srv = metrics_http.MetricsServer(lambda: None, "127.0.0.1", 0)
    host, port = srv.address.rsplit(":", 1)
    c = socket.create_connection((host, int(port)), timeout=5)
    stop = threading.Event()

    def trickle():  # one byte of a never-ending header every 0.2 s: each read finishes well within CONN_TIMEOUT_S
        c.sendall(b"GET /metrics HTTP/1.1\r\nX-Slow: ")
        while not stop.wait(0.2):
            try:
                c.sendall(b"a")
            except OSError:
                return  # cut
    t = threading.Thread(target=trickle, daemon=True)
    try:
        t.start()
        c.settimeout(15.0)
        try:
            assert c.recv(1) == b""  # the server closed it
        except ConnectionResetError:
            pass
        # Its one slot is free again: once its handler thread has ended (the EOF above can come first, and a scrape
        # meanwhile finds the slot still held and is closed at once), a scrape gets through.
        def scraped() -> bool:
            try:
                with urllib.request.urlopen(f"http://{srv.address}/metrics", timeout=5) as r:
                    return r.status == 200
            except (http.client.RemoteDisconnected, ConnectionError):
                return False
        wait_for(scraped, 10, "a scrape after the trickling client was cut", every=0.05)
    finally:
        stop.set()
        t.join(5.0)
        c.close()
        srv.close()

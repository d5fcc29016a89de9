"""core.telemetry and core.metrics_http in one process: span files, OTLP/JSON export to a local receiver, traceparent
across a real gRPC hop into envd, the no-op path when off, the Prometheus endpoint scraped and parsed, and the
`tars ctl` argument and run-discovery rules."""
import asyncio
import json
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from core import metrics_http, rpc, telemetry

from tars import ctl
from core.config import EnvdConfig, TelemetryConfig


@pytest.fixture(autouse=True)
def _reset():
    yield
    telemetry.shutdown()


def spans_of(path) -> list[dict]:
    return [json.loads(line) for line in open(path)]


def test_span_file_has_one_json_object_per_span_with_parents_links_and_service(tmp_path):
    got = telemetry.setup(TelemetryConfig(sample_ratio=1.0), "actor", str(tmp_path))
    assert got["traces"].endswith(".jsonl") and got["metrics"] == "off"
    with telemetry.span("episode", attributes={"tars.trajectory_id": "t1"}) as ep:
        tp = telemetry.traceparent()
        with telemetry.client_span("generate") as g:
            telemetry.set_attrs(g, **{"tars.output_tokens": 3, "skipped": None})
    with telemetry.span("learner.step", links=[telemetry.link_from(tp), *filter(None, [telemetry.link_from("junk")])]):
        pass
    telemetry.shutdown()
    rows = {r["name"]: r for r in spans_of(got["traces"])}
    assert set(rows) == {"episode", "generate", "learner.step"}
    e, g, s = rows["episode"], rows["generate"], rows["learner.step"]
    assert tp.startswith(f"00-{e['trace_id']}-{e['span_id']}-") and int(tp[-2:], 16) & 1  # sampled flag
    assert g["trace_id"] == e["trace_id"] and g["parent_span_id"] == e["span_id"] and g["kind"] == "CLIENT"
    assert g["attributes"] == {"tars.output_tokens": 3}
    assert e["service"] == "actor" and e["pid"] == os.getpid() and e["parent_span_id"] is None
    assert e["attributes"]["tars.trajectory_id"] == "t1" and e["duration_ms"] >= g["duration_ms"]
    assert s["trace_id"] != e["trace_id"] and s["links"] == [{"trace_id": e["trace_id"], "span_id": e["span_id"], "attributes": {}}]


def test_span_file_stops_at_its_size_cap_and_counts_the_rest(tmp_path):
    exp = telemetry.JsonLinesSpanExporter(tmp_path / "s.jsonl", max_bytes=2000)
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(exp))
    tr = tp.get_tracer("t")
    for i in range(50):
        with tr.start_as_current_span(f"s{i}"):
            pass
    tp.shutdown()
    assert (tmp_path / "s.jsonl").stat().st_size <= 2000
    assert exp.written >= 1 and exp.dropped >= 1 and exp.written + exp.dropped == 50
    assert len(spans_of(tmp_path / "s.jsonl")) == exp.written


def test_sampling_keeps_a_share_of_episodes_and_every_learner_step(tmp_path):
    got = telemetry.setup(TelemetryConfig(sample_ratio=0.0), "learner", str(tmp_path))
    for _ in range(20):
        with telemetry.span("episode"):
            with telemetry.span("turn"):
                assert not int(telemetry.traceparent()[-2:], 16) & 1  # unsampled: the flag says so downstream
    with telemetry.span("learner.step"):
        pass
    telemetry.shutdown()
    assert [r["name"] for r in spans_of(got["traces"])] == ["learner.step"]


class _Receiver(BaseHTTPRequestHandler):
    bodies: list = []

    def do_POST(self):  # noqa: N802
        n = int(self.headers["Content-Length"])
        _Receiver.bodies.append((self.path, self.headers["Content-Type"], json.loads(self.rfile.read(n))))
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *a):
        pass


def test_otlp_http_json_export_posts_the_otlp_encoding(tmp_path):
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        got = telemetry.setup(TelemetryConfig(sample_ratio=1.0, otlp_endpoint=f"http://127.0.0.1:{srv.server_address[1]}"),
                              "envd", str(tmp_path))
        assert got["traces"].startswith("otlp http/json")
        with telemetry.span("episode", attributes={"n": 3, "x": 0.5, "ok": True, "s": "a"}) as ep:
            with telemetry.client_span("env.step"):
                pass
        telemetry.shutdown()
        path, ctype, body = _Receiver.bodies[-1]
        assert path == "/v1/traces" and ctype == "application/json"
        rs = body["resourceSpans"][0]
        assert {"key": "service.name", "value": {"stringValue": "envd"}} in rs["resource"]["attributes"]
        spans = {s["name"]: s for s in rs["scopeSpans"][0]["spans"]}
        e, c = spans["episode"], spans["env.step"]
        assert len(e["traceId"]) == 32 and len(e["spanId"]) == 16 and "parentSpanId" not in e
        assert c["parentSpanId"] == e["spanId"] and c["kind"] == 3 and e["kind"] == 1  # CLIENT, INTERNAL
        attrs = {a["key"]: a["value"] for a in e["attributes"]}
        assert attrs == {"n": {"intValue": "3"}, "x": {"doubleValue": 0.5}, "ok": {"boolValue": True}, "s": {"stringValue": "a"}}
        assert int(e["endTimeUnixNano"]) >= int(e["startTimeUnixNano"]) > 0
        assert not list(tmp_path.glob("telemetry/*"))  # OTLP instead of the file, not as well
    finally:
        srv.shutdown()
        srv.server_close()


def test_otlp_export_to_a_dead_endpoint_fails_within_its_deadline():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exp = telemetry.OtlpHttpJsonSpanExporter(f"http://127.0.0.1:{port}", timeout_s=2.0)
    from opentelemetry.sdk.trace import TracerProvider

    tr = TracerProvider().get_tracer("t")
    with tr.start_as_current_span("s") as sp:
        pass
    t0 = time.monotonic()
    assert exp.export([sp]) == telemetry.SpanExportResult.FAILURE and exp.failed == 1
    assert time.monotonic() - t0 < 10


def test_unknown_otlp_protocol_without_its_package_falls_back_to_the_file(tmp_path):
    got = telemetry.setup(TelemetryConfig(otlp_endpoint="http://127.0.0.1:9", otlp_protocol="grpc"), "actor", str(tmp_path))
    try:
        import opentelemetry.exporter.otlp.proto.grpc  # noqa: F401
        assert got["traces"].startswith("otlp grpc")
    except ImportError:
        assert got["traces"].endswith(".jsonl")


def test_off_costs_nothing_and_channels_get_no_interceptor(tmp_path):
    assert telemetry.setup(TelemetryConfig(enabled=False), "actor", str(tmp_path)) == {"traces": "off", "metrics": "off"}
    with telemetry.span("episode") as sp:
        assert not sp.is_recording() and telemetry.traceparent() == "" and telemetry.grpc_metadata() == []
    assert telemetry.histogram("x") is telemetry.NO_INSTRUMENT and telemetry.collect() is None
    assert telemetry.link_from("") is None

    async def plain_channel():
        ch = rpc.channel("127.0.0.1:1")  # aio channels need a running loop
        try:
            return getattr(ch, "_unary_unary_interceptors", None)
        finally:
            await ch.close()

    assert not asyncio.run(plain_channel())
    assert not (tmp_path / "telemetry").exists()
    # enabled, but neither a directory nor an endpoint: no spans either
    assert telemetry.setup(TelemetryConfig(), "actor", None)["traces"] == "off"


def test_traceparent_crosses_grpc_into_envd_server_spans(tmp_path):
    from actor.envclient import EnvClient
    from core.action import Action
    from envd.server import EnvServer

    got = telemetry.setup(TelemetryConfig(sample_ratio=1.0), "actor", str(tmp_path))

    async def main():
        srv = EnvServer(EnvdConfig(port=0))
        await srv.start()
        env = EnvClient(srv.address)
        try:
            with telemetry.span("episode"):
                with telemetry.client_span("env.create"):
                    sid, run_id = await env.create("builtin/mixed", 3, {})
                    await env.reset(sid, run_id, 3)
                with telemetry.client_span("env.step"):
                    await env.step(sid, run_id, Action("wait"))
            await env.step(sid, run_id, Action("wait"))  # outside any span: a root server span
        finally:
            await env.close()
            await srv.stop(0.5)

    asyncio.run(main())
    telemetry.shutdown()
    rows = spans_of(got["traces"])
    by = {}
    for r in rows:
        by.setdefault(r["name"], []).append(r)
    ep, client = by["episode"][0], by["env.step"][0]
    served = sorted(by["envd.step"], key=lambda r: r["start_ns"])
    assert served[0]["parent_span_id"] == client["span_id"] and served[0]["trace_id"] == ep["trace_id"]
    assert served[0]["kind"] == "SERVER" and "tars.step_ms" in served[0]["attributes"]
    assert served[1]["parent_span_id"] is None and served[1]["trace_id"] != ep["trace_id"]
    create = by["envd.create_session"][0]
    assert by["env.create"][0]["span_id"] == create["parent_span_id"] == by["envd.reset"][0]["parent_span_id"]


def test_prometheus_endpoint_serves_counters_gauges_and_histograms(tmp_path):
    got = telemetry.setup(TelemetryConfig(prometheus_port=0), "envd", str(tmp_path))
    host, port = got["metrics"].rsplit(":", 1)
    assert host == "127.0.0.1" and telemetry.info()["metrics"] == got["metrics"]
    c = telemetry.counter("tars.test.events", description='events "quoted"\nnew line')
    c.add(3, {"kind": "a"})
    c.add(2, {"kind": "b"})
    h = telemetry.histogram("tars.env.step.duration", "s", "step latency")
    for x in (0.0004, 0.003, 0.003, 20.0):
        h.record(x)
    depth = {"v": 7}
    telemetry.observe("tars.test.depth", lambda: depth["v"], description="a gauge")
    telemetry.observe("tars.test.by", lambda: {"x": 1, "y": 2}, kind="counter", label="reason")
    telemetry.observe("tars.test.broken", lambda: 1 / 0)  # a failing reading is skipped, not a failed scrape

    def scrape():
        with urllib.request.urlopen(f"http://{got['metrics']}/metrics", timeout=10) as r:
            return metrics_http.parse(r.read().decode())

    m = scrape()
    assert {(lab["kind"], v) for lab, v in m["tars_test_events_total"]} == {("a", 3.0), ("b", 2.0)}
    assert all(lab["role"] == "envd" for lab, _ in m["tars_test_events_total"])
    assert m["tars_test_depth"] == [({"role": "envd"}, 7.0)]
    assert {(lab["reason"], v) for lab, v in m["tars_test_by_total"]} == {("x", 1.0), ("y", 2.0)}
    assert "tars_test_broken" not in m
    b = {lab["le"]: v for lab, v in m["tars_env_step_duration_seconds_bucket"]}
    assert b["0.0005"] == 1 and b["0.005"] == 3 and b["10.0"] == 3 and b["+Inf"] == 4
    assert m["tars_env_step_duration_seconds_count"][0][1] == 4
    assert m["tars_env_step_duration_seconds_sum"][0][1] == pytest.approx(20.0064)
    depth["v"] = 9
    assert scrape()["tars_test_depth"][0][1] == 9.0
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"http://{got['metrics']}/other", timeout=10)
    assert e.value.code == 404
    telemetry.shutdown()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://{got['metrics']}/metrics", timeout=5)


def test_exposition_parser_rejects_garbage():
    with pytest.raises(ValueError):
        metrics_http.parse("not a metric line at all {")
    assert metrics_http.parse('# HELP x y\nx{a="1\\"2"} 3\n') == {"x": [({"a": '1"2'}, 3.0)]}


# ---- tars ctl: arguments and finding the run -------------------------------------------------------------------
@pytest.mark.parametrize("words,want", [
    (["status"], ("status", {})), (["set", "eta", "4"], ("set-eta", {"eta": "4"})), (["set-eta", "0"], ("set-eta", {"eta": "0"})),
    (["sessions"], ("sessions", {})), (["sessions", "list"], ("sessions", {})),
    (["sessions", "kill", "abc"], ("kill-session", {"id": "abc"})), (["kill-session", "abc"], ("kill-session", {"id": "abc"})),
])
def test_ctl_commands_parse(words, want):
    assert ctl.parse_command(words[0], words[1:]) == want


@pytest.mark.parametrize("words,msg", [
    (["set", "eta"], "usage: tars ctl set eta N"), (["set", "lr", "3"], "usage: tars ctl set eta N"),
    (["set-eta", "x"], "integer"), (["set-eta", "-2"], "integer >= 0"), (["sessions", "kill"], "usage"),
    (["pause", "now"], "takes no arguments"),
])
def test_ctl_bad_commands_say_why(words, msg):
    with pytest.raises(ctl.CtlError, match=msg):
        ctl.parse_command(words[0], words[1:])


def test_ctl_finds_the_run_env_then_cwd_then_last_run_file(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("TARS_RUN", raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ctl.CtlError, match="no run found"):
        ctl.find_run()
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        (d / "run").mkdir(parents=True)
        (d / "run" / "envd.json").write_text(json.dumps({"role": "envd", "address": "127.0.0.1:1", "pid": 0}))
    ctl.remember_run(a)
    assert ctl.find_run() == (str(a), str(tmp_path / "cache" / "tars" / "last-run"))
    monkeypatch.chdir(b)
    assert ctl.find_run()[0] == str(b)
    monkeypatch.setenv("TARS_RUN", str(a))
    assert ctl.find_run() == (str(a), "$TARS_RUN")
    assert ctl.targets_of_run(str(a)) == [{"role": "envd", "address": "127.0.0.1:1", "pid": 0, "file": "envd.json"}]
    with pytest.raises(ctl.CtlError, match="is .* the --out of a `tars up`"):
        ctl.targets_of_run(str(tmp_path / "nowhere"))


def test_ctl_against_a_target_that_is_down_fails_clearly(tmp_path, capsys):
    from tars import cli

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    assert cli.main(["ctl", "status", "--target", dead, "--timeout", "2", "--json"]) == 1
    r = json.loads(capsys.readouterr().out)
    assert r[0]["target"] == dead and r[0]["error"].startswith(f"DOWN: cannot reach {dead}")
    assert cli.main(["ctl", "drain", "--target", dead, "--timeout", "2"]) == 1
    out = capsys.readouterr().out
    assert "ERROR DOWN" in out and "no reachable envd among the targets for 'drain'" in out


def test_every_telemetry_field_has_help_and_tars_up_defaults_to_the_span_file():
    import dataclasses

    from core import config as C

    for f in dataclasses.fields(C.TelemetryConfig):
        assert f.metadata.get("help"), f"TelemetryConfig.{f.name} has no help"
    cfg = C.load("quickstart")
    assert cfg.telemetry.enabled and cfg.telemetry.prometheus_port == -1 and 0 < cfg.telemetry.sample_ratio <= 1
    assert "telemetry.prometheus_port" in C.help_text()

"""core.telemetry and core.metrics_http: span files, the official OTLP exporters (gRPC and HTTP/protobuf) received by
local OTLP receivers (in this process and from a real envd process), the standard OTEL_* variables, the console
exporter, traceparent across a real gRPC hop into envd, the no-op path when off, the Prometheus endpoint
(prometheus_client) scraped and parsed with prometheus_client's parser, and the `tars ctl` argument and
run-discovery rules."""
import asyncio
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from core import rpc, telemetry

from tars import ctl
from core.config import EnvdConfig, TelemetryConfig

ROOT = pathlib.Path(__file__).resolve().parent.parent


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


OTEL_VARS = [k for k in os.environ if k.startswith("OTEL_")]


@pytest.fixture(autouse=True)
def _no_otel_env(monkeypatch):
    for k in OTEL_VARS:  # the developer's own OTEL_* settings must not steer these tests
        monkeypatch.delenv(k, raising=False)


class _HttpReceiver(BaseHTTPRequestHandler):
    """OTLP/HTTP: POST /v1/traces with a protobuf ExportTraceServiceRequest."""
    got: list = []

    def do_POST(self):  # noqa: N802
        n = int(self.headers["Content-Length"])
        req = trace_service_pb2.ExportTraceServiceRequest.FromString(self.rfile.read(n))
        _HttpReceiver.got.append((self.path, self.headers["Content-Type"], dict(self.headers), req))
        body = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


class _GrpcReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """OTLP/gRPC: the collector's TraceService, from opentelemetry-proto's generated classes."""

    def __init__(self):
        self.got: list = []
        self.metadata: list = []
        self.cv = threading.Condition()

    def Export(self, request, context):  # noqa: N802
        with self.cv:
            self.got.append(request)
            self.metadata.append(dict(context.invocation_metadata()))
            self.cv.notify_all()
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self) -> list[tuple[dict, object]]:
        """(resource attributes, span) for every span received."""
        with self.cv:
            return [({a.key: _pv(a.value) for a in rs.resource.attributes}, sp)
                    for req in self.got for rs in req.resource_spans for ss in rs.scope_spans for sp in ss.spans]


def _pv(v):
    return getattr(v, v.WhichOneof("value"))


@pytest.fixture
def grpc_receiver():
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    rec = _GrpcReceiver()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(rec, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    yield rec, f"http://127.0.0.1:{port}"
    srv.stop(0)


@pytest.fixture
def http_receiver():
    _HttpReceiver.got = []
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _HttpReceiver)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield _HttpReceiver.got, f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def _episode_with_a_step():
    with telemetry.span("episode", attributes={"n": 3, "x": 0.5, "ok": True, "s": "a"}):
        with telemetry.client_span("env.step"):
            pass


def _check_episode(spans):
    by = {sp.name: (res, sp) for res, sp in spans}
    (res, e), (_, c) = by["episode"], by["env.step"]
    assert res["service.name"] == "envd" and res["service.namespace"] == "tars" and res["process.pid"] == os.getpid()
    assert len(e.trace_id) == 16 and len(e.span_id) == 8 and e.parent_span_id == b""
    assert c.trace_id == e.trace_id and c.parent_span_id == e.span_id
    assert c.kind == c.SPAN_KIND_CLIENT and e.kind == e.SPAN_KIND_INTERNAL
    assert {a.key: _pv(a.value) for a in e.attributes} == {"n": 3, "x": 0.5, "ok": True, "s": "a"}
    assert e.end_time_unix_nano >= e.start_time_unix_nano > 0


def test_otlp_http_protobuf_export_reaches_a_local_receiver_from_the_config_endpoint(tmp_path, http_receiver):
    got_reqs, url = http_receiver
    got = telemetry.setup(TelemetryConfig(sample_ratio=1.0, otlp_endpoint=url), "envd", str(tmp_path))
    assert got["traces"] == f"otlp http/protobuf {url}"  # the default protocol, as the OTLP spec says
    _episode_with_a_step()
    telemetry.shutdown()
    path, ctype, _, req = got_reqs[-1]
    assert path == "/v1/traces" and ctype == "application/x-protobuf"
    _check_episode([({a.key: _pv(a.value) for a in rs.resource.attributes}, sp)
                    for rs in req.resource_spans for ss in rs.scope_spans for sp in ss.spans])
    assert not list(tmp_path.glob("telemetry/*"))  # OTLP instead of the file, not as well


def test_otlp_http_honours_the_standard_environment(tmp_path, http_receiver, monkeypatch):
    got_reqs, url = http_receiver
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", url)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-tenant=team-a,authorization=Bearer%20abc")
    got = telemetry.setup(TelemetryConfig(sample_ratio=1.0), "envd", str(tmp_path))
    assert got["traces"] == f"otlp http/protobuf {url}"
    _episode_with_a_step()
    telemetry.shutdown()
    path, _, headers, req = got_reqs[-1]
    headers = {k.lower(): v for k, v in headers.items()}
    assert path == "/v1/traces" and headers["x-tenant"] == "team-a" and headers["authorization"] == "Bearer abc"
    assert {sp.name for rs in req.resource_spans for ss in rs.scope_spans for sp in ss.spans} == {"episode", "env.step"}


def test_otlp_grpc_export_reaches_a_local_trace_service(tmp_path, grpc_receiver, monkeypatch):
    rec, url = grpc_receiver
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", url)  # the per-signal variables win
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-tenant=team-b")
    got = telemetry.setup(TelemetryConfig(sample_ratio=1.0), "envd", str(tmp_path))
    assert got["traces"] == f"otlp grpc {url}"
    _episode_with_a_step()
    telemetry.shutdown()
    _check_episode(rec.spans())
    assert rec.metadata[-1]["x-tenant"] == "team-b"


def test_telemetry_exporter_setting_picks_the_exporter_over_the_environment(tmp_path, grpc_receiver, monkeypatch):
    rec, url = grpc_receiver
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")  # the setting wins over the protocol variable
    got = telemetry.setup(TelemetryConfig(sample_ratio=1.0, exporter="otlp-grpc", otlp_endpoint=url), "envd", None)
    assert got["traces"] == f"otlp grpc {url}"
    _episode_with_a_step()
    telemetry.shutdown()
    _check_episode(rec.spans())


def test_a_real_envd_process_sends_its_spans_to_a_local_otlp_receiver(tmp_path, grpc_receiver):
    from actor.envclient import EnvClient
    from core.action import Action

    rec, url = grpc_receiver
    ready = tmp_path / "envd.json"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("OTEL_")},
           "PYTHONPATH": str(ROOT), "OTEL_EXPORTER_OTLP_ENDPOINT": url, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    p = subprocess.Popen([sys.executable, "-m", "tars.cli", "envd", "--set", "envd.port=0",
                          "--set", "telemetry.sample_ratio=1.0", "--ready-file", str(ready)], cwd=ROOT, env=env,
                         stdout=open(tmp_path / "envd.log", "wb"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert p.poll() is None and time.monotonic() < deadline, (tmp_path / "envd.log").read_text()[-2000:]
            time.sleep(0.05)
        addr = json.loads(ready.read_text())["address"]

        async def episode():
            c = EnvClient(addr)
            try:
                sid, run_id = await c.create("builtin/mixed", 3, {})
                await c.reset(sid, run_id, 3)
                await c.step(sid, run_id, Action("wait"))
            finally:
                await c.close()

        asyncio.run(episode())
        p.send_signal(signal.SIGTERM)  # a clean stop flushes the batch that is still queued
        assert p.wait(timeout=30) == 0, (tmp_path / "envd.log").read_text()[-2000:]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    spans = rec.spans()
    names = {sp.name for _, sp in spans}
    assert {"envd.create_session", "envd.reset", "envd.step"} <= names, names
    assert {res["service.name"] for res, _ in spans} == {"envd"} and {res["process.pid"] for res, _ in spans} == {p.pid}
    step = next(sp for _, sp in spans if sp.name == "envd.step")
    assert step.kind == step.SPAN_KIND_SERVER and "tars.step_ms" in {a.key for a in step.attributes}
    assert not (tmp_path / "telemetry").exists()


def test_otlp_export_to_a_dead_endpoint_does_not_hold_up_the_exit(tmp_path, monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "2")
    telemetry.setup(TelemetryConfig(sample_ratio=1.0, exporter="otlp-http", otlp_endpoint=f"http://127.0.0.1:{port}"),
                    "actor", str(tmp_path))
    _episode_with_a_step()
    t0 = time.monotonic()
    telemetry.shutdown()  # the batch fails (and is dropped) within the exporter's deadline
    assert time.monotonic() - t0 < 15


def test_console_exporter_prints_each_span_as_json(capsys):
    got = telemetry.setup(TelemetryConfig(sample_ratio=1.0, exporter="console"), "actor", None)
    assert got["traces"] == "console"
    _episode_with_a_step()
    telemetry.shutdown()
    out = capsys.readouterr().out
    printed = json.loads("[" + out.strip().replace("}\n{", "},\n{") + "]")
    by = {d["name"]: d for d in printed}
    assert set(by) == {"episode", "env.step"}
    assert by["env.step"]["parent_id"] == by["episode"]["context"]["span_id"]
    assert by["episode"]["resource"]["attributes"]["service.name"] == "actor"


def test_standard_otel_traces_exporter_variable_is_honoured(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert telemetry.setup(TelemetryConfig(sample_ratio=1.0), "actor", str(tmp_path))["traces"] == "off"
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    assert telemetry.setup(TelemetryConfig(sample_ratio=1.0), "actor", str(tmp_path))["traces"] == "console"
    telemetry.shutdown()
    # an explicit telemetry.exporter wins over the variable
    got = telemetry.setup(TelemetryConfig(sample_ratio=1.0, exporter="file"), "actor", str(tmp_path))
    assert got["traces"].endswith(".jsonl")


@pytest.mark.parametrize("cfg,env,msg", [
    ({"exporter": "zipkin"}, {}, "telemetry.exporter='zipkin'"),
    ({}, {"OTEL_TRACES_EXPORTER": "jaeger"}, "OTEL_TRACES_EXPORTER='jaeger'"),
    ({}, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "OTEL_EXPORTER_OTLP_PROTOCOL": "thrift"}, "'thrift'"),
    ({"exporter": "file"}, {}, "needs telemetry.dir"),
])
def test_exporter_settings_tars_does_not_offer_give_a_config_error(cfg, env, msg, monkeypatch):
    from core.config import ConfigError

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ConfigError, match=msg):
        telemetry.setup(TelemetryConfig(**cfg), "actor", None)
    assert not telemetry.S.tracing


def test_bad_exporter_values_fail_at_config_load_and_a_bad_variable_in_one_line(tmp_path):
    from core import config as C

    with pytest.raises(C.ConfigError, match="telemetry.exporter='jaeger'"):
        C.load(None, None, ["telemetry.exporter=jaeger"])
    with pytest.raises(C.ConfigError, match="telemetry.otlp_protocol='thrift'"):
        C.load(None, None, ["telemetry.otlp_protocol=thrift"])
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}, "PYTHONPATH": str(ROOT),
           "OTEL_TRACES_EXPORTER": "jaeger"}
    r = subprocess.run([sys.executable, "-m", "tars.cli", "envd", "--set", "envd.port=0"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "config error: $OTEL_TRACES_EXPORTER='jaeger'" in r.stderr


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


FAMILIES: dict = {}


def parse(text: str) -> dict[str, list[tuple[dict, float]]]:
    """prometheus_client's own parser: {sample name: [(labels, value)]}; the families' (type, help) into FAMILIES."""
    out: dict[str, list[tuple[dict, float]]] = {}
    for fam in text_string_to_metric_families(text):
        FAMILIES[fam.name] = (fam.type, fam.documentation)
        for smp in fam.samples:
            out.setdefault(smp.name, []).append((smp.labels, smp.value))
    return out


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
            assert r.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
            return parse(r.read().decode())

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
    assert FAMILIES["tars_test_events"] == ("counter", 'events "quoted"\nnew line')
    assert FAMILIES["tars_env_step_duration_seconds"] == ("histogram", "step latency")
    assert FAMILIES["tars_test_depth"] == ("gauge", "a gauge")
    telemetry.shutdown()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://{got['metrics']}/metrics", timeout=5)


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
    assert ctl.find_run() == (str(a), f"{ctl.LAST_RUN_HOW}, {tmp_path / 'cache' / 'tars' / 'last-run'}")
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

"""OpenTelemetry for every tars process: one TracerProvider and one MeterProvider per process, service.name = role.

Spans (names are stable; docs/telemetry.md):
  actor      episode (root) > turn > generate, env.step (client side); env.create
  envd       envd.create_session, envd.reset, envd.step (server side, child of the actor's client span)
  inference  inference.generate (server side, child of the actor's generate span)
  learner    learner.step (root; links to the episode span of every trajectory in its batch)
Context crosses gRPC as a W3C `traceparent` metadata entry (client interceptor in core.rpc, server_span() here) and
crosses the trajectory stream in Trajectory.traceparent (the episode span), which the learner step links to.

Export (docs/telemetry.md): the official OpenTelemetry exporters. telemetry.exporter picks one: otlp-grpc and
otlp-http (opentelemetry-exporter-otlp-proto-grpc / -http, OTLP protobuf; they read every standard
OTEL_EXPORTER_OTLP_* variable: endpoint, headers, timeout, compression, certificates, insecure), console (the SDK's
ConsoleSpanExporter, one JSON document per span on stdout), file (one JSON object per span into
<dir>/spans-<role>-<pid>.jsonl, the format `tars` tooling and the tests read, capped in size) or none. Empty (auto):
$OTEL_TRACES_EXPORTER if set, else OTLP when an endpoint is configured (telemetry.otlp_endpoint or
$OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT) with the protocol of telemetry.otlp_protocol or
$OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL (default http/protobuf), else the span file when a directory is known, else off.
Spans are batched by the SDK's BatchSpanProcessor (a bounded queue; spans past it are dropped, never blocking the
hot path). With no exporter, or enabled=false, every helper here is a no-op that costs a function call and a flag test.
Metrics: instruments registered by the roles (counter / histogram / observable gauges read from their status) go to
an in-memory reader; core.metrics_http hands them to prometheus_client (a registry per process), which serves them
on telemetry.prometheus_host (127.0.0.1 by default) when prometheus_port >= 0, behind telemetry.prometheus_token
when set (required off loopback unless telemetry.prometheus_allow_no_token).
"""
from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import threading
from typing import Any, Callable, Iterable

from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from core.spanfile import JsonLinesSpanExporter, span_to_dict  # noqa: F401 - the span file (format, size cap)

log = logging.getLogger("core.telemetry")
_PROP = TraceContextTextMapPropagator()
_NOOP_TRACER = trace.NoOpTracer()


class _State:
    tracing = False
    metrics = False
    role = ""
    tracer: Any = _NOOP_TRACER
    tracer_provider: Any = None
    meter_provider: Any = None
    meter: Any = None
    reader: Any = None          # InMemoryMetricReader behind the Prometheus endpoint
    http: Any = None            # core.metrics_http.MetricsServer
    bsp: Any = None             # the BatchSpanProcessor
    span_file: str = ""


S = _State()


# ---- exporters --------------------------------------------------------------------------------------------------
def _sampler(ratio: float):
    """Episodes are sampled at `ratio` (everything under them follows the parent); learner steps always."""
    from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased, Sampler, TraceIdRatioBased

    by_ratio = TraceIdRatioBased(min(1.0, max(0.0, ratio)))

    class RootSampler(Sampler):
        def should_sample(self, parent_context, trace_id, name, kind=None, attributes=None, links=None, trace_state=None):
            s = ALWAYS_ON if name == "learner.step" else by_ratio
            return s.should_sample(parent_context, trace_id, name, kind, attributes, links, trace_state)

        def get_description(self) -> str:
            return f"tars(ratio={ratio}, learner.step always)"

    return ParentBased(root=RootSampler())


# ---- set-up -----------------------------------------------------------------------------------------------------
EXPORTERS = ("", "otlp-grpc", "otlp-http", "console", "file", "none")   # telemetry.exporter ("" = auto)
PROTOCOLS = ("", "grpc", "http/protobuf", "http/json")                   # telemetry.otlp_protocol ("" = from env)
_STD_EXPORTERS = {"otlp": "otlp", "console": "console", "none": "none"}  # $OTEL_TRACES_EXPORTER values tars offers


def _env(name: str, env) -> str:
    """OTEL_EXPORTER_OTLP_TRACES_<name>, else OTEL_EXPORTER_OTLP_<name> (the spec's order), else ""."""
    return (env.get(f"OTEL_EXPORTER_OTLP_TRACES_{name}") or env.get(f"OTEL_EXPORTER_OTLP_{name}") or "").strip()


def resolve(cfg, run_dir: str | None = None, env=None) -> dict:
    """Which span exporter a TelemetryConfig (and the standard OTEL_* environment) gives this process:
    {exporter: otlp-grpc | otlp-http | console | file | none, endpoint, protocol, span_dir}. ConfigError on a value
    tars does not know, from the config or from the environment."""
    from core.config import ConfigError

    env = os.environ if env is None else env
    kind = (cfg.exporter or "").strip().lower()
    if kind not in EXPORTERS:
        raise ConfigError(f"telemetry.exporter={cfg.exporter!r}: one of otlp-grpc, otlp-http, console, file, none "
                          "(empty = auto)")
    endpoint = cfg.otlp_endpoint or _env("ENDPOINT", env)
    span_dir = cfg.dir or (str(pathlib.Path(run_dir) / "telemetry") if run_dir else "")
    if not kind:
        std = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
        if std:
            first = std.split(",")[0].strip()
            if first not in _STD_EXPORTERS:
                raise ConfigError(f"$OTEL_TRACES_EXPORTER={std!r}: tars offers otlp, console or none "
                                  "(or set telemetry.exporter)")
            kind = _STD_EXPORTERS[first]
        else:
            kind = "otlp" if endpoint else "file" if span_dir else "none"
    protocol = ""
    if kind == "otlp":
        protocol = (cfg.otlp_protocol or _env("PROTOCOL", env) or "http/protobuf").strip().lower()
        if protocol not in PROTOCOLS[1:]:
            raise ConfigError(f"OTLP protocol {protocol!r} (telemetry.otlp_protocol or $OTEL_EXPORTER_OTLP_PROTOCOL): "
                              "one of grpc, http/protobuf")
        kind = "otlp-grpc" if protocol == "grpc" else "otlp-http"
    elif kind in ("otlp-grpc", "otlp-http"):
        protocol = "grpc" if kind == "otlp-grpc" else "http/protobuf"
    if protocol == "http/json":  # not offered by the official exporter; every collector's HTTP receiver takes both
        log.warning("OTLP http/json is not offered by the OpenTelemetry exporter: sending http/protobuf to the same "
                    "endpoint")
        protocol = "http/protobuf"
    if kind == "file" and not span_dir:
        raise ConfigError("telemetry.exporter=file needs telemetry.dir (or a role's --run-dir)")
    return {"exporter": kind, "endpoint": endpoint, "protocol": protocol, "span_dir": span_dir}


def _span_exporter(cfg, r: dict, role: str):
    """(the SpanExporter, what it does in words) for a resolve() result; (None, "off") for none."""
    kind = r["exporter"]
    if kind in ("otlp-grpc", "otlp-http"):
        endpoint = cfg.otlp_endpoint  # None below: the exporter reads OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT itself
        if kind == "otlp-grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            if endpoint and not endpoint.rstrip("/").endswith("/v1/traces"):  # a base URL, like the env variable
                endpoint = endpoint.rstrip("/") + "/v1/traces"
        return OTLPSpanExporter(endpoint=endpoint or None), f"otlp {r['protocol']} {r['endpoint'] or '(default)'}"
    if kind == "console":
        import sys

        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter(service_name=role, out=sys.stdout), "console"  # stdout as of now (its default: at import)
    if kind == "file":
        S.span_file = str(pathlib.Path(r["span_dir"]) / f"spans-{role}-{os.getpid()}.jsonl")
        return JsonLinesSpanExporter(S.span_file, int(cfg.max_file_mb * (1 << 20))), S.span_file
    return None, "off"


def setup(cfg, role: str, run_dir: str | None = None) -> dict:
    """Configure this process from a TelemetryConfig. Returns what was set up ({traces, metrics}); ConfigError when
    the exporter settings (config or OTEL_* environment) name something tars does not offer."""
    shutdown()
    if not cfg.enabled:
        return {"traces": "off", "metrics": "off"}
    from opentelemetry.sdk.resources import Resource

    r = resolve(cfg, run_dir)
    S.role = role
    res = Resource.create({"service.name": role, "service.namespace": "tars", "process.pid": os.getpid()})
    try:  # a bad OTEL_EXPORTER_OTLP_* value (timeout, compression, ...) or a span dir that cannot be made
        exporter, what = _span_exporter(cfg, r, role)
    except Exception as e:  # noqa: BLE001 - the exporters raise ValueError, OSError or their own exceptions
        from core.config import ConfigError

        where = (f"telemetry.dir={r['span_dir']!r}: cannot write span files there" if r["exporter"] == "file" else
                 f"telemetry ({r['exporter']} exporter; telemetry.* or $OTEL_EXPORTER_OTLP_*)")
        raise ConfigError(f"{where}: {type(e).__name__}: {e}") from None
    if exporter is not None:
        from opentelemetry.sdk.trace import SpanLimits, TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        limits = SpanLimits(max_links=MAX_LINKS,  # SDK default 128: a learner.step's batch
                            max_attribute_length=cfg.max_attribute_length)  # SDK default: unbounded (span, event, link)
        tp = TracerProvider(resource=res, sampler=_sampler(cfg.sample_ratio), shutdown_on_exit=True, span_limits=limits)
        logging.getLogger("opentelemetry.attributes").addFilter(_first_only)  # one "truncating" warning per process
        S.bsp = BatchSpanProcessor(exporter, max_queue_size=cfg.max_queued_spans, schedule_delay_millis=1000,
                                   max_export_batch_size=min(512, cfg.max_queued_spans))
        tp.add_span_processor(S.bsp)
        S.tracer_provider, S.tracer, S.tracing = tp, tp.get_tracer("tars"), True
    if cfg.prometheus_port >= 0:
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader
        from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View

        from core import metrics_http

        S.reader = InMemoryMetricReader()
        views = [View(instrument_name=n, aggregation=ExplicitBucketHistogramAggregation(b)) for n, b in BUCKETS.items()]
        S.meter_provider = MeterProvider(metric_readers=[S.reader], resource=res, views=views, shutdown_on_exit=True)
        S.meter, S.metrics = S.meter_provider.get_meter("tars"), True
        host, port = cfg.prometheus_host.strip(), cfg.prometheus_port
        rank = os.environ.get("LOCAL_RANK", "")
        if port > 0 and rank.isdigit() and int(rank) > 0:
            port += int(rank)  # several processes of one accelerate launch: one port each
        check_metrics_bind(cfg, role, host)
        try:
            S.http = metrics_http.MetricsServer(collect, host, port, token=cfg.prometheus_token)
        except (OSError, OverflowError) as e:
            from core.config import ConfigError

            shutdown()
            raise ConfigError(f"telemetry.prometheus_host={host!r}, telemetry.prometheus_port={port}: cannot serve "
                              f"/metrics there: {e}") from None
    if isinstance(exporter, JsonLinesSpanExporter):  # the span file's size cap: drops counted (and logged once)
        observe("tars.telemetry.spans_dropped", lambda: exporter.dropped, description="spans dropped at the span "
                "file's size cap (telemetry.max_file_mb)", kind="counter")
    return {"traces": what, "metrics": S.http.address if S.http else "off"}


def check_metrics_bind(cfg, role: str, host: str) -> None:
    """core.auth's rule for /metrics: off loopback only with telemetry.prometheus_token, or with the explicit
    telemetry.prometheus_allow_no_token (a port the operator firewalls). A ConfigError (the role exits 2)."""
    from core import auth

    if cfg.prometheus_token or cfg.prometheus_allow_no_token or auth.is_loopback(host):
        return  # on loopback without a token: as before (no warning; any local process may read the metrics)
    try:
        auth.check_listener(role, "/metrics", host, {"telemetry.prometheus_token": ""})
    except auth.InsecureBind as e:
        from core.config import ConfigError

        shutdown()
        raise ConfigError(f"{e}; or set telemetry.prometheus_allow_no_token=true where a firewall or "
                          "NetworkPolicy admits the Prometheus server alone") from None


# Histogram buckets: staleness in versions (integers), latencies in seconds.
BUCKETS = {
    "tars.token_staleness": [0, 1, 2, 3, 4, 6, 8, 12, 16, 32],
    "tars.env.step.duration": [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10],
    "tars.learner.step.duration": [0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120],
}


def _first_only(record: logging.LogRecord) -> bool:
    """A logging filter that passes its first record and drops the rest (the SDK warns at every truncated value)."""
    first, _first_only.seen = not getattr(_first_only, "seen", False), True
    return first


MAX_LINKS = 4096  # links kept on one span (learner.step: one per sampled episode of its batch; past it, counted)
SHUTDOWN_S = 3.0  # the final flush at exit: past it, spans still queued are dropped (a slow or down collector)


def _bounded(fn: Callable[[], Any], timeout_s: float, what: str) -> bool:
    """fn() in a daemon thread, waited for at most timeout_s: True when it finished in time."""
    t = threading.Thread(target=fn, name=f"tars-telemetry-{what}", daemon=True)
    t.start()
    t.join(max(0.0, timeout_s))
    return not t.is_alive()


def shutdown(timeout_s: float = SHUTDOWN_S) -> None:
    """Flush and stop this process's providers (idempotent), within about timeout_s in all: spans the exporter could
    not take by then are dropped and counted in a warning. Helpers are no-ops afterwards."""
    if S.http is not None:
        S.http.close()
    tp, mp, bsp = S.tracer_provider, S.meter_provider, S.bsp
    S.tracing = S.metrics = False
    S.tracer, S.tracer_provider, S.meter_provider, S.meter, S.reader, S.http, S.span_file = _NOOP_TRACER, None, None, None, None, None, ""
    if tp is not None:
        bp = getattr(bsp, "_batch_processor", None)  # its shutdown takes a deadline (BatchSpanProcessor's waits 30 s)
        stop = (lambda: (bp.shutdown(timeout_millis=timeout_s * 1000), tp.shutdown())) if bp is not None else tp.shutdown
        done = _bounded(stop, timeout_s + 0.5, "shutdown")
        left = len(getattr(bp, "_queue", ()) or ())
        if left or not done:
            log.warning("telemetry shutdown: %d queued spans dropped (not exported within %.1f s: the collector is "
                        "slow or down)", left, timeout_s)
    S.bsp = None
    if mp is not None and not _bounded(mp.shutdown, 1.0, "metrics-shutdown"):
        log.warning("telemetry shutdown: the meter provider did not stop within 1 s")


def force_flush(timeout_s: float = 10.0) -> bool:
    """Export what is queued, waiting at most timeout_s (True when done)."""
    tp = S.tracer_provider
    return tp is None or _bounded(lambda: tp.force_flush(int(timeout_s * 1000)), timeout_s, "flush")


def info() -> dict:
    """What a ready file should say about this process's telemetry."""
    d = {}
    if S.http is not None:
        d["metrics"] = S.http.address
    if S.span_file:
        d["span_file"] = S.span_file
    return d


# ---- traces -----------------------------------------------------------------------------------------------------
def span(name: str, kind=trace.SpanKind.INTERNAL, attributes: dict | None = None, links: Iterable | None = None):
    """Context manager: a child of the current span (or a root). A shared no-op span when tracing is off."""
    if not S.tracing:
        return contextlib.nullcontext(trace.INVALID_SPAN)
    return S.tracer.start_as_current_span(name, kind=kind, attributes=attributes, links=list(links or ()))


def client_span(name: str, attributes: dict | None = None):
    return span(name, trace.SpanKind.CLIENT, attributes)


def server_span(name: str, grpc_context, attributes: dict | None = None):
    """A SERVER span whose parent is the caller's span, read from the RPC's `traceparent` metadata."""
    if not S.tracing:
        return contextlib.nullcontext(trace.INVALID_SPAN)
    md = {k: v for k, v in (grpc_context.invocation_metadata() or ()) if k in ("traceparent", "tracestate")}
    return S.tracer.start_as_current_span(name, context=_PROP.extract(md), kind=trace.SpanKind.SERVER,
                                          attributes=attributes)


def start_server_span(name: str, traceparent: str, attributes: dict | None = None):
    """A started (not current) SERVER span whose parent is the span `traceparent` names, for one request of a batch
    call (each carries its own); the caller ends it. The shared no-op span when tracing is off."""
    if not S.tracing:
        return trace.INVALID_SPAN
    ctx = _PROP.extract({"traceparent": traceparent} if traceparent else {})
    return S.tracer.start_span(name, context=ctx, kind=trace.SpanKind.SERVER, attributes=attributes)


def traceparent() -> str:
    """The current span's W3C traceparent, or "" when none is recorded."""
    if not S.tracing:
        return ""
    carrier: dict[str, str] = {}
    _PROP.inject(carrier)
    return carrier.get("traceparent", "")


def grpc_metadata() -> list[tuple[str, str]]:
    """Metadata entries that carry the current span to a server (empty when there is none)."""
    tp = traceparent()
    return [("traceparent", tp)] if tp else []


def link_from(tp: str, attributes: dict | None = None):
    """A span Link to the span a traceparent names, or None when it is empty, malformed or not sampled (no such span
    was exported)."""
    if not tp:
        return None
    sc = trace.get_current_span(_PROP.extract({"traceparent": tp})).get_span_context()
    return trace.Link(sc, attributes) if sc.is_valid and sc.trace_flags.sampled else None


def links_from(tps: Iterable[str]) -> tuple[list, int]:
    """(Links to the sampled spans among traceparents, at most MAX_LINKS; how many sampled ones were left out)."""
    links = [lk for lk in map(link_from, tps) if lk is not None]
    return links[:MAX_LINKS], max(0, len(links) - MAX_LINKS)


def set_attrs(sp, **attrs) -> None:
    if S.tracing and sp.is_recording():
        sp.set_attributes({k: v for k, v in attrs.items() if v is not None})


# ---- metrics ----------------------------------------------------------------------------------------------------
class _NoInstrument:
    def add(self, *a, **k) -> None:
        pass

    def record(self, *a, **k) -> None:
        pass


NO_INSTRUMENT = _NoInstrument()


def counter(name: str, unit: str = "", description: str = ""):
    return S.meter.create_counter(name, unit, description) if S.metrics else NO_INSTRUMENT


def histogram(name: str, unit: str = "", description: str = ""):
    return S.meter.create_histogram(name, unit, description) if S.metrics else NO_INSTRUMENT


def observe(name: str, read: Callable[[], float | dict | None], unit: str = "", description: str = "",
            kind: str = "gauge", label: str = "key") -> None:
    """An observable gauge (or monotonic counter, kind="counter") whose value `read()` returns at each collection:
    a number, None (no point this time) or {label value: number}, one point per entry labelled `label`."""
    if not S.metrics:
        return
    from opentelemetry.metrics import Observation

    def cb(_options):
        try:
            v = read()
        except Exception as e:  # a broken reading must not break the whole scrape
            log.debug("metric %s: %s", name, e)
            return []
        if v is None:
            return []
        if isinstance(v, dict):
            return [Observation(float(x), {label: str(k)}) for k, x in v.items() if x is not None]
        return [Observation(float(v))]

    make = S.meter.create_observable_counter if kind == "counter" else S.meter.create_observable_gauge
    make(name, callbacks=[cb], unit=unit, description=description)


def collect():
    """The current MetricsData (None when metrics are off)."""
    return S.reader.get_metrics_data() if S.reader is not None else None


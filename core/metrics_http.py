"""Prometheus text exposition (format 0.0.4) of OpenTelemetry MetricsData, served at /metrics on loopback.

prometheus_client is not a dependency: the format is small. Names: dots become underscores, monotonic sums get
`_total`, histograms give cumulative `_bucket{le=...}`, `_sum` and `_count`. Every point carries the resource's
service.name as `role` so one Prometheus can scrape every process of a run.
"""
from __future__ import annotations

import math
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_BAD = re.compile(r"[^a-zA-Z0-9_:]")


def metric_name(name: str, unit: str = "") -> str:
    n = _BAD.sub("_", name)
    if unit == "s" and not n.endswith("_seconds"):
        n += "_seconds"
    return n if not n[:1].isdigit() else "_" + n


def _esc(v: str) -> str:
    return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(attrs: dict, extra: dict | None = None) -> str:
    d = {**{_BAD.sub("_", k): v for k, v in (attrs or {}).items()}, **(extra or {})}
    if not d:
        return ""
    return "{" + ",".join(f'{k}="{_esc(v)}"' for k, v in sorted(d.items())) + "}"


def _num(x: float) -> str:
    if isinstance(x, float):
        if math.isnan(x):
            return "NaN"
        if math.isinf(x):
            return "+Inf" if x > 0 else "-Inf"
    return repr(float(x)) if isinstance(x, float) else str(x)


def render(data) -> str:
    """MetricsData -> exposition text."""
    from opentelemetry.sdk.metrics.export import Gauge, Histogram, Sum

    if data is None:
        return ""
    out: list[str] = []
    seen: set[str] = set()
    for rm in data.resource_metrics:
        base = {"role": rm.resource.attributes.get("service.name", "")}
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                d = m.data
                name = metric_name(m.name, m.unit)
                if isinstance(d, Sum):
                    typ = "counter" if d.is_monotonic else "gauge"
                    if d.is_monotonic and not name.endswith("_total"):
                        name += "_total"
                elif isinstance(d, Gauge):
                    typ = "gauge"
                elif isinstance(d, Histogram):
                    typ = "histogram"
                else:
                    continue
                if name not in seen:  # HELP/TYPE once per family
                    seen.add(name)
                    out.append(f"# HELP {name} {_esc(m.description or m.name)}")
                    out.append(f"# TYPE {name} {typ}")
                for p in d.data_points:
                    if typ == "histogram":
                        cum = 0
                        for bound, c in zip([*p.explicit_bounds, math.inf], p.bucket_counts):
                            cum += c
                            out.append(f"{name}_bucket{_labels(p.attributes, {**base, 'le': _num(float(bound))})} {cum}")
                        out.append(f"{name}_sum{_labels(p.attributes, base)} {_num(float(p.sum))}")
                        out.append(f"{name}_count{_labels(p.attributes, base)} {p.count}")
                    else:
                        out.append(f"{name}{_labels(p.attributes, base)} {_num(p.value)}")
    return "\n".join(out) + "\n"


def parse(text: str) -> dict[str, list[tuple[dict, float]]]:
    """Exposition text -> {sample name: [(labels, value)]}; raises ValueError on a malformed line (tests, tools)."""
    line_re = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)$')
    label_re = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
    out: dict[str, list[tuple[dict, float]]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = line_re.match(line)
        if m is None:
            raise ValueError(f"not an exposition line: {line!r}")
        labels = {k: v.replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\") for k, v in label_re.findall(m.group(3) or "")}
        out.setdefault(m.group(1), []).append((labels, float(m.group(4))))
    return out


class MetricsServer:
    """GET /metrics on host:port (port 0 = any free port) in a daemon thread; everything else is 404."""

    def __init__(self, collect: Callable[[], object], host: str = "127.0.0.1", port: int = 0):
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's naming)
                if self.path.split("?")[0] != "/metrics":
                    self.send_error(404, "only /metrics here")
                    return
                try:
                    body = render(collect()).encode()
                except Exception as e:  # report, do not kill the server thread
                    self.send_error(500, f"{type(e).__name__}: {e}")
                    return
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):  # scrapes are not news
                pass

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.httpd.timeout = 5.0
        self.address = f"{host}:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.5},
                                       name="tars-metrics-http", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5.0)

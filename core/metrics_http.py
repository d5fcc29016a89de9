"""The Prometheus endpoint of a process: prometheus_client serves the process's OpenTelemetry metrics.

Each process gets its own prometheus_client CollectorRegistry holding one collector, which reads the process's
OpenTelemetry MetricsData (core.telemetry's in-memory reader) at every scrape and hands it over as prometheus_client
metric families; prometheus_client writes the exposition text (0.0.4 by default, what the scraper negotiates) and
serves it. Names: dots become underscores, a unit "s" adds `_seconds`, monotonic sums are counters (`_total`),
histograms keep their explicit buckets. Every sample carries the resource's service.name as `role`, so one
Prometheus can scrape every process of a run.

With a token (telemetry.prometheus_token) every request must carry `Authorization: Bearer <token>`, as Prometheus
sends it (scrape config `authorization`, a PodMonitor's `authorization`): anything else is answered 401 with a
`WWW-Authenticate: Bearer` challenge and an empty body, before the registry is collected.
"""
from __future__ import annotations

import math
import re
from typing import Callable, Iterable

import threading
from http.server import ThreadingHTTPServer

from prometheus_client import CollectorRegistry, MetricsHandler
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

_BAD = re.compile(r"[^a-zA-Z0-9_:]")


def metric_name(name: str, unit: str = "") -> str:
    """The Prometheus family name of an OpenTelemetry instrument (`_total` is added by prometheus_client)."""
    n = _BAD.sub("_", name)
    if unit == "s" and not n.endswith("_seconds"):
        n += "_seconds"
    return n if not n[:1].isdigit() else "_" + n


def _labels(attrs, base: dict) -> dict[str, str]:
    return {**{_BAD.sub("_", str(k)): str(v) for k, v in (attrs or {}).items()}, **base}


class OtelCollector(Collector):
    """A prometheus_client collector over `collect()` -> OpenTelemetry MetricsData (or None)."""

    def __init__(self, collect: Callable[[], object]):
        self._collect = collect

    def collect(self) -> Iterable[Metric]:
        from opentelemetry.sdk.metrics.export import Gauge, Histogram, Sum

        data = self._collect()
        if data is None:
            return []
        families: dict[str, Metric] = {}
        for rm in data.resource_metrics:
            base = {"role": str(rm.resource.attributes.get("service.name", ""))}
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    d = m.data
                    name = metric_name(m.name, m.unit)
                    if isinstance(d, Sum) and d.is_monotonic:
                        typ, name = "counter", name.removesuffix("_total")
                    elif isinstance(d, (Sum, Gauge)):
                        typ = "gauge"
                    elif isinstance(d, Histogram):
                        typ = "histogram"
                    else:
                        continue
                    fam = families.get(name)
                    if fam is None:
                        fam = families[name] = Metric(name, m.description or m.name, typ)
                    elif fam.type != typ:
                        continue  # one type per family: a clash (two instruments, one name) keeps the first
                    for p in d.data_points:
                        labels = _labels(p.attributes, base)
                        if typ == "histogram":
                            cum = 0
                            for bound, c in zip([*p.explicit_bounds, math.inf], p.bucket_counts):
                                cum += c
                                le = "+Inf" if math.isinf(bound) else repr(float(bound))
                                fam.add_sample(name + "_bucket", {**labels, "le": le}, cum)
                            fam.add_sample(name + "_count", labels, p.count)
                            fam.add_sample(name + "_sum", labels, float(p.sum))
                        else:
                            fam.add_sample(name + ("_total" if typ == "counter" else ""), labels, float(p.value))
        return list(families.values())


def _bearer_handler(base: type, token: str) -> type:
    """`base` (prometheus_client's MetricsHandler over our registry) behind a bearer-token check: the token is
    compared in constant time (hmac.compare_digest) and never logged or echoed."""
    import hmac

    want = f"Bearer {token}".encode()

    class BearerHandler(base):
        def do_GET(self) -> None:
            got = self.headers.get("Authorization", "")
            scheme, _, cred = got.strip().partition(" ")
            # the scheme is case-insensitive (RFC 7235); compare_digest takes the same time whatever cred holds
            ok = hmac.compare_digest(f"Bearer {cred.strip()}".encode("utf-8", "replace"), want)
            if not (ok and scheme.lower() == "bearer"):
                self.send_response(401)
                self.send_header("WWW-Authenticate", 'Bearer realm="tars metrics"' +
                                 (', error="invalid_token"' if got else ""))
                self.send_header("Content-Length", "0")
                self.send_header("Connection", "close")
                self.end_headers()
                return
            super().do_GET()

    return BearerHandler


CONN_TIMEOUT_S = 10.0  # an idle or half-sent connection is closed after this (its thread ends)
MAX_CONNS = 32        # connections served at once; more are closed at once
CONN_DEADLINE_S = 30.0  # a connection's whole life, however it trickles (one request each: HTTP/1.0)


class _Server(ThreadingHTTPServer):
    """ThreadingHTTPServer (a thread per connection) whose connections time out and whose threads are bounded."""
    daemon_threads = True

    def __init__(self, addr, handler, max_conns: int = MAX_CONNS, deadline_s: float = CONN_DEADLINE_S):
        import socket

        infos = socket.getaddrinfo(addr[0], addr[1], type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        self.address_family, _, _, _, sockaddr = infos[0]  # as prometheus_client picks it: IPv6 hosts work too
        addr = (sockaddr[0], addr[1])
        self._slots = threading.BoundedSemaphore(max_conns)
        # The handler's timeout bounds each read, so a client sending a byte now and then kept its slot for ever
        # (MAX_CONNS of them and no scrape got through): the watchdog cuts every connection at its deadline.
        self.deadline_s, self._open, self._open_lock, self._stop = deadline_s, {}, threading.Lock(), threading.Event()
        super().__init__(addr, handler)
        self.watchdog = threading.Thread(target=self._watch, name="tars-metrics-deadline", daemon=True)
        self.watchdog.start()

    def _watch(self) -> None:
        import socket
        import time

        while not self._stop.wait(min(0.25, self.deadline_s / 4)):
            now = time.monotonic()
            with self._open_lock:
                late = [r for r, t in self._open.items() if t < now]
            for r in late:
                try:
                    r.shutdown(socket.SHUT_RDWR)  # the handler's next read sees EOF and its thread ends
                except OSError:
                    pass

    def server_close(self) -> None:
        self._stop.set()
        super().server_close()

    def process_request(self, request, client_address):
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # too many at once: refused, not queued behind idle ones
            return
        try:
            super().process_request(request, client_address)
        except Exception:
            self._slots.release()
            raise

    def handle_error(self, request, client_address):
        import sys

        if isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError, TimeoutError)):
            return  # the scraper went away mid-reply: its business, not a server error worth a traceback
        super().handle_error(request, client_address)

    def process_request_thread(self, request, client_address):
        import time

        with self._open_lock:
            self._open[request] = time.monotonic() + self.deadline_s
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._open_lock:
                self._open.pop(request, None)
            self._slots.release()


class MetricsServer:
    """prometheus_client's HTTP server on host:port (telemetry.prometheus_host / prometheus_port; port 0 = any free
    port) in a daemon thread, over a registry of this process's own (`address` = host:actual port, an IPv6 host in
    brackets). It answers /metrics (and, as prometheus_client does, any other path) with the exposition of
    `collect()`. Each connection's thread ends when its client is idle for conn_timeout_s, and at most max_conns are
    served at once (more are closed on accept); one still open CONN_DEADLINE_S after it was accepted is cut. With a
    `token`, a request without `Authorization: Bearer <token>` gets 401 and no metrics."""

    def __init__(self, collect: Callable[[], object], host: str = "127.0.0.1", port: int = 0,
                 conn_timeout_s: float | None = None, max_conns: int | None = None, token: str = ""):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(OtelCollector(collect))
        conn_timeout_s = CONN_TIMEOUT_S if conn_timeout_s is None else conn_timeout_s
        max_conns = MAX_CONNS if max_conns is None else max_conns
        handler = type("Handler", (MetricsHandler.factory(self.registry),),
                       {"timeout": conn_timeout_s, "log_message": lambda *a: None})
        if token:
            handler = _bearer_handler(handler, token)
        self.httpd = _Server((host, port), handler, max_conns, CONN_DEADLINE_S)
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.5},
                                       name="tars-metrics-http", daemon=True)
        self.thread.start()
        port = self.httpd.server_address[1]
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"  # an IPv6 address in brackets

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5.0)
        self.httpd.watchdog.join(timeout=5.0)

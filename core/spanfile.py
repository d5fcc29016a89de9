"""The span file: one JSON object per finished span in <dir>/spans-<role>-<pid>.jsonl (the format `tars` tooling
and the tests read, docs/telemetry.md), capped in size: past the cap spans are dropped, counted (`dropped`, the
metric tars.telemetry.spans_dropped) and logged once."""
from __future__ import annotations

import json
import logging
import os
import pathlib
import threading
from typing import Sequence

log = logging.getLogger("core.telemetry")


def _hex(n: int, width: int) -> str:
    return f"{n:0{width}x}"


def _attrs(a) -> dict:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in (a or {}).items()}


def span_to_dict(s) -> dict:
    """One finished span as a plain JSON object (the span file's line format)."""
    p = s.parent
    return {
        "trace_id": _hex(s.context.trace_id, 32), "span_id": _hex(s.context.span_id, 16),
        "parent_span_id": _hex(p.span_id, 16) if p is not None else None,
        "name": s.name, "kind": s.kind.name, "service": s.resource.attributes.get("service.name", ""),
        "pid": s.resource.attributes.get("process.pid"),
        "start_ns": s.start_time, "end_ns": s.end_time,
        "duration_ms": ((s.end_time or 0) - (s.start_time or 0)) / 1e6,
        "attributes": _attrs(s.attributes),
        "links": [{"trace_id": _hex(lk.context.trace_id, 32), "span_id": _hex(lk.context.span_id, 16),
                   "attributes": _attrs(lk.attributes)} for lk in s.links],
        "status": s.status.status_code.name, "status_message": s.status.description or "",
        "events": [{"name": e.name, "t_ns": e.timestamp, "attributes": _attrs(e.attributes)} for e in s.events],
    }


def _exporter_base():
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    return SpanExporter, SpanExportResult


SpanExporter, SpanExportResult = _exporter_base()


class JsonLinesSpanExporter(SpanExporter):
    """Appends one JSON object per span to `path`; stops writing (and counts drops) once the file passes max_bytes."""

    def __init__(self, path: str | os.PathLike, max_bytes: int = 256 << 20):
        self.path = pathlib.Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.f = open(self.path, "a", encoding="utf-8")
        self.written = self.dropped = 0
        self._lock = threading.Lock()

    def export(self, spans: Sequence) -> "SpanExportResult":
        with self._lock:
            if self.f.closed:
                return SpanExportResult.FAILURE
            lines = [json.dumps(span_to_dict(s), default=str) + "\n" for s in spans]
            for line in lines:
                if self.f.tell() + len(line) > self.max_bytes:
                    if not self.dropped:
                        log.warning("span file %s reached its cap (telemetry.max_file_mb, %.0f MiB): further spans "
                                    "are dropped (counted in tars_telemetry_spans_dropped_total)", self.path,
                                    self.max_bytes / (1 << 20))
                    self.dropped += 1
                    continue
                self.f.write(line)
                self.written += 1
            self.f.flush()
        return SpanExportResult.SUCCESS

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        with self._lock:
            if not self.f.closed:
                self.f.flush()
        return True

    def shutdown(self) -> None:
        with self._lock:
            self.f.close()

"""SGLang's native HTTP API at the wire: one JSON call, and reading the weight versions a /generate response reports.

Standard library only. The request path (inference_server.sglang_engine), the replica pool
(inference_server.sglang_pool) and the launcher (inference_server.sglang_launch) all talk to servers through here.
"""
from __future__ import annotations

import http.client
import json
import urllib.parse


def http_json(url: str, path: str, body: dict | None = None, timeout: float = 30.0, method: str | None = None):
    """One HTTP call -> (status, parsed JSON or text). Raises OSError (incl. timeouts) when the server is unreachable."""
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=timeout)
    try:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        conn.request(method or ("GET" if data is None else "POST"), (u.path.rstrip("/") or "") + path, data, headers)
        resp = conn.getresponse()
        raw = resp.read()
        try:
            return resp.status, json.loads(raw) if raw.strip() else None
        except ValueError:
            return resp.status, raw.decode(errors="replace")
    except http.client.HTTPException as e:  # a reply cut short: the server went away
        raise ConnectionError(f"{url}{path}: {type(e).__name__}: {e}") from e
    finally:
        conn.close()


def error_message(resp) -> str:
    """The message of an SGLang error answer: {"error": {"message"}} (/generate's ValueError), {"message"} (a request
    FastAPI could not build, an ErrorResponse), {"detail": ...} (an HTTPException, pydantic's list), or the text."""
    if isinstance(resp, dict):
        err = resp.get("error")
        if isinstance(err, dict) and err.get("message") is not None:
            return str(err["message"])
        for k in ("message", "detail"):
            if resp.get(k) is not None:
                return str(resp[k])
    return str(resp)


def post_abort(url: str, rid: str) -> None:
    """POST /abort_request {rid}; a server that does not answer is left alone (it has no request to stop then)."""
    try:
        http_json(url, "/abort_request", {"rid": rid}, timeout=5.0)
    except OSError:
        pass


def parse_version(v, default: int) -> int:
    """A server's weight_version string as a tars version; `default` for a non-integer one ("default")."""
    try:
        return int(str(v))
    except (TypeError, ValueError):
        return default


def token_versions(meta: dict, n: int, default: int) -> list[int]:
    """Per-token versions of one /generate response's n output tokens (spans first, then weight_version)."""
    spans = meta.get("weight_versions")
    fallback = parse_version(meta.get("weight_version"), default)
    out = [fallback] * n
    if isinstance(spans, list):
        for s in spans:
            v = parse_version(s.get("version"), default)
            for i in range(max(0, int(s.get("start", 0))), min(n, int(s.get("end", 0)))):
                out[i] = v
    return out

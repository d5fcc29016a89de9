"""A stand-in SGLang server: SGLang 0.5.23's native HTTP API over a LocalEngine (standard library only).

What the server does (generation, abort, pause modes, weight updates, cache flushes) is modelled, and documented,
in inference_server.sglang_behaviour; this module puts it behind SGLang's routes: the JSON bodies and status codes
SGLang's http_server answers with, cumulative server-sent events for `stream`, 400 for a body that SGLang's own
request types refuse (where the `sglang` package is importable), and a command line with launch_server's flags.

    python -m inference_server.sglang_conformance --model DIR --port N --host 127.0.0.1
"""
from __future__ import annotations

import argparse
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from core.config import InferenceConfig
from inference_server.sglang_behaviour import KEEP_KV, Refused, SGLangBehaviour
from inference_server.sglang_launch import ALLOW_LONGER, allow_longer_context, model_context_length
from inference_server.sglang_types import SGLangTypes


MAX_BODY = 64 << 20  # generate bodies are token ids; update_weights_from_tensor carries shared-memory handles, not data


class BodyTooLarge(ValueError):
    """413: a Content-Length over MAX_BODY."""


class ConformanceServer(SGLangBehaviour):
    """In-process SGLang stand-in; start() binds (port 0 = free) and returns the port; stop() shuts it down."""

    def __init__(self, model: str, host: str = "127.0.0.1", port: int = 0, weight_version: str = "default",
                 cfg: InferenceConfig | None = None, tokenizer_workers: int = 1, health_timeout_s: float = 20.0,
                 token_delay_s: float = 0.0, sglang_types: SGLangTypes | None = None, max_queued_requests: int | None = None,
                 max_running_requests: int | None = None):
        super().__init__(model, weight_version, cfg, tokenizer_workers, health_timeout_s, token_delay_s, sglang_types,
                         max_queued_requests, max_running_requests)
        self.host, self.port = host, port
        self.httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> int:
        srv = self

        class Handler(_Handler):
            server_ref = srv

        self.httpd = ThreadingHTTPServer((self.host, self.port), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
        self._thread.start()
        return self.port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        self.shut()  # first, so handlers waiting on a paused or running request give up
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()
        super().stop()


class _Handler(BaseHTTPRequestHandler):
    server_ref: ConformanceServer
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet: the launcher prints nothing
        pass

    def _send(self, code: int, obj=None, text: str | None = None) -> None:
        data = (text if text is not None else json.dumps(obj)).encode()
        try:
            self.send_response(code)
            self.send_header("Content-Type", "text/plain" if text is not None else "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):  # the client went away: nobody to answer
            self.close_connection = True

    def _body(self) -> dict:
        if self.headers.get("Transfer-Encoding"):  # not decoded here: refused, and the connection closed
            self.close_connection = True
            raise ValueError("Transfer-Encoding bodies are not supported: send Content-Length")
        n = int(self.headers.get("Content-Length") or 0)
        if n < 0:
            self.close_connection = True
            raise ValueError(f"Content-Length {n} is negative")
        if n > MAX_BODY:  # the body is read whole: a huge length must not become a MemoryError and a dropped socket
            self.close_connection = True
            raise BodyTooLarge(f"Content-Length {n} is over the {MAX_BODY}-byte limit")
        raw = self.rfile.read(n) if n else b""
        body = json.loads(raw) if raw.strip() else {}
        if not isinstance(body, dict):
            raise ValueError("the body must be a JSON object")
        return body

    def _client_gone(self) -> bool:
        """The client closed its end: the socket reads as end-of-file (a request body is read whole before)."""
        import select
        import socket

        try:
            if not select.select([self.connection], [], [], 0)[0]:
                return False
            return self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def _error(self, code: int, msg: str) -> None:
        self._send(code, {"object": "error", "message": msg, "type": "BadRequestError" if code < 500 else "InternalServerError", "param": None, "code": code})

    def do_GET(self) -> None:
        s, path = self.server_ref, self.path.split("?")[0]
        if path in ("/health", "/health_generate"):
            self._send(200 if s.health_generate() else 503, text="")
        elif path in ("/get_model_info", "/model_info"):
            self._send(200, s.model_info())
        elif path == "/v1/models":  # OpenAI's model list; max_model_len: the context length (model_config.context_len)
            self._send(200, {"object": "list", "data": [{"id": s.model_path, "object": "model", "owned_by": "sglang",
                                                        "root": s.model_path, "max_model_len": s.cfg.max_context}]})
        elif path == "/get_weight_version":
            self._send(200, {"weight_version": s.weight_version})
        elif path == "/get_server_info":
            m = s.engine.metrics()
            self._send(200, {"model_path": s.model_path, "weight_version": s.weight_version, "version": "0.5.23-conformance",
                             "skip_tokenizer_init": True, "internal_states": [{"paused": s.paused, "running": m["running"], "waiting": m["waiting"]}]})
        elif path == "/flush_cache":
            self._flush()
        else:
            self._error(404, f"Not Found: {path}")

    def _flush(self) -> None:
        ok = self.server_ref.flush_cache()
        self._send(200 if ok else 400, text="Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting requests, the operation will not be performed.)\n")

    def do_POST(self) -> None:
        s, path = self.server_ref, self.path.split("?")[0]
        try:
            body = self._body()
        except BodyTooLarge as e:
            return self._error(413, str(e))
        except (ValueError, UnicodeDecodeError, RecursionError) as e:  # RecursionError: JSON nested too deep
            return self._error(400, f"bad JSON: {type(e).__name__}: {str(e)[:200]}")
        try:
            s.types.check(path, body, s.engine.vocab_size)
            if path in ("/generate",):
                return self._generate(body)
            if path == "/abort_request":
                s.abort_request(str(body.get("rid") or ""), bool(body.get("abort_all")))
                return self._send(200, text="")
            if path == "/pause_generation":
                s.pause(body.get("mode", "abort"))
                return self._send(200, {"message": "Generation paused successfully.", "status": "ok"})
            if path == "/continue_generation":
                s.resume()
                return self._send(200, {"message": "Generation continued successfully.", "status": "ok"})
            if path == "/update_weights_from_disk":
                ok, msg, n = s.update_weights(body)
                return self._send(200 if ok else 400, {"success": ok, "message": msg, "num_paused_requests": n})
            if path == "/update_weights_from_tensor":
                return self._update_from_tensor(body)
            if path == "/flush_cache":
                return self._flush()
            self._error(404, f"Not Found: {path}")
        except Refused as e:  # the tokenizer manager's ValueError: http_server's _create_error_response
            self._send(400, {"error": {"message": str(e)}})
        except ValueError as e:
            self._error(400, str(e))
        except Exception as e:  # closed while waiting, engine failure: a 5xx, as a crashed SGLang would answer
            self._error(503, f"{type(e).__name__}: {e}")

    def _update_from_tensor(self, body: dict) -> None:
        """SGLang's FastAPI builds UpdateWeightsFromTensorReqInput from the body (422 {"detail": [...]} when it cannot);
        the scheduler decodes this rank's entry and loads it (400 {success: false, message} when that fails)."""
        detail = _tensor_body_detail(body)
        if detail:
            return self._send(422, {"detail": detail})
        from inference_server import sglang_tensors

        entries = body["serialized_named_tensors"]
        try:
            if not entries:  # validates, then the scheduler finds no entry for its rank
                raise sglang_tensors.BadTensors("no serialized_named_tensors entry for TP rank 0")
            named = sglang_tensors.deserialize(entries[0])  # this server is TP rank 0
        except sglang_tensors.BadTensors as e:
            return self._send(400, {"success": False, "message": f"Failed to update weights: {e}."})
        ok, msg, _ = self.server_ref.update_weights(body, dict(named))
        del named
        self._send(200 if ok else 400, {"success": ok, "message": msg})

    def _generate(self, body: dict) -> None:
        s = self.server_ref
        r = s.generate(body)
        if not body.get("stream"):
            while not r.done.wait(0.5):
                if s.closed:
                    return self._error(503, "server closed")
                if self._client_gone():  # SGLang aborts a request whose client disconnected (_wait_one_response)
                    with s.cv:
                        if r.finish is None:
                            s._abort(r, "Request is disconnected from the client side")
                    return
            fr = r.finish or {}
            # An abort the scheduler gave a status is no 200 (tokenizer_manager._wait_one_response): 400 raises the
            # ValueError /generate answers {"error": {"message"}} for, 500 / 503 an HTTPException (the queue full, a
            # failed scheduler), which http_server's handler answers as an ErrorResponse.
            if fr.get("type") == "abort" and fr.get("status_code") == 400:
                return self._send(400, {"error": {"message": fr.get("message")}})
            if fr.get("type") == "abort" and fr.get("status_code") in (500, 503):  # an HTTPException: ErrorResponse
                code = fr["status_code"]
                return self._send(code, {"object": "error", "message": fr.get("message"), "type": str(code), "param": None, "code": code})
            return self._send(200, s.response(r))
        # Server-sent events, each chunk cumulative (SGLang's default, non-incremental streaming), then [DONE].
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        sent = 0
        while True:
            finished = r.done.wait(0.02)
            with s.cv:
                n = len(r.out)
                chunk = s.response(r, final=finished) if finished or n > sent else None
            if chunk is not None:
                self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                self.wfile.flush()
                sent = n
            if finished or s.closed:
                break
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()


_TENSOR_FIELDS = {"serialized_named_tensors": list, "load_format": (str, type(None)), "flush_cache": bool,
                  "abort_all_requests": bool, "weight_version": (str, type(None))}


def _tensor_body_detail(body: dict) -> list[dict]:
    """FastAPI/pydantic's validation errors for an UpdateWeightsFromTensorReqInput body ([] when it validates)."""
    out = []
    if "serialized_named_tensors" not in body:
        out.append({"type": "missing", "loc": ["body", "serialized_named_tensors"], "msg": "Field required", "input": body})
    for k, typ in _TENSOR_FIELDS.items():
        v = body.get(k)
        if k in body and not isinstance(v, typ):
            out.append({"type": f"{typ.__name__ if isinstance(typ, type) else 'string'}_type", "loc": ["body", k],
                        "msg": f"Input should be a valid {typ.__name__ if isinstance(typ, type) else 'string'}", "input": v})
    entries = body.get("serialized_named_tensors")
    if isinstance(entries, list):
        for i, e in enumerate(entries):
            if not isinstance(e, str):
                out.append({"type": "string_type", "loc": ["body", "serialized_named_tensors", i],
                            "msg": "Input should be a valid string", "input": e})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="SGLang native-API stand-in over the local engine")
    ap.add_argument("--model", "--model-path", dest="model", required=True, help="HF-layout directory (config.json + model.safetensors)")
    ap.add_argument("--skip-tokenizer-init", action="store_true", help="accepted for sglang.launch_server parity (always token ids)")
    ap.add_argument("--tokenizer-path", help="accepted for sglang.launch_server parity (no tokenizer is loaded)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--weight-version", default="default", help="initial weight_version string")
    ap.add_argument("--context-length", type=int, default=None, help="default: the model's, from its config.json")
    ap.add_argument("--tokenizer-workers", type=int, default=1, help=">1 drops the exact-rid guard of /abort_request")
    ap.add_argument("--max-running-requests", type=int, default=None)
    ap.add_argument("--max-queued-requests", type=int, default=None, help="a request past this many waiting answers 503")
    a = ap.parse_args(argv)
    from core.proc import die_with_parent

    die_with_parent()
    derived = model_context_length(a.model) or 2048
    if a.context_length is not None and a.context_length > derived and not allow_longer_context():
        # SGLang's ModelConfig refuses it at start (the server exits) unless the environment allows it.
        raise SystemExit(f"ValueError: User-specified context_length ({a.context_length}) is greater than the derived "
                         f"context_length ({derived}). This may lead to incorrect model outputs or CUDA errors. To allow "
                         f"overriding this maximum, set the env var {ALLOW_LONGER}=1")
    ctx = a.context_length or derived
    srv = ConformanceServer(a.model, a.host, a.port, a.weight_version, InferenceConfig(max_context=ctx, max_stale_versions=KEEP_KV),
                            tokenizer_workers=a.tokenizer_workers, max_queued_requests=a.max_queued_requests,
                            max_running_requests=a.max_running_requests)
    srv.start()
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        srv.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The HTTP layer: an OpenAI-compatible `/v1/models` and `/v1/chat/completions` over a `ChatEngine`.

Standard library only (ThreadingHTTPServer): each request is handled on its own thread, and the
engine batches concurrent generations. Not supported (answered with a clear 400): streaming,
non-text content parts. Unknown request fields are ignored, as OpenAI clients send many.
Errors use OpenAI's shape: {"error": {"message", "type", "param", "code"}}.
"""
from __future__ import annotations

import hmac
import http.server
import json
import logging
import threading
import time
import uuid

from steprl_jax.serve.chat_format import RequestError, parse_tool_calls
from steprl_jax.serve.engine import ChatEngine

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 16 * 1024 * 1024


class _HttpError(Exception):
    def __init__(self, status: int, message: str, error_type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.error_type = status, message, error_type


def _stop_list(value) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list):
        return tuple(value)
    raise RequestError("stop must be a string or a list of strings")


def chat_completion(engine: ChatEngine, model_name: str, body: dict) -> dict:
    """The response object for one chat-completions request body."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    if body.get("model") not in (None, model_name):
        raise _HttpError(404, f"model {body.get('model')!r} is not served here; this server serves {model_name!r}",
                         "not_found_error")
    if body.get("stream"):
        raise RequestError("streaming is not supported; send stream=false")
    tools = body.get("tools") or None
    if body.get("tool_choice") == "none":
        tools = None
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is None:
        max_tokens = 256  # the engine also caps it at the room left in the context
    temperature = body.get("temperature")
    top_p = body.get("top_p")
    completions = engine.complete(
        body.get("messages"), n=body.get("n", 1), temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p, max_tokens=max_tokens, stop=_stop_list(body.get("stop")),
        tools=tools, seed=body.get("seed"))
    choices = []
    for index, completion in enumerate(completions):
        message: dict = {"role": "assistant", "content": completion.text}
        finish_reason = completion.finish_reason
        if tools:
            content, calls = parse_tool_calls(completion.text)
            if calls:
                message = {"role": "assistant", "content": content or None, "tool_calls": calls}
                finish_reason = "tool_calls"
        choices.append({"index": index, "message": message, "finish_reason": finish_reason, "logprobs": None})
    prompt_tokens = completions[0].prompt_tokens
    completion_tokens = sum(c.completion_tokens for c in completions)
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": model_name, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


def make_handler(engine: ChatEngine, model_name: str, api_key: str | None = None):
    created = int(time.time())

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "steprl_jax"

        def log_message(self, fmt, *args):  # routed to logging; bodies and headers are never logged
            log.debug("%s " + fmt, self.address_string(), *args)

        def _send_json(self, status: int, payload: dict) -> None:
            data = json.dumps(payload, ensure_ascii=False).encode("utf-8")
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _send_error(self, status: int, message: str, error_type: str) -> None:
            self._send_json(status, {"error": {"message": message, "type": error_type, "param": None,
                                               "code": None}})

        def _authorized(self) -> bool:
            if api_key is None:
                return True
            given = self.headers.get("Authorization", "")
            return hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode())

        def _handle(self, method: str) -> None:
            start = time.monotonic()
            status = 200
            try:
                if not self._authorized():
                    raise _HttpError(401, "missing or wrong API key", "authentication_error")
                path = self.path.split("?", 1)[0].rstrip("/")
                if method == "GET" and path in ("/v1/models", "/models"):
                    self._send_json(200, {"object": "list", "data": [
                        {"id": model_name, "object": "model", "created": created, "owned_by": "steprl_jax"}]})
                elif method == "GET" and path == "/health":
                    self._send_json(200, {"status": "ok"})
                elif method == "POST" and path in ("/v1/chat/completions", "/chat/completions"):
                    self._send_json(200, chat_completion(engine, model_name, self._read_json()))
                else:
                    raise _HttpError(404, f"no route {method} {path}", "not_found_error")
            except _HttpError as error:
                status = error.status
                self._send_error(error.status, error.message, error.error_type)
            except RequestError as error:
                status = 400
                self._send_error(400, str(error), "invalid_request_error")
            except (BrokenPipeError, ConnectionResetError):
                status = 499  # the client went away
            except Exception as error:
                status = 500
                log.exception("internal error")
                self._send_error(500, f"internal error: {type(error).__name__}: {error}", "server_error")
            log.info("%s %s -> %d in %.2fs", method, self.path, status, time.monotonic() - start)

        def _read_json(self):
            try:
                length = int(self.headers.get("Content-Length", ""))
            except ValueError:
                raise _HttpError(411, "Content-Length is required") from None
            if length > MAX_BODY_BYTES:
                raise _HttpError(413, f"request body over {MAX_BODY_BYTES} bytes")
            raw = self.rfile.read(length)
            try:
                return json.loads(raw)
            except ValueError:
                raise RequestError("the request body is not valid JSON") from None

        def do_GET(self):
            self._handle("GET")

        def do_POST(self):
            self._handle("POST")

    return Handler


class ChatServer:
    """A running server: `start()` binds and serves on a thread; `url` is the `/v1` base URL."""

    def __init__(self, engine: ChatEngine, model_name: str, host: str = "127.0.0.1", port: int = 8000,
                 api_key: str | None = None):
        self.engine = engine
        self.model_name = model_name
        self.httpd = http.server.ThreadingHTTPServer((host, port), make_handler(engine, model_name, api_key))
        self.httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{port}/v1"

    def start(self) -> "ChatServer":
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="chat-server", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self.httpd.serve_forever()

    def close(self) -> None:
        if self._thread is not None:
            self.httpd.shutdown()
        self.httpd.server_close()
        self.engine.close()

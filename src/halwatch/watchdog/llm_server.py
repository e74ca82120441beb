"""A small OpenAI-compatible chat server for a local model (``halwatch watch serve-llm``): ``POST
/v1/chat/completions`` (``messages``, ``n``, ``temperature``, ``max_tokens``, ``seed``, ``logprobs``,
``top_logprobs``), ``GET /v1/models`` and ``GET /health``. It binds to loopback unless told otherwise; requests are
answered one at a time by the model (a thread per connection, one lock around the model)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from halwatch.errors import HalwatchError
from halwatch.watchdog.clients import LocalClient

MAX_BODY = 1 << 20


def _handler(client: LocalClient, model_name: str):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet: the CLI prints its own line
            return

        def _send(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, status: int, message: str) -> None:
            self._send(status, {"error": {"message": message, "type": "invalid_request_error"}})

        def do_GET(self):
            if self.path == "/health":
                self._send(200, {"status": "ok", "model": model_name})
            elif self.path == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": model_name, "object": "model"}]})
            else:
                self._error(404, f"no route {self.path}")

        def do_POST(self):
            if self.path != "/v1/chat/completions":
                return self._error(404, f"no route {self.path}")
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_BODY:
                return self._error(413, f"request body over {MAX_BODY} bytes")
            try:
                req = json.loads(self.rfile.read(length) or b"{}")
                messages = req["messages"]
                n, max_tokens = int(req.get("n", 1)), int(req.get("max_tokens") or 64)
                temperature = float(req.get("temperature", 1.0))
                if not isinstance(messages, list) or not 1 <= n <= 32 or not 1 <= max_tokens <= 2048:
                    raise ValueError("messages must be a list, 1 <= n <= 32, 1 <= max_tokens <= 2048")
            except (ValueError, KeyError, TypeError) as exc:
                return self._error(400, f"bad request: {exc}")
            top = int(req.get("top_logprobs") or 0)
            try:
                completions = client.complete(messages, n, temperature, max_tokens, int(req.get("seed") or 0),
                                              max(top, 1) if req.get("logprobs") else 0)
            except HalwatchError as exc:
                return self._error(400, str(exc))
            choices = []
            for i, c in enumerate(completions):
                choice = {"index": i, "message": {"role": "assistant", "content": c.text},
                          "finish_reason": "stop" if c.finished else "length"}
                if req.get("logprobs"):  # every token's log-probability; the first token's alternatives
                    first = [{"token": t, "logprob": lp} for t, lp in list(c.top_first.items())[:top]]
                    choice["logprobs"] = {"content": [{"token": t, "logprob": lp, "top_logprobs": first if k == 0 else []}
                                                      for k, (t, lp) in enumerate(zip(c.tokens, c.token_logprobs))]}
                choices.append(choice)
            self._send(200, {"id": f"chatcmpl-{time.time_ns()}", "object": "chat.completion",
                             "created": int(time.time()), "model": model_name, "choices": choices})

    return Handler


def start_server(client: LocalClient, host: str = "127.0.0.1", port: int = 0) -> ThreadingHTTPServer:
    """Serve ``client`` on ``host:port`` (0 = a free port) in a background thread; ``server.server_address`` tells
    where. Stop with ``server.shutdown()``."""
    server = ThreadingHTTPServer((host, port), _handler(client, client.scoring_model.name))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server

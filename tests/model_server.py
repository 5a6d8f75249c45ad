"""A fake model server for the node's managed servers: `python tests/model_server.py --port P --name N`.

It takes `--load-s` seconds to "load its model" (503 on /health meanwhile, then 200 and the line
`--ready-line` on stdout), answers /v1/chat/completions with `hello from N` (a prompt of `die`
makes it exit mid-answer), dies at once on POST /die, and appends `start`/`exit` with its pid and
the time to `--events FILE` so that a test can tell which servers ran when. Standard library only:
it starts in a few tens of milliseconds.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--name", default="fake")
    ap.add_argument("--load-s", type=float, default=0.0)
    ap.add_argument("--ready-line", default="model loaded")
    ap.add_argument("--events", default="")
    ap.add_argument("--ignore-term", action="store_true", help="exit only on SIGKILL")
    args = ap.parse_args()
    started = time.monotonic()

    def event(what: str) -> None:
        if args.events:
            with open(args.events, "a", encoding="utf-8") as f:
                f.write(f"{what} {args.name} {os.getpid()} {time.time():.6f}\n")

    def on_term(_sig: int, _frame: Any) -> None:
        event("exit")
        os._exit(0)

    signal.signal(signal.SIGTERM, signal.SIG_IGN if args.ignore_term else on_term)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *a: Any) -> None:
            pass

        def _send(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            loaded = time.monotonic() - started >= args.load_s
            if self.path.startswith("/health"):
                self._send(200 if loaded else 503, {"status": "ok" if loaded else "loading"})
            else:
                self._send(404, {"error": "not found"})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)) or b"{}")
            if self.path == "/die":
                event("exit")
                os._exit(3)
            if time.monotonic() - started < args.load_s:
                self._send(503, {"error": {"message": "loading model", "type": "server_error"}})
                return
            prompt = " ".join(str(m.get("content", "")) for m in body.get("messages", []))
            if prompt == "die":
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", "1000")
                self.end_headers()
                self.wfile.write(b'{"id": "x", ')
                self.wfile.flush()
                event("exit")
                os._exit(3)
            text = f"hello from {args.name}"
            if body.get("stream"):
                self._stream(body, text)
                return
            self._send(
                200,
                {
                    "id": "chatcmpl-1",
                    "object": "chat.completion",
                    "created": 0,
                    "model": body.get("model", args.name),
                    "choices": [
                        {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
                    ],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4},
                },
            )

        def _stream(self, body: dict[str, Any], text: str) -> None:
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": body.get("model")}
            events = [
                {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": text}}]},
                {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
            ]
            for e in events:
                self._chunk(f"data: {json.dumps(e)}\n\n".encode())
            self._chunk(b"data: [DONE]\n\n")
            self._chunk(b"")

        def _chunk(self, data: bytes) -> None:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    server.daemon_threads = True
    event("start")
    print(f"fake model server {args.name} loading for {args.load_s}s", flush=True)

    def announce() -> None:
        time.sleep(max(0.0, args.load_s - (time.monotonic() - started)))
        print(args.ready_line, flush=True)

    threading.Thread(target=announce, daemon=True).start()
    try:
        server.serve_forever()
    finally:
        sys.stdout.flush()


if __name__ == "__main__":
    main()

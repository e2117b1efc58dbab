"""What the loopback stand-ins share (the Compute API's, the package index): a threaded HTTP
server on a free port of 127.0.0.1, started and stopped as a context manager, and a quiet request
handler that answers with a body of a content type.

Test support, never production.
"""

from __future__ import annotations

import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Self


class QuietHandler(BaseHTTPRequestHandler):
    """A handler that logs nothing and answers in one call."""

    def send(self, code: int, body: bytes, content_type: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


class LoopbackServer:
    """`handler` served on 127.0.0.1 at `port` while the `with` block runs; over TLS with
    `tls` (a server context, scripts/emulators/tls.py)."""

    def __init__(self, handler: type[QuietHandler], tls: ssl.SSLContext | None = None) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        if tls is not None:
            self.server.socket = tls.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_port

    def __enter__(self) -> Self:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

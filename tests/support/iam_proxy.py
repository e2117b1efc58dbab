"""A proxy in front of the GCS emulator that refuses like GCS does while a grant propagates.

For its first `deny_for_s` seconds every request is answered `403` with the JSON error body real
GCS sends when the caller's service account lacks a permission; afterwards requests are forwarded
unchanged. `path_contains` limits the refusal to requests whose path holds that text (a grant
missing on one prefix). Point a client at `proxy.url` through `STORAGE_EMULATOR_HOST`, as at the
emulator.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}


class DenyingProxy:
    def __init__(self, target: str, deny_for_s: float, path_contains: str = "",
                 from_first_request: bool = False) -> None:
        """`from_first_request`: the `deny_for_s` seconds start at the first request it refuses
        (a client that takes long to start still meets the refusal), not now."""
        self.target = target.rstrip("/")
        self.path_contains = path_contains
        self.deny_for_s = deny_for_s
        self.deny_until: float | None = None if from_first_request else \
            time.monotonic() + deny_for_s
        self.denied = 0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _relay(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                if proxy.deny_until is None and proxy.path_contains in self.path:
                    proxy.deny_until = time.monotonic() + proxy.deny_for_s
                if (proxy.deny_until is not None and time.monotonic() < proxy.deny_until
                        and proxy.path_contains in self.path):
                    proxy.denied += 1
                    message = ("ms-stack-tpu@my-proj.iam.gserviceaccount.com does not have "
                               "storage.objects.get access to the Google Cloud Storage object. "
                               "Permission 'storage.objects.get' denied on resource (or it may "
                               "not exist).")
                    self._send(403, json.dumps({"error": {"code": 403, "message": message,
                                                          "errors": [{"message": message,
                                                                      "domain": "global",
                                                                      "reason": "forbidden"}]}})
                               .encode(), {"Content-Type": "application/json; charset=UTF-8"})
                    return
                request = urllib.request.Request(
                    proxy.target + self.path, data=body, method=self.command,
                    headers={k: v for k, v in self.headers.items()
                             if k.lower() not in _HOP_BY_HOP})
                try:
                    with urllib.request.urlopen(request, timeout=600) as answer:
                        status, data, headers = answer.status, answer.read(), answer.headers
                except urllib.error.HTTPError as err:
                    status, data, headers = err.code, err.read(), err.headers
                self._send(status, data, {k: v for k, v in headers.items()
                                          if k.lower() not in _HOP_BY_HOP})

            def _send(self, status: int, data: bytes, headers: dict[str, str]) -> None:
                try:
                    self.send_response(status)
                    for key, value in headers.items():
                        self.send_header(key, value)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up on this answer (curl after a refused upload)

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _relay

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def __enter__(self) -> DenyingProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

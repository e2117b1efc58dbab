"""A package index on loopback, as an organisation's own serves one: PEP 503's "simple" API (a
page per project, each file's link carrying its `#sha256=`), from a directory of wheels.

Test support, never production. Every request is recorded (`requests`), so a test can tell that
an installer came here and not to PyPI. Names are normalised as PEP 503 says.
"""

from __future__ import annotations

import hashlib
import html
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


class PackageIndex:
    def __init__(self, wheels: Path) -> None:
        self.files = {path.name: path for path in sorted(wheels.glob("*.whl"))}
        self.requests: list[str] = []
        index = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                index.requests.append(self.path)
                parts = [p for p in self.path.split("?", 1)[0].split("/") if p]
                if parts[:1] == ["simple"] and len(parts) == 2:
                    self._project(normalise(parts[1]))
                elif parts[:1] == ["files"] and len(parts) == 2 and parts[1] in index.files:
                    self._send(200, index.files[parts[1]].read_bytes(),
                               "application/octet-stream")
                else:
                    self._send(404, b"not found", "text/plain")

            def _project(self, project: str) -> None:
                links = [
                    f'<a href="/files/{html.escape(name)}#sha256='
                    f'{hashlib.sha256(path.read_bytes()).hexdigest()}">{html.escape(name)}</a>'
                    for name, path in index.files.items()
                    if normalise(name.split("-", 1)[0]) == project]
                if not links:
                    self._send(404, b"no such project", "text/plain")
                    return
                page = "<!DOCTYPE html><html><body>" + "<br>".join(links) + "</body></html>"
                self._send(200, page.encode(), "text/html")

            def _send(self, code: int, body: bytes, kind: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_port
        self.url = f"http://127.0.0.1:{self.port}/simple/"

    def __enter__(self) -> PackageIndex:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

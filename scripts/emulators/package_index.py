"""A package index on loopback, as an organisation's own serves one: PEP 503's "simple" API (a
page per project, each file's link carrying its `#sha256=`), from a directory of wheels.

Test support, never production. Every request is recorded (`requests`), so a test can tell that
an installer came here and not to PyPI. Names are normalised as PEP 503 says.

With `token` set it answers as Artifact Registry does (its pip docs): HTTP basic authentication
as user `oauth2accesstoken` with an access token as the password; no credentials get 401 with a
Basic challenge, and a token without the reader role (any other, or `refuse` set) gets 403.
"""

from __future__ import annotations

import base64
import hashlib
import html
import re
from pathlib import Path

from scripts.emulators.loopback import LoopbackServer, QuietHandler


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


class PackageIndex(LoopbackServer):
    def __init__(self, wheels: Path, token: str | None = None) -> None:
        self.files = {path.name: path for path in sorted(wheels.glob("*.whl"))}
        self.requests: list[str] = []
        self.agents: list[tuple[str, str]] = []  # (path, User-Agent): which installer asked
        self.token = token
        self.refuse = False  # answer 403 to every token: the reader role not granted yet
        index = self

        class Handler(QuietHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                index.requests.append(self.path)
                index.agents.append((self.path, self.headers.get("User-Agent", "")))
                if index.token is not None and not self._authorised():
                    return
                parts = [p for p in self.path.split("?", 1)[0].split("/") if p]
                if parts[:1] == ["simple"] and len(parts) == 2:
                    self._project(normalise(parts[1]))
                elif parts[:1] == ["files"] and len(parts) == 2 and parts[1] in index.files:
                    self.send(200, index.files[parts[1]].read_bytes(),
                              "application/octet-stream")
                else:
                    self.send(404, b"not found", "text/plain")

            def _authorised(self) -> bool:
                given = self.headers.get("Authorization", "")
                if not given.startswith("Basic "):
                    self.send_response(401)
                    self.send_header("WWW-Authenticate", 'Basic realm="pkg.dev"')
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return False
                user, _, password = base64.b64decode(given[6:]).decode().partition(":")
                if index.refuse or (user, password) != ("oauth2accesstoken", index.token):
                    self.send(403, b"Permission 'artifactregistry.repositories.downloadArtifacts'"
                              b" denied on resource", "text/plain")
                    return False
                return True

            def _project(self, project: str) -> None:
                links = [
                    f'<a href="/files/{html.escape(name)}#sha256='
                    f'{hashlib.sha256(path.read_bytes()).hexdigest()}">{html.escape(name)}</a>'
                    for name, path in index.files.items()
                    if normalise(name.split("-", 1)[0]) == project]
                if not links:
                    self.send(404, b"no such project", "text/plain")
                    return
                page = "<!DOCTYPE html><html><body>" + "<br>".join(links) + "</body></html>"
                self.send(200, page.encode(), "text/html")

        super().__init__(Handler)
        self.url = f"http://127.0.0.1:{self.port}/simple/"

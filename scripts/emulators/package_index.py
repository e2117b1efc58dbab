"""A package index on loopback, as an organisation's own serves one: PEP 503's "simple" API (a
page per project, each file's link carrying its `#sha256=`), from directories of wheels; and a
CPython mirror, as a copy of python-build-standalone's release assets is served.

Test support, never production. Every request is recorded (`requests`), so a test can tell that
an installer came here and not to PyPI. Names are normalised as PEP 503 says.

With `token` set the index answers as Artifact Registry does (its pip docs): HTTP basic
authentication as user `oauth2accesstoken` with an access token as the password; no credentials
get 401 with a Basic challenge, and a token without the reader role (one `token` does not
accept, or any while `refuse` is set) gets 403. `token` is the one token accepted, or a
predicate (the tokens a metadata server handed out). `simple` is the path of the simple root
(Artifact Registry's is /PROJECT/REPOSITORY/simple/); `tls` serves it over HTTPS.
"""

from __future__ import annotations

import base64
import hashlib
import html
import json
import re
import ssl
from collections.abc import Callable, Sequence
from pathlib import Path

from scripts.emulators.loopback import LoopbackServer, QuietHandler

# uv's UV_PYTHON_INSTALL_MIRROR replaces this prefix of a CPython download's URL
PYTHON_BUILD_STANDALONE = "https://github.com/astral-sh/python-build-standalone/releases/download"


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


class PackageIndex(LoopbackServer):
    def __init__(self, wheels: Path | Sequence[Path], token: str | Callable[[str], bool] | None
                 = None, *, simple: str = "/simple/", tls: ssl.SSLContext | None = None) -> None:
        dirs = [wheels] if isinstance(wheels, Path) else list(wheels)
        self.files = {path.name: path for d in dirs for path in sorted(d.glob("*.whl"))}
        self._sha256: dict[str, str] = {}
        self.requests: list[str] = []
        self.agents: list[tuple[str, str]] = []  # (path, User-Agent): which installer asked
        self.token = token
        self.refuse = False  # answer 403 to every token: the reader role not granted yet
        root = [p for p in simple.split("/") if p]
        index = self

        class Handler(QuietHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                index.requests.append(self.path)
                index.agents.append((self.path, self.headers.get("User-Agent", "")))
                if index.token is not None and not self._authorised():
                    return
                parts = [p for p in self.path.split("?", 1)[0].split("/") if p]
                if parts[:-1] == root and len(parts) == len(root) + 1:
                    self._project(normalise(parts[-1]))
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
                accepts = index.token if callable(index.token) else index.token.__eq__
                if index.refuse or user != "oauth2accesstoken" or not accepts(password):
                    self.send(403, b"Permission 'artifactregistry.repositories.downloadArtifacts'"
                              b" denied on resource", "text/plain")
                    return False
                return True

            def _project(self, project: str) -> None:
                links = [
                    f'<a href="/files/{html.escape(name)}#sha256={index.sha256(name)}">'
                    f'{html.escape(name)}</a>'
                    for name in index.files if normalise(name.split("-", 1)[0]) == project]
                if not links:
                    self.send(404, b"no such project", "text/plain")
                    return
                page = "<!DOCTYPE html><html><body>" + "<br>".join(links) + "</body></html>"
                self.send(200, page.encode(), "text/html")

        super().__init__(Handler, tls)
        scheme = "https" if tls is not None else "http"
        self.url = f"{scheme}://127.0.0.1:{self.port}/{'/'.join(root)}/"

    def sha256(self, name: str) -> str:
        if name not in self._sha256:
            self._sha256[name] = hashlib.sha256(self.files[name].read_bytes()).hexdigest()
        return self._sha256[name]


class PythonMirror(LoopbackServer):
    """A copy of python-build-standalone's release assets, as a mirror inside a VPC serves it
    (no credentials): `/RELEASE/ASSET` for every archive a uv downloads list (the emulated
    image's `python-downloads.json`) names. `downloads_url` serves that list with each URL
    written as the real one on GitHub, so uv reaches the archive only through
    UV_PYTHON_INSTALL_MIRROR = `url`."""

    def __init__(self, downloads_json: Path) -> None:
        listed = json.loads(downloads_json.read_text())
        self.assets: dict[str, Path] = {}
        for entry in listed.values():
            archive = downloads_json.parent / entry["url"].rsplit("/", 1)[-1]
            release = entry.get("build") or "local"
            self.assets[f"/{release}/{archive.name}"] = archive
            entry["url"] = f"{PYTHON_BUILD_STANDALONE}/{release}/{archive.name}"
        listing = json.dumps(listed).encode()
        self.requests: list[str] = []
        mirror = self

        class Handler(QuietHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                mirror.requests.append(self.path)
                if self.path == "/python-downloads.json":
                    self.send(200, listing, "application/json")
                elif self.path.startswith("/pbs/") and self.path[4:] in mirror.assets:
                    self.send(200, mirror.assets[self.path[4:]].read_bytes(),
                              "application/octet-stream")
                else:
                    self.send(404, b"not found", "text/plain")

        super().__init__(Handler)
        self.url = f"http://127.0.0.1:{self.port}/pbs"
        self.downloads_url = f"http://127.0.0.1:{self.port}/python-downloads.json"

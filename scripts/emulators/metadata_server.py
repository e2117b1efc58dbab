"""A fake GCE metadata server on loopback: instance attributes and the default service account's
access token, behind the Metadata-Flavor header check the real one makes.

Point clients at it the way Google's own libraries are pointed: GCE_METADATA_HOST=`host` (what
google-auth and the TPU startup script read).
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ROOT = "/computeMetadata/v1/"
PREFIX = ROOT + "instance/attributes/"
ACCOUNT_PATH = ROOT + "instance/service-accounts/default/"
TOKEN_PATH = ACCOUNT_PATH + "token"
ACCOUNT_EMAIL = "default@fake-project.iam.gserviceaccount.com"


class FakeMetadataServer:
    def __init__(self, attributes: dict[str, str], token_lifetime_s: int = 3599) -> None:
        """`token_lifetime_s`: the expires_in of each token issued (a short one makes clients
        refresh)."""
        self.attributes = dict(attributes)
        self.token_lifetime_s = token_lifetime_s
        self.requests: list[str] = []
        self.tokens_issued = 0
        self.tokens: set[str] = set()  # every access token handed out, for a stand-in to check
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                server.requests.append(self.path)
                path = self.path.split("?", 1)[0]
                if self.headers.get("Metadata-Flavor") != "Google":
                    self._send(403, "Missing Metadata-Flavor:Google header.")
                elif path == "/":  # google-auth's ping: "is this GCE?"
                    self._send(200, "computeMetadata/\n")
                elif path == ACCOUNT_PATH:  # ?recursive=true: what google-auth reads first
                    self._send(200, json.dumps({
                        "aliases": ["default"], "email": ACCOUNT_EMAIL,
                        "scopes": ["https://www.googleapis.com/auth/cloud-platform"]}),
                        "application/json")
                elif path == ACCOUNT_PATH + "email":
                    self._send(200, ACCOUNT_EMAIL)
                elif path.startswith(PREFIX) and path[len(PREFIX):] in server.attributes:
                    self._send(200, server.attributes[path[len(PREFIX):]])
                elif path == TOKEN_PATH:
                    server.tokens_issued += 1
                    token = f"ya29.fake-{server.tokens_issued}"
                    server.tokens.add(token)
                    self._send(200, json.dumps({"access_token": token,
                                                "expires_in": server.token_lifetime_s,
                                                "token_type": "Bearer"}),
                               "application/json")
                else:
                    self._send(404, "not found")

            def _send(self, status: int, text: str, content_type: str = "application/text") -> None:
                data = text.encode()
                self.send_response(status)
                self.send_header("Metadata-Flavor", "Google")
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self._httpd.server_address[1]}"

    @property
    def base_url(self) -> str:
        return f"http://{self.host}/computeMetadata/v1"

    def __enter__(self) -> FakeMetadataServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

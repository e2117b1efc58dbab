"""The Compute Engine API's (v1) reads a stack's preview makes of a shared network, on loopback.

Test support, never production: networks, subnetworks, firewalls and routers as the tests put
them, answered as the API does: GET projects/P/global/networks/N (and .../regions/R/
subnetworks/S) with the resource's JSON, GET of a collection (.../global/firewalls,
.../regions/R/routers) with {"items": [...]} (no `items` key when empty, as the API omits it),
and 404 with Google's error body for anything it does not hold. The resources' field names are
the API's own (mtu, privateIpGoogleAccess, ipCidrRange, allowed[].IPProtocol, sourceTags,
targetTags, sourceRanges, direction, disabled, nats[].sourceSubnetworkIpRangesToNat).
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

PREFIX = "/compute/v1/"


class ComputeApi:
    def __init__(self) -> None:
        self.resources: dict[str, dict[str, Any]] = {}  # path (projects/...) -> resource
        self.collections: dict[str, list[dict[str, Any]]] = {}  # path -> items
        api = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                path = self.path.split("?", 1)[0].removeprefix(PREFIX)
                if path in api.resources:
                    self._send(200, api.resources[path])
                elif path in api.collections:
                    items = api.collections[path]
                    self._send(200, {"kind": "compute#list", **({"items": items} if items else {})})
                else:
                    self._send(404, {"error": {"code": 404, "message": f"The resource "
                                               f"'projects/{path}' was not found",
                                               "errors": [{"reason": "notFound"}]}})

            def _send(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}{PREFIX.rstrip('/')}"

    def __enter__(self) -> ComputeApi:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

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
from typing import Any

from scripts.emulators.loopback import LoopbackServer, QuietHandler

PREFIX = "/compute/v1/"


class ComputeApi(LoopbackServer):
    def __init__(self) -> None:
        self.resources: dict[str, dict[str, Any]] = {}  # path (projects/...) -> resource
        self.collections: dict[str, list[dict[str, Any]]] = {}  # path -> items
        api = self

        class Handler(QuietHandler):
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
                self.send(code, json.dumps(body).encode(), "application/json")

        super().__init__(Handler)
        self.url = f"http://127.0.0.1:{self.port}{PREFIX.rstrip('/')}"

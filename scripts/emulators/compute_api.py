"""The Compute Engine API's (v1) reads a stack's preview makes of a shared network, on loopback.

Test support, never production: networks, subnetworks, firewalls and routers as the tests put
them, answered as the API does: GET projects/P/global/networks/N (and .../regions/R/
subnetworks/S) with the resource's JSON, GET of a collection (.../global/firewalls,
.../regions/R/routers) with {"items": [...]} (no `items` key when empty, as the API omits it),
and 404 with Google's error body for anything it does not hold. A list comes in pages of
`page_size` items with a `nextPageToken` that the next request passes as `pageToken`. The firewall
policies in effect on a network are answered as networks.getEffectiveFirewalls (GET
.../global/networks/N/getEffectiveFirewalls: the network's VPC firewall rules, and the
hierarchical and global network policies attached to it) and
regionNetworkFirewallPolicies.getEffectiveFirewalls (GET .../regions/R/firewallPolicies/
getEffectiveFirewalls?network=URL: the regional ones). The resources' field names are the API's
own (mtu, privateIpGoogleAccess, ipCidrRange, allowed[].IPProtocol, sourceTags, targetTags,
sourceRanges, direction, disabled, nats[].sourceSubnetworkIpRangesToNat; a policy's type, rules[]
.match.layer4Configs, action, priority).
"""

from __future__ import annotations

import json
import urllib.parse
from typing import Any

from scripts.emulators.loopback import LoopbackServer, QuietHandler

PREFIX = "/compute/v1/"


class ComputeApi(LoopbackServer):
    def __init__(self) -> None:
        self.resources: dict[str, dict[str, Any]] = {}  # path (projects/...) -> resource
        self.collections: dict[str, list[dict[str, Any]]] = {}  # path -> items
        self.page_size = 500  # the API's default maxResults
        # (network name, None for a global policy or the region of a regional one) -> the
        # policies attached to it: {"type": HIERARCHY | NETWORK | NETWORK_REGIONAL, "name",
        # "rules": [...]}, in the order the API returns them
        self.policies: dict[tuple[str, str | None], list[dict[str, Any]]] = {}
        api = self

        class Handler(QuietHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                path, _, query = self.path.partition("?")
                path = path.removeprefix(PREFIX)
                params = urllib.parse.parse_qs(query)
                parts = path.split("/")
                if path in api.resources:
                    self._send(200, api.resources[path])
                elif path in api.collections:
                    items = api.collections[path]
                    start = int(params.get("pageToken", ["0"])[0])
                    page = items[start:start + api.page_size]
                    more = start + api.page_size < len(items)
                    self._send(200, {"kind": "compute#list", **({"items": page} if page else {}),
                                     **({"nextPageToken": str(start + api.page_size)}
                                        if more else {})})
                elif parts[-1] == "getEffectiveFirewalls" and parts[2:4] == ["global",
                                                                             "networks"]:
                    name = parts[4]
                    if f"projects/{parts[1]}/global/networks/{name}" not in api.resources:
                        self._not_found(path)
                        return
                    rules = [r for r in api.collections.get(
                        f"projects/{parts[1]}/global/firewalls", [])
                        if r.get("network", "").rsplit("/", 1)[-1] == name]
                    self._send(200, {"firewalls": rules,
                                     "firewallPolicys": api.policies.get((name, None), [])})
                elif parts[-1] == "getEffectiveFirewalls" and parts[2] == "regions":
                    name = params.get("network", [""])[0].rsplit("/", 1)[-1]
                    self._send(200, {"firewallPolicys": api.policies.get((name, parts[3]), [])})
                else:
                    self._not_found(path)

            def _not_found(self, path: str) -> None:
                self._send(404, {"error": {"code": 404, "message": f"The resource "
                                           f"'projects/{path}' was not found",
                                           "errors": [{"reason": "notFound"}]}})

            def _send(self, code: int, body: dict[str, Any]) -> None:
                self.send(code, json.dumps(body).encode(), "application/json")

        super().__init__(Handler)
        self.url = f"http://127.0.0.1:{self.port}{PREFIX.rstrip('/')}"

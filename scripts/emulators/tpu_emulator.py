"""A local stand-in for the Cloud TPU API v2 (queued resources, nodes, operations) over loopback.

It speaks the REST shape the official ``google-cloud-tpu`` client's REST transport uses: paths
``/v2/projects/P/locations/Z/queuedResources[/ID][:reset]``, ``.../nodes[/ID]``,
``.../operations/OP``, a ``$alt=json;enum-encoding=int`` query parameter, camelCase proto3 JSON
with defaults omitted, and long-running ``Operation`` objects. Point a client at it with
``MULTISLICE_TPU_API_ENDPOINT=http://127.0.0.1:PORT`` (see ``infra.tpu_vm.api.make_tpu_client``).

Tests drive it through the Python control API::

    with TpuEmulator() as emu:                       # port 0: an ephemeral port
        emu.script("qr1", [("ACCEPTED", 1), ("WAITING_FOR_RESOURCES", None)])
        emu.inject(status=503, count=2, method="GET")  # the next two GETs fail
        emu.set_state("qr1", "SUSPENDED")             # preemption, at any time

A script is a list of ``(state, polls)``: the queued resource reports ``state`` for ``polls`` GETs,
then moves on; ``None`` holds it there.

Run standalone to rehearse `multislice status/watch/babysit/reset` by hand (README, "Rehearse
operations"): ``python -m scripts.emulators.tpu_emulator --port N [--seed FILE]``. The seed file
(JSON) lists queued resources to create at start, each through the same validation as a real
CreateQueuedResource, then put in a state or on a script::

    {"queued_resources": [
        {"stack_config": "stacks/Pulumi.seed-v5e.yaml", "state": "SUSPENDED"},
        {"parent": "projects/P/locations/Z", "id": "qr1", "body": {QueuedResource JSON},
         "script": [["ACCEPTED", 2], ["ACTIVE", null]]}]}

While it runs, its own control paths (never part of the TPU API's ``/v2/``) change it::

    POST /emulator/queuedResources/ID:setState   {"state": "SUSPENDED", "error": "..."}
    POST /emulator/faults                         {"status": 503, "count": 2, "method": "GET"}
    GET  /emulator/queuedResources                ids and states
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

QR_STATES = {
    "STATE_UNSPECIFIED": 0,
    "CREATING": 1,
    "ACCEPTED": 2,
    "PROVISIONING": 3,
    "FAILED": 4,
    "DELETING": 5,
    "ACTIVE": 6,
    "SUSPENDING": 7,
    "SUSPENDED": 8,
    "WAITING_FOR_RESOURCES": 9,
}
NODE_STATES = {"CREATING": 1, "READY": 2, "DELETING": 5, "REPAIRING": 6, "PREEMPTED": 11}
HEALTHY = 1
DEFAULT_SCRIPT: list[tuple[str, int | None]] = [
    ("ACCEPTED", 1),
    ("PROVISIONING", 1),
    ("ACTIVE", None),
]
QR_TYPE = "type.googleapis.com/google.cloud.tpu.v2.QueuedResource"
EMPTY_TYPE = "type.googleapis.com/google.protobuf.Empty"

# (queued resource id, slice index, host index) -> (ip, port) of that worker
EndpointFn = Callable[[str, int, int], tuple[str, int]]
GuestAttributesFn = Callable[[str, int, int], dict[str, str]]  # (qr id, slice, host) -> attributes

_HTTP_STATUS = {
    400: "FAILED_PRECONDITION",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    409: "ALREADY_EXISTS",
    429: "RESOURCE_EXHAUSTED",
    500: "INTERNAL",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}


def default_endpoint(qr_id: str, slice_index: int, host_index: int) -> tuple[str, int]:
    return (f"10.130.{slice_index}.{host_index + 2}", 8470)


MEGASCALE_PORT = 8080


def worker_metadata(accelerator_type: str, node_ids: list[str], endpoints: list[list[str]],
                    slice_index: int, host_index: int) -> dict[str, str]:
    """The instance attributes the TPU runtime gives worker ``host_index`` of slice
    ``slice_index`` of a queued resource: ``tpu-env`` (MEGASCALE_* for a multislice request),
    ``agent-worker-number`` and ``worker-network-endpoints`` (this slice's workers, in worker
    order, as ``unknown:unknown:ip``), which JAX's Cloud TPU cluster detection reads.
    ``endpoints[s][h]`` is the internal IP of worker h of slice s."""
    env = {
        "ACCELERATOR_TYPE": accelerator_type,
        "NODE_ID": node_ids[slice_index],
        "WORKER_ID": str(host_index),
        "TPU_PROCESS_BOUNDS": "",  # left to the runtime's defaults for the slice shape
    }
    if len(node_ids) > 1:
        env.update({
            "MEGASCALE_COORDINATOR_ADDRESS": f"{endpoints[0][0]}:{MEGASCALE_PORT}",
            "MEGASCALE_NUM_SLICES": str(len(node_ids)),
            "MEGASCALE_PORT": str(MEGASCALE_PORT),
            "MEGASCALE_SLICE_ID": str(slice_index),
        })
    # What a real TPU VM serves: "unknown:unknown:IP" per worker (JAX keeps the third field).
    workers = ",".join(f"unknown:unknown:{ip}" for ip in endpoints[slice_index])
    return {
        "tpu-env": "".join(f"{key}: '{value}'\n" for key, value in env.items()),
        "agent-worker-number": str(host_index),
        "worker-network-endpoints": workers,
        "accelerator-type": accelerator_type,
    }


def _hosts_per_slice(accelerator_type: str) -> int:
    try:
        from infra.stack_config.topology import parse_accelerator_type

        return parse_accelerator_type(accelerator_type).hosts
    except Exception:
        return 1


@dataclass
class _Fault:
    status: int | None
    count: int
    method: str | None
    contains: str | None
    delay_s: float
    message: str
    error_info: str = ""  # an ErrorInfo reason, such as SERVICE_DISABLED

    def matches(self, method: str, path: str) -> bool:
        return (self.method is None or self.method == method) and (
            self.contains is None or self.contains in path
        )


@dataclass
class _Queued:
    parent: str
    qr_id: str
    body: dict[str, Any]
    script: list[tuple[str, int | None]]
    error: str
    create_time: str
    step: int = 0
    polls: int = 0
    state: str = "CREATING"
    error_code: int = 9  # FAILED_PRECONDITION
    node_ids: list[str] = field(default_factory=list)
    linger: int | None = None  # GETs left in DELETING once its delete operation is done

    @property
    def name(self) -> str:
        return f"{self.parent}/queuedResources/{self.qr_id}"


@dataclass
class _Operation:
    name: str
    target: str  # queued resource name
    kind: str  # "create" | "delete" | "reset"
    polls_left: int
    response: dict[str, Any] | None = None


class TpuEmulator:
    """The emulator's state plus its HTTP server. Thread-safe; start on port 0 in tests."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        endpoint_fn: EndpointFn = default_endpoint,
        guest_attributes_fn: GuestAttributesFn | None = None,
        delete_polls: int = 1,
        reset_polls: int = 1,
        create_polls: int = 2,
        deleting_polls: int = 2,
    ) -> None:
        self.host = host
        self.port = port
        self.endpoint_fn = endpoint_fn
        # What each worker's guest agent publishes once booted ("hostkeys/ssh-ed25519": the
        # key's base64, as Google's guest agent writes its SSH host keys); none by default.
        self.guest_attributes_fn = guest_attributes_fn
        self._guest: dict[str, list[dict[str, str]]] = {}  # node name -> per worker
        self.delete_polls = delete_polls
        self.reset_polls = reset_polls
        # As the real API: a create's operation is done only after a few polls, and a deleted
        # queued resource still answers GET (state DELETING, its id taken) for a while after its
        # delete operation is done.
        self.create_polls = create_polls
        self.deleting_polls = deleting_polls
        self.resets: dict[str, int] = {}  # queued resource id -> ResetQueuedResource calls
        self.requests: list[tuple[str, str, dict[str, str], Any]] = []
        self._lock = threading.RLock()
        self._queued: dict[str, _Queued] = {}
        self._nodes: dict[str, dict[str, Any]] = {}
        self._ops: dict[str, _Operation] = {}
        self._scripts: dict[str, tuple[list[tuple[str, int | None]], str]] = {}
        self._faults: list[_Fault] = []
        self._op_ids = itertools.count(1)
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> TpuEmulator:
        handler = type("Handler", (_Handler,), {"emu": self})
        self._server = ThreadingHTTPServer((self.host, self.port), handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> TpuEmulator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # ---- control API -----------------------------------------------------------------------
    def script(self, qr_id: str, steps: list[tuple[str, int | None]], error: str = "") -> None:
        """Transitions for ``qr_id`` (applies at create, or right away if it already exists)."""
        for state, _ in steps:
            if state not in QR_STATES:
                raise ValueError(f"unknown state {state!r}; known: {', '.join(QR_STATES)}")
        with self._lock:
            self._scripts[qr_id] = (list(steps), error)
            qr = self._find(qr_id)
            if qr is not None:
                qr.script, qr.error, qr.step, qr.polls = list(steps), error, 0, 0
                self._enter(qr, steps[0][0])

    def set_state(self, qr_id: str, state: str, error: str = "") -> None:
        """Force a state now and hold it (e.g. SUSPENDED for a preemption, FAILED, ACTIVE)."""
        with self._lock:
            qr = self._require(qr_id)
            qr.script, qr.step, qr.polls = [(state, None)], 0, 0
            if error:
                qr.error = error
            self._enter(qr, state)

    def inject(
        self,
        status: int | None = None,
        count: int = 1,
        method: str | None = None,
        path_contains: str | None = None,
        delay_s: float = 0.0,
        message: str = "injected fault",
        error_info: str = "",
    ) -> None:
        """Answer the next ``count`` matching requests with ``status`` (after ``delay_s``);
        ``error_info`` adds a google.rpc.ErrorInfo with that reason, as Google APIs send (a 403
        SERVICE_DISABLED for an API enabled seconds ago)."""
        with self._lock:
            self._faults.append(_Fault(status, count, method, path_contains, delay_s, message,
                                       error_info))

    def clear_faults(self) -> None:
        """Forget every injected fault that has not fired yet (the API is healthy again)."""
        with self._lock:
            self._faults.clear()

    def state_of(self, qr_id: str) -> str | None:
        with self._lock:
            qr = self._find(qr_id)
            return qr.state if qr else None

    def queued_resource(self, qr_id: str) -> dict[str, Any] | None:
        with self._lock:
            qr = self._find(qr_id)
            return self._qr_json(qr) if qr else None

    def node_ids(self) -> list[str]:
        with self._lock:
            return sorted(n.rsplit("/", 1)[1] for n in self._nodes)

    def worker_metadata(self, qr_id: str, slice_index: int, host_index: int) -> dict[str, str]:
        """What the metadata server of that worker serves (``worker_metadata``), from the nodes
        this emulator made for the queued resource."""
        with self._lock:
            qr = self._require(qr_id)
            nodes = [self._nodes[f"{qr.parent}/nodes/{i}"] for i in qr.node_ids]
            endpoints = [[e["ipAddress"] for e in n["networkEndpoints"]] for n in nodes]
            return worker_metadata(nodes[0]["acceleratorType"], list(qr.node_ids), endpoints,
                                   slice_index, host_index)

    def count_requests(self, method: str, contains: str = "") -> int:
        with self._lock:
            return sum(1 for m, p, _, _ in self.requests if m == method and contains in p)

    # ---- state machine ---------------------------------------------------------------------
    def _find(self, qr_id: str) -> _Queued | None:
        for qr in self._queued.values():
            if qr.qr_id == qr_id:
                return qr
        return None

    def _require(self, qr_id: str) -> _Queued:
        qr = self._find(qr_id)
        if qr is None:
            raise KeyError(f"no queued resource {qr_id!r}; have {sorted(self._queued)}")
        return qr

    def _enter(self, qr: _Queued, state: str) -> None:
        qr.state = state
        if state in ("PROVISIONING", "ACTIVE"):
            self._make_nodes(qr, "READY" if state == "ACTIVE" else "CREATING")
        elif state == "SUSPENDING":
            for node_id in qr.node_ids:
                node = self._nodes.get(f"{qr.parent}/nodes/{node_id}")
                if node is not None:
                    node["state"] = NODE_STATES["PREEMPTED"]
        elif state in ("SUSPENDED", "FAILED"):
            # The API deletes the nodes of a suspended (preempted) or failed queued resource; the
            # request itself stays, holding quota, until it is deleted.
            self._drop_nodes(qr)

    def _advance(self, qr: _Queued) -> None:
        """One GET of the queued resource: count it and move along the script when due."""
        if qr.state == "DELETING":
            return
        qr.polls += 1
        dwell = qr.script[qr.step][1]
        if dwell is not None and qr.polls > dwell and qr.step + 1 < len(qr.script):
            qr.step += 1
            qr.polls = 1
            self._enter(qr, qr.script[qr.step][0])

    def _node_spec(self, qr: _Queued) -> dict[str, Any]:
        return (qr.body.get("tpu", {}).get("nodeSpec") or [{}])[0]

    def _make_nodes(self, qr: _Queued, node_state: str) -> None:
        spec = self._node_spec(qr)
        node = spec.get("node", {})
        multi = spec.get("multisliceParams")
        if multi:
            from infra.stack_config.names import node_ids

            ids = node_ids(multi.get("nodeIdPrefix") or qr.qr_id, int(multi["nodeCount"]))
        else:
            ids = [spec.get("nodeId") or qr.qr_id]
        hosts = _hosts_per_slice(node.get("acceleratorType", ""))
        qr.node_ids = ids
        for index, node_id in enumerate(ids):
            name = f"{qr.parent}/nodes/{node_id}"
            endpoints = []
            for host in range(hosts):
                ip, port = self.endpoint_fn(qr.qr_id, index, host)
                endpoints.append({"ipAddress": ip, "port": port})
            self._guest[name] = [
                dict(self.guest_attributes_fn(qr.qr_id, index, host))
                if self.guest_attributes_fn else {} for host in range(hosts)]
            self._nodes[name] = {
                **{k: v for k, v in node.items() if k != "schedulingConfig"},
                "name": name,
                "state": NODE_STATES[node_state],
                "health": HEALTHY,
                "networkEndpoints": endpoints,
                "queuedResource": qr.name,
                "multisliceNode": bool(multi),
                "id": str(abs(hash(name)) % 10**12),
            }

    def _drop_nodes(self, qr: _Queued) -> None:
        for node_id in qr.node_ids:
            self._nodes.pop(f"{qr.parent}/nodes/{node_id}", None)
            self._guest.pop(f"{qr.parent}/nodes/{node_id}", None)
        qr.node_ids = []

    def _qr_json(self, qr: _Queued) -> dict[str, Any]:
        state: dict[str, Any] = {}
        if QR_STATES[qr.state]:
            state["state"] = QR_STATES[qr.state]
        if qr.state == "FAILED":
            state["failedData"] = {
                "error": {"code": qr.error_code, "message": qr.error or "queued resource failed"}
            }
        out = {**qr.body, "name": qr.name, "createTime": qr.create_time, "state": state}
        return out

    def _new_op(self, qr: _Queued, kind: str, polls_left: int) -> _Operation:
        op = _Operation(
            name=f"{qr.parent}/operations/operation-{next(self._op_ids)}",
            target=qr.name,
            kind=kind,
            polls_left=polls_left,
        )
        self._ops[op.name] = op
        return op

    def _op_json(self, op: _Operation) -> dict[str, Any]:
        if op.polls_left > 0:
            return {"name": op.name}
        if op.kind == "delete":
            qr = self._queued.get(op.target)
            if qr is not None:
                self._drop_nodes(qr)
                if qr.linger is None:
                    qr.linger = self.deleting_polls
                if qr.linger <= 0:
                    self._queued.pop(op.target, None)
            return {"name": op.name, "done": True, "response": {"@type": EMPTY_TYPE}}
        qr = self._queued.get(op.target)
        body = self._qr_json(qr) if qr else {}
        return {"name": op.name, "done": True, "response": {"@type": QR_TYPE, **body}}

    def seed(self, items: list[dict[str, Any]], base_dir: Path | None = None) -> list[str]:
        """Create each queued resource of a seed (see the module doc) as a client's create
        would, then apply its ``state`` or ``script``. Returns their ids; raises SeedError naming
        the entry and what is wrong."""
        made = []
        for index, item in enumerate(items):
            where = f"queued_resources[{index}]"
            if not isinstance(item, dict):
                raise SeedError(f"{where}: expected an object, got {item!r}")
            unknown = sorted(set(item) - _SEED_KEYS)
            if unknown:
                raise SeedError(f"{where}: unknown key {unknown[0]!r}; allowed: "
                                f"{', '.join(sorted(_SEED_KEYS))}")
            for key, kind, what in (("stack_config", str, "a path"), ("parent", str, "a string"),
                                    ("id", str, "a string"), ("body", dict, "an object"),
                                    ("state", str, "a state name"), ("script", list,
                                                                     "a list of [STATE, polls]"),
                                    ("error", str, "a message")):
                if item.get(key) is not None and not isinstance(item[key], kind):
                    raise SeedError(f"{where}: {key} = {json.dumps(item[key])}: expected {what}")
            if any(not isinstance(step, list) for step in item.get("script") or []):
                raise SeedError(f"{where}: script = {json.dumps(item['script'])}: each step is a "
                                "[STATE, polls] list")
            if "stack_config" in item:
                parent, qr_id, body = _seed_from_stack(item["stack_config"], base_dir, where)
            else:
                missing = [k for k in ("parent", "id", "body") if k not in item]
                if missing:
                    raise SeedError(f"{where}: needs stack_config, or parent, id and body "
                                    f"(missing {', '.join(missing)})")
                parent, qr_id, body = str(item["parent"]), str(item["id"]), item["body"]
            state, script = item.get("state"), item.get("script")
            if state is not None and script is not None:
                raise SeedError(f"{where}: give state or script, not both")
            steps = [tuple(step) for step in script] if script is not None else None
            for step in steps or [(state or "ACTIVE", None)]:
                if len(step) != 2 or step[0] not in QR_STATES or not (
                        step[1] is None or (isinstance(step[1], int) and step[1] > 0)):
                    raise SeedError(f"{where}: {list(step)!r} is not a [STATE, polls] step; "
                                    f"states: {', '.join(QR_STATES)}; polls: a count > 0 or "
                                    "null (hold)")
            status, payload = self.handle("POST", f"/v2/{parent}/queuedResources",
                                          {"queuedResourceId": qr_id}, body)
            if status != 200:
                raise SeedError(f"{where}: the API refuses to create {qr_id!r}: "
                                f"{payload['error']['message']}")
            if steps is not None:
                self.script(qr_id, steps)  # type: ignore[arg-type]
            else:
                self.set_state(qr_id, state or "ACTIVE", error=str(item.get("error", "")))
            made.append(qr_id)
        return made

    def _control(self, method: str, path: str, body: Any) -> tuple[int, dict[str, Any]]:
        """The emulator's own paths (``/emulator/...``): what a person rehearsing by hand, or a
        process other than the test's, uses to change its state."""
        if method == "GET" and path == "/emulator/queuedResources":
            with self._lock:
                return 200, {"queuedResources": [
                    {"id": q.qr_id, "parent": q.parent, "state": q.state}
                    for q in self._queued.values()]}
        body = body if isinstance(body, dict) else {}
        m = re.fullmatch(r"/emulator/queuedResources/([^/:]+):setState", path)
        if method == "POST" and m:
            state = str(body.get("state", ""))
            if state not in QR_STATES:
                return _error(400, f"state {state!r} is not a queued resource state; allowed: "
                              f"{', '.join(QR_STATES)}")
            try:
                self.set_state(m.group(1), state, error=str(body.get("error", "")))
            except KeyError as exc:
                return _error(404, str(exc.args[0]))
            return 200, {"id": m.group(1), "state": state}
        if method == "POST" and path == "/emulator/faults":
            status, count = body.get("status"), body.get("count", 1)
            if status not in _HTTP_STATUS or not isinstance(count, int) or count < 1:
                return _error(400, f"a fault needs status one of {sorted(_HTTP_STATUS)} and a "
                              f"count >= 1; got status={status!r} count={count!r}")
            self.inject(status=status, count=count, method=body.get("method"),
                        path_contains=body.get("path_contains"),
                        message=str(body.get("message", "injected fault")),
                        error_info=str(body.get("error_info", "")))
            return 200, {"status": status, "count": count}
        return _error(404, f"no such control path: {method} {path}")

    # ---- HTTP dispatch (called by the handler with the lock free) --------------------------
    def handle(
        self, method: str, path: str, query: dict[str, str], body: Any
    ) -> tuple[int, dict[str, Any]]:
        if path.startswith("/emulator/"):
            return self._control(method, path, body)
        with self._lock:
            self.requests.append((method, path, query, body))
            fault = next((f for f in self._faults if f.count > 0 and f.matches(method, path)), None)
            if fault is not None:
                fault.count -= 1
        if fault is not None:
            if fault.delay_s:
                time.sleep(fault.delay_s)
            if fault.status is not None:
                return _error(fault.status, fault.message, error_info=fault.error_info)
        with self._lock:
            return self._route(method, path, query, body)

    def _route(
        self, method: str, path: str, query: dict[str, str], body: Any
    ) -> tuple[int, dict[str, Any]]:
        m = re.fullmatch(
            r"/v2/(projects/[^/]+/locations/[^/]+)/(\w+)(?:/([^/:]+))?(?::(\w+))?", path
        )
        if not m:
            return _error(404, f"no such method: {method} {path}")
        parent, collection, ident, verb = m.groups()
        if collection == "queuedResources":
            return self._queued_resources(method, parent, ident, verb, query, body)
        if collection == "nodes" and verb == "getGuestAttributes" and method == "POST":
            return self._guest_attributes(f"{parent}/nodes/{ident}", body or {})
        if collection == "nodes" and verb is None:
            return self._nodes_route(method, parent, ident)
        if collection == "operations" and ident and method == "GET":
            op = self._ops.get(f"{parent}/operations/{ident}")
            if op is None:
                return _error(404, f"operation {ident!r} not found")
            if op.polls_left > 0:
                op.polls_left -= 1
            return 200, self._op_json(op)
        return _error(404, f"no such method: {method} {path}")

    def _queued_resources(
        self,
        method: str,
        parent: str,
        ident: str | None,
        verb: str | None,
        query: dict[str, str],
        body: Any,
    ) -> tuple[int, dict[str, Any]]:
        if ident is None and method == "POST":
            qr_id = query.get("queuedResourceId") or query.get("queued_resource_id")
            if not qr_id:
                return _error(400, "queuedResourceId is required")
            name = f"{parent}/queuedResources/{qr_id}"
            problem = create_problem(parent, qr_id, body)
            if problem:
                return _error(400, problem, "INVALID_ARGUMENT")
            if name in self._queued:
                return _error(409, f"queued resource {name!r} already exists")
            steps, error = self._scripts.get(qr_id, (DEFAULT_SCRIPT, ""))
            qr = _Queued(
                parent=parent,
                qr_id=qr_id,
                body=dict(body or {}),
                script=list(steps),
                error=error,
                create_time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            )
            self._queued[name] = qr
            # The API's first state of every create; the script starts at the next GET.
            if steps[0][0] != "CREATING":
                qr.script.insert(0, ("CREATING", 1))
            self._enter(qr, qr.script[0][0])
            return 200, self._op_json(self._new_op(qr, "create", self.create_polls))
        if ident is None and method == "GET":
            items = [
                self._qr_json(q) for n, q in sorted(self._queued.items()) if n.startswith(parent)
            ]
            return 200, ({"queuedResources": items} if items else {})
        name = f"{parent}/queuedResources/{ident}"
        qr = self._queued.get(name)
        if qr is None:
            return _error(404, f"queued resource {name!r} not found")
        if method == "GET" and verb is None:
            if qr.linger is not None:  # deleted: DELETING for a few more GETs, then gone
                if qr.linger <= 0:
                    del self._queued[name]
                    return _error(404, f"queued resource {name!r} not found")
                qr.linger -= 1
            self._advance(qr)
            return 200, self._qr_json(qr)
        if method == "DELETE" and verb is None:
            force = query.get("force", "false").lower() == "true"
            # The proto's rule: without force, only once its nodes are gone or in ACCEPTED,
            # FAILED or SUSPENDED.
            has_nodes = any(f"{qr.parent}/nodes/{i}" in self._nodes for i in qr.node_ids)
            if not force and has_nodes and qr.state not in ("ACCEPTED", "FAILED", "SUSPENDED"):
                return _error(400, f"queued resource {name!r} is {qr.state} and has nodes; "
                              "delete them first or delete with force=true")
            qr.state = "DELETING"
            return 200, self._op_json(self._new_op(qr, "delete", self.delete_polls))
        if method == "POST" and verb == "reset":
            # ResetQueuedResource resets every VM of an ACTIVE queued resource (memory cleared,
            # local data kept, startup script run again); the request itself stays ACTIVE.
            if qr.state != "ACTIVE":
                return _error(400, f"queued resource {name!r} is {qr.state}; only an ACTIVE "
                              "queued resource can be reset")
            self.resets[qr.qr_id] = self.resets.get(qr.qr_id, 0) + 1
            for node_id in qr.node_ids:
                node = self._nodes.get(f"{qr.parent}/nodes/{node_id}")
                if node is not None:
                    node["state"] = NODE_STATES["READY"]
            return 200, self._op_json(self._new_op(qr, "reset", self.reset_polls))
        return _error(404, f"no such method: {method} {name}:{verb}")

    def _nodes_route(
        self, method: str, parent: str, ident: str | None
    ) -> tuple[int, dict[str, Any]]:
        if method != "GET":
            return _error(404, f"no such method: {method} nodes")
        if ident is None:
            items = [n for name, n in sorted(self._nodes.items()) if name.startswith(parent)]
            return 200, ({"nodes": items} if items else {})
        node = self._nodes.get(f"{parent}/nodes/{ident}")
        if node is None:
            return _error(404, f"node {parent}/nodes/{ident} not found")
        return 200, node

    def _guest_attributes(self, name: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """nodes.getGuestAttributes: for each worker asked (all when workerIds is empty), the
        values under queryPath, as {namespace, key, value} items."""
        if name not in self._nodes:
            return _error(404, f"node {name} not found")
        per_worker = self._guest.get(name, [])
        asked = body.get("workerIds") or [str(i) for i in range(len(per_worker))]
        path = body.get("queryPath", "")
        answers = []
        for worker in asked:
            if not str(worker).isdigit() or int(worker) >= len(per_worker):
                return _error(400, f"worker id {worker!r} is not a worker of {name}")
            items = [{"namespace": key.split("/", 1)[0], "key": key.split("/", 1)[1],
                      "value": value}
                     for key, value in sorted(per_worker[int(worker)].items())
                     if key.startswith(path)]
            answers.append({"queryPath": path, "queryValue": {"items": items} if items else {}})
        return 200, {"guestAttributes": answers}


def _error(status: int, message: str, reason: str | None = None,
           error_info: str = "") -> tuple[int, dict[str, Any]]:
    error: dict[str, Any] = {"code": status, "message": message,
                             "status": reason or _HTTP_STATUS.get(status, "UNKNOWN")}
    if error_info:
        error["details"] = [{"@type": "type.googleapis.com/google.rpc.ErrorInfo",
                             "reason": error_info, "domain": "googleapis.com",
                             "metadata": {"service": "tpu.googleapis.com"}}]
    return status, {"error": error}


_ID_RE = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
_RESERVATION_RE = re.compile(r"^projects/[^/]+/locations/[^/]+/reservations/[^/]+$")
# camelCase fields of QueuedResource / its Node that a create may carry (google.cloud.tpu.v2);
# Google APIs refuse unknown JSON names ("Invalid JSON payload received. Unknown name").
_QR_FIELDS = {"tpu", "spot", "guaranteed", "queueingPolicy", "reservationName", "name",
              "createTime", "state"}
_NODE_FIELDS = {"name", "description", "acceleratorType", "state", "healthDescription",
                "runtimeVersion", "networkConfig", "networkConfigs", "cidrBlock",
                "serviceAccount", "createTime", "schedulingConfig", "networkEndpoints", "health",
                "labels", "metadata", "tags", "id", "dataDisks", "apiVersion", "symptoms",
                "shieldedInstanceConfig", "acceleratorConfig", "queuedResource",
                "multisliceNode", "bootDiskConfig", "upcomingMaintenance"}


class SeedError(ValueError):
    """A seed entry the emulator cannot load; the message names the entry."""


_SEED_KEYS = {"stack_config", "parent", "id", "body", "state", "script", "error"}


def _seed_from_stack(path: str, base_dir: Path | None, where: str) -> tuple[str, str, Any]:
    """(parent, id, REST body) of the queued resource the Pulumi program requests for a stack."""
    from google.cloud import tpu_v2

    from infra.stack_config import manifest
    from infra.stack_config.schema import StackConfigError
    from infra.stack_config.validation import load_stack_file
    from infra.tpu_vm.request import build_queued_resource_request

    file = Path(path) if base_dir is None or Path(path).is_absolute() else base_dir / path
    try:
        cfg = load_stack_file(file, check_files=False)
    except StackConfigError as exc:
        raise SeedError(f"{where}: stack_config {str(file)!r}: {'; '.join(exc.problems)}") from None
    except OSError as exc:
        raise SeedError(f"{where}: stack_config {str(file)!r}: {exc.strerror}") from None
    request = build_queued_resource_request(manifest.queued_resource_spec(cfg))
    body = json.loads(tpu_v2.QueuedResource.to_json(  # proto3 JSON: defaults omitted, as sent
        tpu_v2.QueuedResource(request["queued_resource"]),
        always_print_fields_with_no_presence=False))
    return request["parent"], request["queued_resource_id"], body


def create_problem(parent: str, qr_id: str, body: Any) -> str:
    """Why the real API would refuse this CreateQueuedResource request ("" when it would not)."""
    if not _ID_RE.match(qr_id):
        return f"queuedResourceId {qr_id!r} must match {_ID_RE.pattern}"
    if not isinstance(body, dict):
        return "the request body must be a QueuedResource object"
    unknown = sorted(set(body) - _QR_FIELDS)
    if unknown:
        return f"Invalid JSON payload received. Unknown name {unknown[0]!r} at 'queued_resource'"
    if "spot" in body and "guaranteed" in body:
        return "spot and guaranteed are one tier (a oneof): set at most one"
    reservation = body.get("reservationName")
    if reservation is not None and not _RESERVATION_RE.match(str(reservation)):
        return (f"reservationName {reservation!r} must be "
                "projects/{project}/locations/{zone}/reservations/{reservation}")
    specs = (body.get("tpu") or {}).get("nodeSpec") or []
    if not specs:
        return "tpu.nodeSpec is required"
    for index, spec in enumerate(specs):
        where = f"tpu.nodeSpec[{index}]"
        if spec.get("parent") != parent:
            return f"{where}.parent {spec.get('parent')!r} must be the request's parent {parent!r}"
        node = spec.get("node") or {}
        unknown = sorted(set(node) - _NODE_FIELDS)
        if unknown:
            return f"Invalid JSON payload received. Unknown name {unknown[0]!r} at '{where}.node'"
        if not node.get("acceleratorType") and not node.get("acceleratorConfig"):
            return f"{where}.node: acceleratorType or acceleratorConfig is required"
        if not node.get("runtimeVersion"):
            return f"{where}.node.runtimeVersion is required"
        multi = spec.get("multisliceParams")
        if multi is not None and spec.get("nodeId"):
            return f"{where}: nodeId and multisliceParams are exclusive"
        if multi is None and not spec.get("nodeId"):
            return f"{where}: nodeId or multisliceParams is required"
        if multi is not None:
            count = int(multi.get("nodeCount") or 0)
            if count <= 1:
                return f"{where}.multisliceParams.nodeCount is {count}; it needs to be > 1"
            if len(specs) != 1:
                return "a multislice request (multisliceParams) takes exactly one nodeSpec"
    return ""


class _Handler(BaseHTTPRequestHandler):
    emu: TpuEmulator
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass

    def _serve(self, method: str) -> None:
        parts = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            body = json.loads(raw) if raw else None
        except json.JSONDecodeError:
            status, payload = _error(400, "request body is not JSON")
        else:
            status, payload = self.emu.handle(method, parts.path, query, body)
        data = json.dumps(payload).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json; charset=UTF-8")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (e.g. its timeout fired during an injected delay)

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def do_DELETE(self) -> None:
        self._serve("DELETE")

    def do_PATCH(self) -> None:
        self._serve("PATCH")


def main(argv: list[str] | None = None) -> int:
    import warnings

    from scripts.argtypes import int_range

    # google-api-core's notice about this Python's end of support, as in scripts/cli.py.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"google(\.|$)")

    parser = argparse.ArgumentParser(
        prog="python -m scripts.emulators.tpu_emulator", allow_abbrev=False,
        description="Local Cloud TPU API v2 emulator (loopback). Change it while it runs with "
                    "POST /emulator/queuedResources/ID:setState {\"state\": \"SUSPENDED\"} "
                    "or POST /emulator/faults {\"status\": 503, \"count\": 2}.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int_range(0, 65535), default=8470,
                        help="TCP port (default 8470; 0: any free port)")
    parser.add_argument("--seed", type=Path, metavar="FILE",
                        help='JSON {"queued_resources": [...]} to create at start (module doc)')
    args = parser.parse_args(argv)
    emu = TpuEmulator(host=args.host, port=args.port)
    if args.seed is not None:
        try:
            seed = json.loads(args.seed.read_text(encoding="utf-8"))
            items = seed["queued_resources"] if isinstance(seed, dict) else None
            if not isinstance(items, list):
                raise SeedError('expected {"queued_resources": [...]} at the top level')
            made = emu.seed(items, base_dir=Path.cwd())
        except (OSError, ValueError, KeyError) as exc:
            reason = f"missing key {exc}" if isinstance(exc, KeyError) else str(exc)
            parser.error(f"--seed {args.seed}: {reason}")
        for qr_id in made:
            print(f"seeded queued resource {qr_id}: {emu.state_of(qr_id)}", flush=True)
    try:
        emu.start()
    except OSError as exc:
        parser.error(f"--port {args.port}: cannot listen on {args.host} ({exc.strerror})")
    print(
        f"TPU API emulator on {emu.url}  (export MULTISLICE_TPU_API_ENDPOINT={emu.url})", flush=True
    )
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        emu.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

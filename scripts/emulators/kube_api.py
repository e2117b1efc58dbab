"""A Kubernetes API server on loopback: kmock's in-memory emulator (the real REST protocol, what
the official client and `multislice status | watch | babysit` speak), run on a thread of its own.

Test and rehearsal support, never production. Objects are put, read and removed on the server's
event loop, as its own requests would be; a deleted object reads as None.

What the real API server does and kmock lacks is added where the toolkit relies on it
(Kubernetes API conventions, "Object metadata" and DeleteOptions; "Authorization": checking API
access): every object created gets a new `metadata.uid`; a DELETE whose body's
`preconditions.uid` is not the object's UID (the object was deleted and created again meanwhile)
is refused with 409 Conflict, deleting nothing; a SelfSubjectAccessReview is answered.
"""

from __future__ import annotations

import asyncio
import re
import threading
import uuid
from collections.abc import Mapping
from typing import Any

import aiohttp.web
import attrs
import kmock

JOBSETS = kmock.resource("jobset.x-k8s.io", "v1alpha2", "jobsets")
PODS = kmock.resource("", "v1", "pods")
NAMESPACES = kmock.resource("", "v1", "namespaces")
_NAMESPACE_PATH = re.compile(r"/api/v1/namespaces/([a-z0-9-]+)")
WORKLOADS = kmock.resource("kueue.x-k8s.io", "v1beta1", "workloads")
LOCAL_QUEUES = kmock.resource("kueue.x-k8s.io", "v1beta1", "localqueues")
_PENDING_PATH = re.compile(r"/apis/visibility\.kueue\.x-k8s\.io/v1beta1/namespaces/"
                           r"([a-z0-9-]+)/localqueues/([a-z0-9.-]+)/pendingworkloads")


def _plain(value: Any) -> Any:
    """kmock's stored object (its own Mapping types, nested) as plain JSON values."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


@attrs.frozen
class PreconditionFailed(kmock.KubernetesError):
    status: int = 409
    reason: str = "Conflict"
    message: str = "Precondition failed: UID in precondition does not match the UID in record"


class ApiServer(kmock.KubernetesEmulator):
    """kmock's emulator with UIDs and delete preconditions (module docstring), and the
    authorization API's SelfSubjectAccessReview: allowed unless its (verb, resource, namespace)
    is in `denied`, as RBAC answers a user without that rule."""

    denied: set[tuple[str, str, str]] = set()
    forbidden_paths: set[str] = set()  # GETs RBAC refuses this user (403 Forbidden)

    def _stored(self, resource: Any) -> list[tuple[str | None, dict[str, Any]]]:
        return [(key[1], _plain(obj.raw)) for key, obj in self._objects.items()
                if key[0] == resource and not obj.deleted]

    def _pending_workloads(self, namespace: str, local_queue: str) -> dict[str, Any]:
        """Kueue's visibility API (v1beta1 PendingWorkloadsSummary): the pending workloads of a
        LocalQueue in Kueue's order (priority, then creation), each with its place in the
        LocalQueue and among the pending workloads of every LocalQueue of its ClusterQueue."""
        queues = {(ns, q["metadata"]["name"]): q["spec"]["clusterQueue"]
                  for ns, q in self._stored(LOCAL_QUEUES)}
        cluster_queue = queues.get((namespace, local_queue))

        def pending(ns: str | None, w: dict[str, Any]) -> bool:
            conditions = {c["type"]: c["status"] for c in
                          (w.get("status") or {}).get("conditions") or []}
            return conditions.get("Admitted") != "True" and conditions.get("Finished") != "True"

        order = sorted(((ns, w) for ns, w in self._stored(WORKLOADS) if pending(ns, w)),
                       key=lambda nw: (-int(nw[1]["spec"].get("priority") or 0),
                                       nw[1]["metadata"].get("creationTimestamp", "")))
        in_cq = [(ns, w) for ns, w in order
                 if queues.get((ns, w["spec"].get("queueName"))) == cluster_queue]
        in_lq = [(ns, w) for ns, w in in_cq if ns == namespace
                 and w["spec"].get("queueName") == local_queue]
        return {"kind": "PendingWorkloadsSummary", "items": [
            {"metadata": {"name": w["metadata"]["name"], "namespace": ns},
             "priority": int(w["spec"].get("priority") or 0), "localQueueName": local_queue,
             "positionInLocalQueue": i, "positionInClusterQueue": in_cq.index((ns, w))}
            for i, (ns, w) in enumerate(in_lq)]}

    async def _handle(self, request: Any) -> Any:
        if (match := _PENDING_PATH.fullmatch(request.url.path)) is not None and \
                request.url.path not in self.forbidden_paths:
            return aiohttp.web.json_response(self._pending_workloads(match[1], match[2]))
        if request.url.path in self.forbidden_paths:
            return aiohttp.web.json_response(
                {"apiVersion": "v1", "kind": "Status", "status": "Failure", "code": 403,
                 "reason": "Forbidden", "message": f"{request.url.path} is forbidden"},
                status=403)
        match = _NAMESPACE_PATH.fullmatch(request.url.path)
        if match is not None and request.method == kmock.method.GET:
            # kmock reads /api/v1/namespaces/NAME as a resource NAME of every namespace
            key = (NAMESPACES, None, match[1])
            if key not in self._objects or self._objects[key].deleted:
                return aiohttp.web.json_response(
                    {"apiVersion": "v1", "kind": "Status", "status": "Failure", "code": 404,
                     "reason": "NotFound", "message": f'namespaces "{match[1]}" not found'},
                    status=404)
            return aiohttp.web.json_response(_plain(self._objects[key].raw))
        resource = request.resource
        if resource is not None and resource.plural == "selfsubjectaccessreviews":
            spec = (request.data or {}).get("spec") or {}
            asked = spec.get("resourceAttributes") or {}
            key = (asked.get("verb", ""), asked.get("resource", ""), asked.get("namespace", ""))
            return aiohttp.web.json_response(
                {**request.data, "status": {"allowed": key not in self.denied}}, status=201)
        if request.resource is not None and isinstance(request.data, dict):
            if request.action == kmock.action.CREATE:
                request.data.setdefault("metadata", {})["uid"] = str(uuid.uuid4())
            elif request.action == kmock.action.DELETE and request.name is not None:
                wanted = (request.data.get("preconditions") or {}).get("uid")
                key = (request.resource, request.namespace, request.name)
                if wanted and key in self._objects and not self._objects[key].deleted and \
                        self._objects[key].get("metadata", {}).get("uid") != wanted:
                    raise PreconditionFailed()
        return await super()._handle(request)


class KubeApi:
    def __init__(self) -> None:
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self.url = ""
        self._thread = threading.Thread(target=lambda: asyncio.run(self._serve()), daemon=True)

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        async with ApiServer() as emulator, kmock.Server(emulator) as server:
            self.emulator = emulator
            self.url = str(server.url).rstrip("/")
            self._ready.set()
            await self._stop.wait()

    def __enter__(self) -> KubeApi:
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the Kubernetes API emulator (kmock) did not start in 30 s")
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    def put(self, resource: Any, name: str, body: dict[str, Any],
            namespace: str | None) -> None:
        """`namespace` None: a cluster-scoped object."""
        async def put() -> None:
            self.emulator.objects[resource, namespace, name] = body

        self._run(put())

    def get(self, resource: Any, name: str, namespace: str | None) -> dict[str, Any] | None:
        async def get() -> dict[str, Any] | None:
            try:
                found = self.emulator.objects[resource, namespace, name]
            except KeyError:
                return None
            return _plain(found) or None

        return self._run(get())

    def remove(self, resource: Any, name: str, namespace: str | None) -> None:
        async def remove() -> None:
            self.emulator.objects[resource, namespace, name].delete()

        self._run(remove())

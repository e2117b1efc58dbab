"""`multislice status | watch | babysit | reset`: follow and heal a queued resource.

Every command names one queued resource by `--project`, `--zone` and its id, or reads them from a
stack config (`--stack-config Pulumi.<stack>.yaml`, parsed by the infra schema); explicit flags win
over the stack config. All TPU API calls go through `infra.tpu_vm.api.make_tpu_client()`, so
`MULTISLICE_TPU_API_ENDPOINT` points them at an emulator.

Every call has a per-request timeout (`--request-timeout`, default 30 s): a server that accepts
the connection and never answers makes the command fail with one line, not hang.

Exit codes (all four commands):
    0  status printed / ACTIVE reached / babysit finished / reset done
    1  the TPU API failed, answered something unreadable, or the queued resource does not exist
       (reset: it is not ACTIVE)
    2  invalid arguments, stack config or MULTISLICE_TPU_API_ENDPOINT
    3  watch: the queued resource is FAILED or SUSPENDED; babysit: gave up after --max-retries
    4  watch: --timeout passed first; babysit: cancelled a request waiting past --max-wait
  130  interrupted (Ctrl-C)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from infra.tpu_vm.api import BROKEN_STATES
from scripts.argtypes import non_negative_int, non_negative_seconds, positive_seconds, report_error
from scripts.tpu.target import (
    EXIT_API,
    EXIT_BAD_STATE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_TIMEOUT,
    EXIT_USAGE,
    NOT_FOUND,
    Target,
    TargetError,
    add_target_arguments,
    get_queued_resource,
    polling_for,
    resolve_target,
    retry_for,
    state_detail,
)


@dataclass
class NodeRow:
    node_id: str
    state: str
    health: str
    hosts: int
    description: str = ""


@dataclass
class Snapshot:
    """What `status` shows: the queued resource and each node it asks for."""

    name: str
    state: str
    detail: str
    capacity: str
    accelerator_type: str
    runtime_version: str
    slices: int
    create_time: str
    nodes: list[NodeRow] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def capacity_of(qr: Any) -> str:
    if "spot" in qr:
        return "spot"
    if "guaranteed" in qr:
        return "guaranteed"
    if qr.reservation_name:
        if qr.reservation_name.endswith("/reservations/-"):
            return "reserved (any reservation)"
        return f"reserved ({qr.reservation_name.rsplit('/', 1)[-1]})"
    return "on-demand"


def list_nodes(client: Any, target: Target) -> dict[str, Any]:
    """Nodes in the zone by id (one paged call, whatever the slice count)."""
    pager = client.list_nodes(parent=target.parent, retry=retry_for(target),
                              timeout=target.request_timeout_s)
    return {node.name.rsplit("/", 1)[-1]: node for node in pager}


def snapshot(client: Any, target: Target, qr: Any | None = None) -> Snapshot | None:
    """The queued resource's state and its nodes' state and health; None when it does not exist."""
    from infra.stack_config.topology import UnknownAcceleratorError, parse_accelerator_type

    qr = qr if qr is not None else get_queued_resource(client, target)
    if qr is None:
        return None
    from infra.tpu_vm.api import node_ids_of

    wanted = node_ids_of(qr, default_prefix=target.qr_id)
    nodes = list_nodes(client, target) if wanted else {}
    rows = []
    for node_id, accelerator in wanted:
        node = nodes.get(node_id)
        try:
            hosts = parse_accelerator_type(accelerator).hosts
        except UnknownAcceleratorError:
            hosts = 0
        if node is None:
            rows.append(NodeRow(node_id, "NOT_CREATED", "-", hosts))
            continue
        health = node.health.name if node.health else "-"
        rows.append(NodeRow(node_id, node.state.name, health,
                            len(node.network_endpoints) or hosts, node.health_description))
    first = qr.tpu.node_spec[0].node if qr.tpu.node_spec else None
    created = qr.create_time.strftime("%Y-%m-%dT%H:%M:%SZ") if "create_time" in qr else ""
    return Snapshot(
        name=qr.name or target.name,
        state=qr.state.state.name,
        detail=state_detail(qr),
        capacity=capacity_of(qr),
        accelerator_type=first.accelerator_type if first else "",
        runtime_version=first.runtime_version if first else "",
        slices=len(wanted),
        create_time=created,
        nodes=rows,
    )


# ---- showing it --------------------------------------------------------------------------------

_STATE_STYLE = {"ACTIVE": "green", "READY": "green", "HEALTHY": "green", "FAILED": "red",
                "SUSPENDED": "red", "PREEMPTED": "red", "SUSPENDING": "yellow"}


def _styled(value: str) -> str:
    style = _STATE_STYLE.get(value)
    return f"[{style}]{value}[/{style}]" if style else value


def status_renderable(target: Target, snap: Snapshot | None) -> Any:
    from rich.console import Group
    from rich.table import Table

    if snap is None:
        return Group(f"queued resource {target.qr_id} ({target.parent}): [red]{NOT_FOUND}[/red]")
    summary = Table.grid(padding=(0, 2))
    summary.add_column(style="bold")
    summary.add_column(overflow="fold")
    summary.add_row("queued resource", snap.name)
    summary.add_row("state", _styled(snap.state) + (f"  ({snap.detail})" if snap.detail else ""))
    summary.add_row("accelerator", f"{snap.slices} x {snap.accelerator_type}  "
                                   f"runtime {snap.runtime_version or '-'}")
    summary.add_row("capacity", snap.capacity)
    summary.add_row("created", snap.create_time or "-")
    nodes = Table(title=None, show_lines=False)
    for column in ("node", "state", "health", "hosts", "description"):
        nodes.add_column(column, overflow="fold")
    for row in snap.nodes:
        nodes.add_row(row.node_id, _styled(row.state), _styled(row.health), str(row.hosts),
                      row.description)
    return Group(summary, nodes)


PIPE_WIDTH = 1000  # columns when stdout is a pipe or a file: no id is folded across lines


def _console(no_color: bool = False) -> Any:
    """A terminal gets its own width; a pipe or a file gets every column whole (rich would
    otherwise assume 80 columns and fold long ids), unless COLUMNS says otherwise."""
    import os

    from rich.console import Console

    width = None if sys.stdout.isatty() or os.environ.get("COLUMNS") else PIPE_WIDTH
    return Console(no_color=no_color, highlight=False, width=width)


def _utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


# ---- commands ----------------------------------------------------------------------------------


def run_status(client: Any, target: Target, console: Any, as_json: bool = False,
               storage_client: Any = None) -> int:
    from scripts.tpu.spec_report import read_spec_report, spec_renderable

    snap = snapshot(client, target)
    # With a stack config: which launch spec each VM runs, from their reports in the bucket.
    specs = read_spec_report(target.stack, storage_client) if target.stack is not None else None
    if as_json:
        payload = snap.to_json() if snap else {"name": target.name, "state": NOT_FOUND}
        if specs is not None:
            payload["launch_spec"] = specs.to_json()
        sys.stdout.write(json.dumps(payload, indent=2, sort_keys=True) + "\n")  # never wrapped
    else:
        console.print(status_renderable(target, snap))
        if specs is not None:
            from scripts.logs import logging_link

            console.print(spec_renderable(specs), soft_wrap=True)
            console.print(f"logs: multislice logs --stack-config FILE [--follow]; Cloud "
                          f"Logging: {logging_link(target.stack)}", soft_wrap=True, markup=False)
    return EXIT_OK if snap is not None else EXIT_API


def run_watch(
    client: Any,
    target: Target,
    console: Any,
    interval_s: float = 10.0,
    timeout_s: float = 3600.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """Poll until ACTIVE (0), FAILED/SUSPENDED (3) or the timeout (4), printing every change.

    ``timeout_s`` 0 means no limit, as in babysit.
    """
    from contextlib import nullcontext

    from rich.live import Live

    start = clock()
    last: str | None = None
    live = Live(console=console, refresh_per_second=4) if console.is_terminal else None
    with live or nullcontext():
        while True:
            qr = get_queued_resource(client, target)
            state = qr.state.state.name if qr is not None else NOT_FOUND
            snap = snapshot(client, target, qr) if qr is not None else None
            if live is not None:
                live.update(status_renderable(target, snap))
            if state != last:
                detail = f" ({snap.detail})" if snap and snap.detail else ""
                hint = " (not created yet, or wrong id/project/zone)" if qr is None else ""
                console.print(f"{_utc_now()} {target.qr_id}: {state}{detail}{hint}",
                              soft_wrap=True, markup=False)
                last = state
            if state == "ACTIVE":
                return EXIT_OK
            if state in BROKEN_STATES:
                return EXIT_BAD_STATE
            elapsed = clock() - start
            if timeout_s and elapsed >= timeout_s:
                console.print(f"{_utc_now()} {target.qr_id}: still {state} after "
                              f"{elapsed:.1f}s; giving up (--timeout {timeout_s:g})",
                              soft_wrap=True, markup=False)
                return EXIT_TIMEOUT
            sleep(min(interval_s, max(0.0, timeout_s - elapsed)) if timeout_s else interval_s)


def run_reset(client: Any, target: Target, log: Any, op_timeout_s: float = 600.0,
              interval_s: float = 2.0) -> int:
    """ResetQueuedResource: reset every VM of an ACTIVE queued resource.

    Each VM's memory is cleared and it restarts from its initial state; local data is kept and
    the startup script runs again, so training resumes from the latest checkpoint (the guide's
    'Reset your QR'). A SUSPENDED or FAILED request cannot be reset: babysit recreates those.
    """
    from google.api_core import exceptions

    qr = get_queued_resource(client, target)
    if qr is None:
        log.record("reset_failed", target, f"{target.name} does not exist")
        return EXIT_API
    state = qr.state.state.name
    if state != "ACTIVE":
        log.record("reset_failed", target,
                   f"state is {state}; reset restarts the VMs of an ACTIVE queued resource. "
                   + ("A SUSPENDED or FAILED one never recovers by itself: `multislice babysit` "
                      "recreates it" if state in BROKEN_STATES else "Wait until it is ACTIVE"),
                   state=state)
        return EXIT_API
    log.record("reset", target, "requested by the user: every VM restarts (memory cleared, "
               "local data kept, startup script run again)", state=state)
    try:
        operation = client.reset_queued_resource(
            name=target.name, retry=retry_for(target), timeout=target.request_timeout_s)
        operation.result(polling=polling_for(interval_s, op_timeout_s))
    except exceptions.GoogleAPICallError as exc:
        log.record("reset_failed", target,
                   f"the TPU API refused the reset of this {state} queued resource: "
                   f"{exc.message}", state=state)
        return EXIT_API
    after = get_queued_resource(client, target)
    log.record("reset_done", target, "every VM was reset; the startup script runs again and "
               "training resumes from the latest checkpoint",
               state=after.state.state.name if after is not None else NOT_FOUND)
    return EXIT_OK


def register(subparsers: argparse._SubParsersAction) -> None:
    epilog = ("A GKE stack (multislice:orchestration: gke, named by --stack-config) is read "
              "through the Kubernetes API instead: its JobSet and pods. Exit codes: 0 ok, 1 API "
              "error or not found, 2 bad arguments, 3 FAILED/SUSPENDED or a Failed JobSet "
              "(watch) or retries exhausted (babysit), 4 timeout (watch) or request cancelled "
              "after --max-wait (babysit), 130 Ctrl-C.")
    status = subparsers.add_parser(
        "status", help="show a queued resource and its nodes, or a GKE stack's JobSet and pods",
        description="The queued resource, its nodes' state and health, and with --stack-config "
        "which launch spec (generation and code hash) each VM runs, read from what the VMs "
        "report to the stack's bucket (RUN_DIR/logs/HOST.spec). For a GKE stack: its JobSet "
        "(state, restarts) and every pod by slice with its node and launch spec.",
        epilog=epilog)
    add_target_arguments(status)
    status.add_argument("--json", action="store_true", help="print JSON instead of a table")
    status.set_defaults(func=main, action="status")

    watch = subparsers.add_parser(
        "watch", help="follow a queued resource until ACTIVE or FAILED, or a GKE stack's JobSet "
        "until every pod is ready or it fails", epilog=epilog)
    add_target_arguments(watch)
    watch.add_argument("--interval", type=positive_seconds, default=10.0, metavar="S",
                       help="seconds between polls (default 10)")
    watch.add_argument("--timeout", type=non_negative_seconds, default=3600.0, metavar="S",
                       help="give up after S seconds (default 3600; 0: no limit)")
    watch.set_defaults(func=main, action="watch")

    babysit = subparsers.add_parser(
        "babysit", epilog=epilog,
        help="keep a queued resource alive (recreate it when SUSPENDED or FAILED), or a GKE "
        "stack's JobSet (recreate it when Failed)",
        description="Recreates a SUSPENDED or FAILED queued resource (both still hold quota) with "
        "the same spec, with bounded retries and exponential backoff; cancels a request that "
        "waits longer than --max-wait. For a GKE stack it recreates a Failed JobSet (deleted "
        "in the foreground, created again as pulumi up applied it); a Completed one ends it. "
        "Every action is printed with its reason.")
    add_target_arguments(babysit)
    babysit.add_argument("--interval", type=positive_seconds, default=30.0, metavar="S",
                         help="seconds between polls (default 30)")
    babysit.add_argument("--max-retries", type=non_negative_int, default=5, metavar="N",
                         help="recreations allowed before giving up (default 5; reset by ACTIVE)")
    babysit.add_argument("--backoff", type=non_negative_seconds, default=30.0, metavar="S",
                         help="wait before the first recreation, doubled each retry (default 30)")
    babysit.add_argument("--backoff-max", type=non_negative_seconds, default=900.0, metavar="S",
                         help="cap on the backoff (default 900)")
    babysit.add_argument("--max-wait", type=non_negative_seconds, default=None, metavar="S",
                         help="cancel a request still ACCEPTED/WAITING_FOR_RESOURCES S seconds "
                         "after its creation (default: the stack's wait_for_active_s, else never)")
    babysit.add_argument("--timeout", type=non_negative_seconds, default=0.0, metavar="S",
                         help="stop babysitting after S seconds (default 0: run until stopped)")
    babysit.add_argument("--until-active", action="store_true",
                         help="exit 0 as soon as the queued resource is ACTIVE")
    babysit.add_argument("--recreate-missing", action="store_true",
                         help="create the queued resource when it does not exist (from the last "
                         "spec seen, or rebuilt from --stack-config); off by default so a "
                         "pulumi destroy is never undone")
    babysit.add_argument("--log", type=Path, metavar="FILE",
                         help="also append every action as a JSON line to FILE")
    babysit.add_argument("--spec-file", type=Path, metavar="FILE",
                         help="where the spec is saved before every delete, so a rerun can "
                         "finish an interrupted recreation (default: FILE.spec.json next to "
                         "--log, else .multislice/babysit/)")
    babysit.set_defaults(func=main, action="babysit")

    reset = subparsers.add_parser(
        "reset", epilog=epilog,
        help="reset every VM of an ACTIVE queued resource (the startup script runs again; "
        "TPU VMs only)",
        description="ResetQueuedResource: every VM of an ACTIVE queued resource is reset in "
        "parallel (memory cleared, local data kept) and runs its startup script again, so "
        "training resumes from the latest checkpoint. Use it when training is stuck; a "
        "SUSPENDED or FAILED request cannot be reset (babysit recreates those).")
    add_target_arguments(reset)
    reset.add_argument("--log", type=Path, metavar="FILE",
                       help="also append the action as a JSON line to FILE")
    reset.set_defaults(func=main, action="reset")


def main(args: argparse.Namespace) -> int:
    from scripts.tpu.babysit import ActionLog, BabysitPolicy, babysit, default_spec_file

    try:
        target = resolve_target(args)
    except TargetError as exc:
        report_error(args.action, exc)
        return EXIT_USAGE
    if target.stack is not None and target.stack.orchestration == "gke":
        return _main_gke(args, target)
    from google.api_core import exceptions

    from infra.tpu_vm.api import TpuEndpointError, make_tpu_client

    try:
        client = make_tpu_client()
    except TpuEndpointError as exc:
        report_error(args.action, exc)
        return EXIT_USAGE
    console = _console()
    try:
        if args.action == "status":
            return run_status(client, target, console, as_json=args.json)
        if args.action == "watch":
            return run_watch(client, target, console, args.interval, args.timeout)
        log = ActionLog(console, getattr(args, "log", None))
        if args.action == "reset":
            return run_reset(client, target, log)
        max_wait = args.max_wait
        if max_wait is None and target.stack is not None:
            max_wait = float(target.stack.wait_for_active_s) or None
        policy = BabysitPolicy(
            interval_s=args.interval,
            max_retries=args.max_retries,
            backoff_s=args.backoff,
            backoff_max_s=args.backoff_max,
            max_wait_s=max_wait,
            timeout_s=args.timeout or None,
            until_active=args.until_active,
            recreate_missing=args.recreate_missing,
            spec_file=args.spec_file or default_spec_file(target, args.log),
        )
        return babysit(client, target, policy, log)
    except exceptions.GoogleAPICallError as exc:
        report_error(args.action, f"the TPU API failed for {target.name}: {exc}")
        return EXIT_API
    except exceptions.RetryError as exc:
        cause = f" (last error: {exc.cause})" if exc.cause else ""
        report_error(args.action, f"the TPU API did not answer usable responses for "
                     f"{target.name} within {2 * target.request_timeout_s:g}s{cause}")
        return EXIT_API
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except Exception as exc:  # a malformed or truncated answer, a broken connection: one line
        first_line = (str(exc).splitlines() or [""])[0][:300]
        report_error(args.action, f"the TPU API answered something this client cannot use for "
                     f"{target.name}: {type(exc).__name__}: {first_line}")
        return EXIT_API


def _main_gke(args: argparse.Namespace, target: Target) -> int:
    """status, watch and babysit of a GKE stack act on its JobSet through the Kubernetes API."""
    from infra.gke import manifest as gke_manifest
    from scripts.gke.babysit import babysit_jobset
    from scripts.gke.babysit import default_spec_file as jobset_spec_file
    from scripts.gke.cluster import ClusterError, ClusterSettingError, api_client
    from scripts.gke.status import run_status as gke_status
    from scripts.gke.status import run_watch as gke_watch
    from scripts.tpu.babysit import ActionLog, BabysitPolicy

    cfg = target.stack
    if args.action == "reset":
        report_error(args.action, f"stack {cfg.stack!r} runs on GKE (multislice:orchestration: "
                     "gke), where JobSet recreates the pods itself up to trainer.max_restarts; "
                     "there is no queued resource to reset. Use `multislice babysit` to "
                     "recreate a Failed JobSet, or `multislice status`")
        return EXIT_USAGE
    console = _console()
    try:
        api = api_client(cfg, target.request_timeout_s)
        if args.action == "status":
            return gke_status(api, cfg, console, as_json=args.json)
        if args.action == "babysit":
            namespace, name = gke_manifest.namespace(cfg), cfg.names.jobset
            policy = BabysitPolicy(
                interval_s=args.interval, max_retries=args.max_retries,
                backoff_s=args.backoff, backoff_max_s=args.backoff_max,
                timeout_s=args.timeout or None,
                spec_file=args.spec_file or jobset_spec_file(namespace, name, args.log))
            log = ActionLog(console, args.log, subject="jobset")
            return babysit_jobset(api, namespace, name, policy, log, cfg=cfg)
        return gke_watch(api, cfg, console, args.interval, args.timeout)
    except ClusterSettingError as exc:
        report_error(args.action, exc)
        return EXIT_USAGE
    except ClusterError as exc:
        report_error(args.action, exc)
        return EXIT_API
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except Exception as exc:  # the API refused, a broken connection: one line
        first_line = (str(exc).splitlines() or [""])[0][:300]
        report_error(args.action, f"the Kubernetes API failed for JobSet "
                     f"{cfg.names.jobset} of stack {cfg.stack!r}: {type(exc).__name__}: "
                     f"{first_line}")
        return EXIT_API

"""One queued resource as every TPU command names it, and the API calls they all share.

A queued resource is named by `--project`, `--zone` and its id, or read from a stack config
(`--stack-config`, parsed by the infra schema); explicit flags win. Every call goes through a
client from `infra.tpu_vm.api.make_tpu_client()` with a per-request timeout.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scripts.argtypes import positive_seconds

EXIT_OK = 0
EXIT_API = 1
EXIT_USAGE = 2
EXIT_BAD_STATE = 3
EXIT_TIMEOUT = 4
EXIT_INTERRUPTED = 130

NOT_FOUND = "NOT_FOUND"
DEFAULT_REQUEST_TIMEOUT_S = 30.0


class TargetError(ValueError):
    """The queued resource cannot be named from the arguments given."""


@dataclass(frozen=True)
class Target:
    """One queued resource, and the stack config it came from (if any)."""

    project: str
    zone: str
    qr_id: str
    stack: Any = None  # infra.stack_config.schema.StackConfig when --stack-config was given
    stack_file: Path | None = None
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S  # every single TPU API call

    @property
    def parent(self) -> str:
        return f"projects/{self.project}/locations/{self.zone}"

    @property
    def name(self) -> str:
        return f"{self.parent}/queuedResources/{self.qr_id}"


# ---- target ------------------------------------------------------------------------------------


def add_target_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("qr_id", nargs="?", metavar="QUEUED_RESOURCE_ID",
                        help="queued resource id (default: the stack config's, ms-<stack>-qr)")
    parser.add_argument("--stack-config", type=Path, metavar="Pulumi.<stack>.yaml",
                        help="read project, zone and queued resource id from this stack config")
    parser.add_argument("--project", help="Google Cloud project id")
    parser.add_argument("--zone", help="zone of the queued resource, e.g. us-central2-b")
    parser.add_argument("--request-timeout", type=positive_seconds,
                        default=DEFAULT_REQUEST_TIMEOUT_S, metavar="S",
                        help="give up on one TPU API call after S seconds (default 30; transient "
                        "failures are retried for a few such periods)")


def resolve_target(args: argparse.Namespace) -> Target:
    """Project, zone and id from the flags, falling back to the stack config."""
    stack = None
    if args.stack_config is not None:
        from infra.stack_config.schema import StackConfigError
        from infra.stack_config.validation import load_stack_file

        try:
            stack = load_stack_file(args.stack_config, check_files=False)
        except StackConfigError as exc:
            raise TargetError(str(exc)) from None
    project = args.project or (stack.project if stack else None)
    zone = args.zone or (stack.zone if stack else None)
    qr_id = args.qr_id or (stack.names.queued_resource_id if stack else None)
    missing = [flag for flag, value in (("--project", project), ("--zone", zone),
                                        ("QUEUED_RESOURCE_ID", qr_id)) if not value]
    if missing:
        raise TargetError(
            f"missing {', '.join(missing)}: give them on the command line or pass "
            "--stack-config Pulumi.<stack>.yaml to read them from a stack config"
        )
    return Target(project=project, zone=zone, qr_id=qr_id, stack=stack,
                  stack_file=args.stack_config, request_timeout_s=args.request_timeout)


# ---- reading the API ---------------------------------------------------------------------------


def polling_for(interval_s: float, timeout_s: float) -> Any:
    """Polling policy for long-running operations (the client's default starts at 1 s)."""
    from google.api_core.future import polling

    return polling.DEFAULT_POLLING.with_delay(
        initial=interval_s, maximum=max(interval_s, 10.0), multiplier=1.5
    ).with_timeout(timeout_s)


def retry_for(target: Target) -> Any:
    """Retry policy of one call: transient failures are retried for 2 request timeouts."""
    from infra.tpu_vm.api import transient_retry

    return transient_retry(2 * target.request_timeout_s, initial_s=0.2)


def get_queued_resource(client: Any, target: Target) -> Any:
    """The QueuedResource message, or None when it does not exist."""
    from google.api_core import exceptions

    try:
        return client.get_queued_resource(
            name=target.name, retry=retry_for(target), timeout=target.request_timeout_s
        )
    except exceptions.NotFound:
        return None


def state_detail(qr: Any) -> str:
    from infra.tpu_vm.api import failure_message

    parts = []
    message = failure_message(qr)
    if message:
        parts.append(message)
    initiator = qr.state.state_initiator.name
    if initiator and initiator != "STATE_INITIATOR_UNSPECIFIED":
        parts.append(f"initiated by {initiator.lower()}")
    return "; ".join(parts)



"""`multislice run`: the command line. Runs one command on every worker of every slice.

How it avoids gcloud's batched-SSH deadlock is in scripts/fanout/engine.py; the shell it runs on
the workers is scripts/fanout/remote.py; where the workers come from is scripts/fanout/workers.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
import time
from pathlib import Path

from scripts.argtypes import (
    non_negative_seconds,
    port,
    positive_int,
    positive_seconds,
    report_error,
)
from scripts.fanout.engine import format_result, run_on_workers
from scripts.fanout.options import REMOTE_ROOT, RunOptions
from scripts.fanout.transports import GcloudTransport, IapTunnel, OpenSSHTransport, Transport
from scripts.fanout.workers import Worker, known_hosts_lines
from scripts.tpu.target import TargetError, add_target_arguments, resolve_target


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "run",
        help="run a command on every worker of every slice (detached launch, then polling)",
        description=(
            "Run COMMAND on every TPU VM of a queued resource (or of a --hosts list). Every worker "
            "is launched detached at once and then polled, so the SSH concurrency limit never "
            "makes one batch of workers wait for another. The first failure stops all workers."
        ),
    )
    source = parser.add_argument_group(
        "workers", "from a queued resource through the TPU API (named as in status/watch), or "
        "from a --hosts file")
    add_target_arguments(source)
    source.add_argument(
        "--hosts", type=Path, help="file of 'SLICE WORKER HOST [PORT]' lines instead of the TPU API"
    )
    ssh = parser.add_argument_group("transport")
    ssh.add_argument("--transport", choices=("ssh", "gcloud"), default="ssh")
    ssh.add_argument("--user", help="remote user (ssh transport)")
    ssh.add_argument("--identity-file", help="private key for ssh")
    ssh.add_argument(
        "--known-hosts", help="known_hosts file of keys you trust (default: ssh's own); workers "
        "found through the TPU API are also pinned to the host keys it publishes for them")
    ssh.add_argument(
        "--iap", action="store_true", help="tunnel through IAP (ssh: ProxyCommand; gcloud: flag)"
    )
    ssh.add_argument("--internal-ip", action="store_true", help="gcloud transport: --internal-ip")
    ssh.add_argument(
        "--ssh-port", type=port, help="SSH port of discovered workers (default: ssh's, 22)"
    )
    ssh.add_argument("--connect-timeout", type=positive_int, default=10, metavar="S",
                     help="seconds to wait for an SSH connection (default 10)")
    run = parser.add_argument_group("run")
    run.add_argument("--max-concurrency", type=positive_int, default=16, metavar="N",
                     help="SSH connections at once (default 16)")
    run.add_argument("--interval", type=positive_seconds, default=5.0, metavar="S",
                     help="seconds between polls (default 5)")
    run.add_argument(
        "--unreachable-timeout",
        type=positive_seconds,
        default=120.0,
        metavar="S",
        help="seconds a worker may stay unreachable before the run fails (default 120)",
    )
    run.add_argument("--timeout", type=non_negative_seconds, default=0.0, metavar="S",
                     help="fail (and stop all) after S seconds (default 0: no limit)")
    run.add_argument("--run-id", help="names the remote run directory (default: a timestamp)")
    run.add_argument(
        "--log-dir", type=Path, help="local log directory (default runs/fanout/RUN_ID)"
    )
    run.add_argument(
        "--workdir", help="remote directory to run in (default: the upload's, or $HOME)"
    )
    run.add_argument(
        "--remote-root",
        default=REMOTE_ROOT,
        help=f"where per-run status and log files go on the workers (default {REMOTE_ROOT})",
    )
    run.add_argument("--upload", type=Path, help="copy this local directory to every worker first")
    run.add_argument(
        "--env", action="append", default=[], metavar="KEY=VALUE", help="remote environment"
    )
    parser.add_argument("remote_command", nargs="*", metavar="-- COMMAND",
                        help="the command every worker runs")
    parser.set_defaults(func=main, passthrough="remote_command")


def _options_from_args(args: argparse.Namespace) -> RunOptions:
    command = list(args.remote_command)  # everything after `--` (scripts.cli)
    if not command:
        raise ValueError(
            "no command given: put it after '--', e.g. multislice run ... -- python3 -m trainer.main"
        )
    env: list[tuple[str, str]] = []
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--env {item!r} is not KEY=VALUE")
        env.append((key, value))
    run_id = args.run_id or time.strftime("run-%Y%m%d-%H%M%S")
    if args.upload is not None and not args.upload.is_dir():
        raise ValueError(f"--upload {str(args.upload)!r} is not a directory")
    workdir = args.workdir
    if args.upload is not None and workdir is None:
        workdir = f"~/multislice/{args.upload.resolve().name}"
    return RunOptions(
        command=command[0] if len(command) == 1 else shlex.join(command),
        run_id=run_id,
        log_dir=args.log_dir or Path("runs") / "fanout" / run_id,
        max_concurrency=args.max_concurrency,
        poll_interval_s=args.interval,
        unreachable_timeout_s=args.unreachable_timeout,
        call_timeout_s=max(30.0, 3.0 * args.connect_timeout),
        run_timeout_s=args.timeout or None,
        workdir=workdir,
        env=tuple(env),
        upload=args.upload,
        remote_root=args.remote_root,
    )


def _workers_from_args(args: argparse.Namespace) -> list[Worker]:
    from scripts.fanout.workers import discover_workers, parse_hosts_file

    if args.hosts is not None:
        if args.qr_id or args.stack_config:
            raise ValueError("give either --hosts or a queued resource, not both")
        from infra.stack_config.userfile import UserFileError, read_text

        try:
            text = read_text(args.hosts, "hosts file")
        except UserFileError as exc:
            raise ValueError(
                f"--hosts {exc}; give a file of 'SLICE WORKER HOST [PORT]' lines"
            ) from None
        return parse_hosts_file(text, source=str(args.hosts))
    try:
        target = resolve_target(args)
    except TargetError as exc:
        raise ValueError(f"{exc} (or give --hosts)") from None
    return discover_workers(target.project, target.zone, target.qr_id, ssh_port=args.ssh_port,
                            request_timeout_s=target.request_timeout_s,
                            host_keys=args.transport == "ssh")  # gcloud checks keys itself


def _transport_from_args(args: argparse.Namespace) -> Transport:
    if args.transport == "gcloud":
        if not (args.project and args.zone):
            raise ValueError("the gcloud transport needs --project and --zone")
        return GcloudTransport(
            project=args.project,
            zone=args.zone,
            internal_ip=args.internal_ip,
            tunnel_through_iap=args.iap,
        )
    iap = None
    if args.iap:
        if not (args.project and args.zone):
            raise ValueError("--iap needs --project and --zone")
        iap = IapTunnel(project=args.project, zone=args.zone)
    return OpenSSHTransport(
        user=args.user,
        identity_file=args.identity_file,
        known_hosts_file=args.known_hosts,
        connect_timeout_s=args.connect_timeout,
        iap=iap,
    )


def _pin_host_keys(transport: Transport, workers: list[Worker], given: str | None,
                   log_dir: Path) -> Transport:
    """ssh to workers found through the TPU API trusts only the host keys the API publishes for
    them (their guest agents' hostkeys/ attributes), written to LOG_DIR/known_hosts, plus the
    user's --known-hosts. A worker that published none needs the user's file."""
    if not isinstance(transport, OpenSSHTransport) or not any(w.node for w in workers):
        return transport
    unpinned = [w for w in workers if not w.host_keys]
    if unpinned and given is None:
        raise ValueError(
            f"{unpinned[0].label} has published no SSH host key (the TPU API's guest attributes "
            "hostkeys/ are empty: its guest agent has not started yet, or its image publishes "
            "none); wait for it, or give --known-hosts FILE with keys you checked")
    log_dir.mkdir(parents=True, exist_ok=True)
    pinned = log_dir / "known_hosts"
    pinned.write_text("".join(line + "\n" for line in known_hosts_lines(workers)))
    pinned.chmod(0o600)
    files = [str(pinned.resolve()), *([str(Path(given).resolve())] if given else [])]
    quoted = [f'"{f}"' if any(c.isspace() for c in f) else f for f in files]
    return dataclasses.replace(transport, known_hosts_file=" ".join(quoted))


def main(args: argparse.Namespace) -> int:
    try:
        options = _options_from_args(args)
        transport = _transport_from_args(args)
        workers = _workers_from_args(args)
        transport = _pin_host_keys(transport, workers, args.known_hosts, options.log_dir)
    except (ValueError, RuntimeError, OSError) as exc:
        report_error("run", exc)
        return 2

    def progress(message: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)

    try:
        result = run_on_workers(workers, transport, options, progress)
    except ValueError as exc:
        report_error("run", exc)
        return 2
    print(format_result(result), file=sys.stderr if result.exit_code else sys.stdout)
    return result.exit_code

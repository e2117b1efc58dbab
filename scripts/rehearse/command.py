"""`multislice rehearse --stack-config FILE`: a stack's day two on emulated TPU VMs.

The stack's own experiment and trainer settings run on the emulated TPU image
(scripts/emulators/boot_harness.py: hosts with the image's python3 3.10 and no uv, their own disks,
users and loopback, the fake metadata server with the per-worker TPU keys) against a GCS emulator
that holds the stack's bucket, so `infra/boot/startup.sh` boots unchanged: it fetches the archive,
builds or unpacks the locked environment and starts the trainer. The mesh is scaled as
`multislice local --stack-config` scales it (at most 2 slices of one 4-chip host each, the
stack's accelerator family), and the experiment's `tpu` extra is emptied and its lock made again
offline for this machine's CPUs; both are said in one line.

While the hosts train, edits are applied as `pulumi up` would apply them: a change of the
experiment's code or of the stack's trainer settings rewrites the launch spec object, and the
hosts stop their trainers at a step boundary, fetch the new code and resume; the render verdict
(KEEPS / REPLACES the queued resource) is printed first, and a change that replaces the queued
resource boots the hosts again. What the hosts log streams here; their logs are kept in the
work directory, whose bucket also survives, so a second rehearsal of the stack resumes its run.

Linux and root only (mount, network and UTS namespaces, overlay mounts, device nodes).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from infra.stack_config.userfile import UserFileError, directory, resolve
from scripts.argtypes import UsageError, positive_int, report_error, seconds
from scripts.local.laptop import MAX_STEPS, add_keep_arguments, keep_from
from scripts.rehearse.stack import (
    LOG_PREFIX,
    CodeSteps,
    Source,
    Tail,
    apply_edit,
    copy_experiment,
    echoed,
    emulated_stack,
    fingerprint,
    load_source,
    report_events,
)

EXIT_USAGE = 2


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "rehearse",
        help="run a stack's experiment on emulated TPU VMs, or a GKE stack's JobSet on emulated "
        "pods, and apply your edits as pulumi up would (Linux; root, through sudo if needed)",
        description="Rehearse day two of a stack before paying for it: its experiment and trainer "
        "settings train on emulated TPU VMs, or for a GKE stack as its JobSet on emulated pods "
        "(the real startup script, a GCS emulator holding the stack's bucket, at most 2 slices), "
        "at laptop scale unless --keep-*; what the hosts log streams here, and every edit of "
        "the experiment's code or of the stack file is applied as pulumi up applies it: the "
        "launch spec is rewritten and the hosts resume on the new code (a GKE stack: a new "
        "JobSet). Ctrl-C stops it; the hosts' logs and the bucket stay in the work directory.",
    )
    parser.add_argument("--stack-config", type=Path, required=True, metavar="FILE",
                        help="the stack file (stacks/Pulumi.STACK.yaml)")
    parser.add_argument("--workdir", type=Path, metavar="DIR",
                        help="the emulated bucket, hosts and kept logs (default: "
                        "runs/rehearse-STACK); a second rehearsal resumes the same run")
    parser.add_argument("--steps", type=positive_int, metavar="N",
                        help="trainer steps for the rehearsal (default: the stack's, at most "
                        f"{MAX_STEPS} unless --keep-steps)")
    add_keep_arguments(parser)
    parser.add_argument("--poll-s", type=seconds(allow_zero=False), default=2.0, metavar="SECONDS",
                        help="how often to look for edits; an edit is applied once one look finds the "
                        "files as the look before found them (default 2)")
    parser.add_argument("--exit-when-done", action="store_true",
                        help="stop once every host has finished the current launch spec (a "
                        "JobSet: once it has completed or failed) (default: keep watching for "
                        "edits until Ctrl-C)")
    parser.add_argument("--as-vms", action="store_true",
                        help="a GKE stack: run its pods as TPU VMs of one host a slice instead "
                        "of the JobSet itself (cheaper: the same startup script)")
    parser.add_argument("--disrupt-at-step", type=positive_int, metavar="N",
                        help="a GKE stack: once step N is written, a pod's node dies (the pod "
                        "gets DisruptionTarget): JobSet restarts every pod without counting it")
    parser.add_argument("--crash-at-step", type=positive_int, metavar="N",
                        help="a GKE stack: once step N is written, a pod's container is killed "
                        "on a live node (exit 137): a restart that counts against max_restarts")
    parser.set_defaults(func=main)

@dataclass
class Job:
    """The emulated hosts of one queued resource, and where their logs stream from."""

    hosts: list[Any]
    tails: list[tuple[str, Tail]] = field(default_factory=list)

def _boot(image: Any, stack: Any, hosts_dir: Path) -> Job:
    from infra.stack_config.topology import parse_accelerator_type
    from scripts.emulators.boot_harness import Host

    per_slice = parse_accelerator_type(stack.cfg.accelerator_type).hosts
    hosts = [Host(image, hosts_dir, f"{stack.name}-s{s}-w{w}", slice_index=s, worker=w)
             for s in range(stack.cfg.slices) for w in range(per_slice)]
    job = Job(hosts)
    for host in hosts:
        host.start(stack)
        train_log = host.logs / "train.log"  # on the host's disk: it holds earlier boots
        job.tails += [(host.name, Tail(host.console)),
                      (host.name, Tail(train_log, train_log.stat().st_size
                                       if train_log.exists() else 0))]
    return job

def _keep_logs(job: Job, kept: Path) -> None:
    for host in job.hosts:
        dest = kept / host.name
        dest.mkdir(parents=True, exist_ok=True)
        for path in (host.console, host.logs / "startup.log", host.logs / "train.log"):
            if path.exists():
                shutil.copy2(path, dest / path.name)

def _stop_on_signals() -> None:
    """Ctrl-C and `kill` stop the rehearsal through its cleanup (the hosts, their network and
    the bucket server would outlive it otherwise), even when started where SIGINT is ignored,
    as it is for a background job (`... &`), where Python installs no handler of its own."""
    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, stop)

def main(args: argparse.Namespace) -> int:
    _stop_on_signals()
    try:
        return _main(args)
    except UsageError as err:
        report_error("rehearse", err)
        return EXIT_USAGE

def _again_as_root() -> None:
    """The emulated hosts are namespaces, which need root: run the same command again through
    sudo (which asks for a password where it must), so one command works for every user."""
    sudo = shutil.which("sudo")
    argv = sys.argv
    if sudo is None or len(argv) < 2 or "rehearse" not in argv[1:]:
        raise UsageError("rehearse boots emulated TPU VMs in namespaces of their own, which "
                         "needs root, and this user is not root"
                         + (" and has no sudo" if sudo is None else "")
                         + ": run the same command as root")
    print(f"{LOG_PREFIX} the emulated hosts need root (namespaces of their own): running the "
          "same command through sudo", flush=True)
    os.execv(sudo, [sudo, sys.executable, os.path.abspath(argv[0]), *argv[1:]])


def _main(args: argparse.Namespace) -> int:
    from infra.packaging.archive import tree_files
    from infra.packaging.lock import LockError

    try:
        stack_file = resolve(args.stack_config, "--stack-config")
    except UserFileError as exc:
        raise UsageError(str(exc)) from None
    source = load_source(stack_file)
    source.jobset = source.cfg.orchestration == "gke" and not args.as_vms
    if not source.jobset and (args.disrupt_at_step or args.crash_at_step):
        raise UsageError(f"--disrupt-at-step and --crash-at-step act on a JobSet's pods; stack "
                         f"{source.cfg.stack!r} is rehearsed as TPU VMs (orchestration "
                         f"{source.cfg.orchestration!r}{', --as-vms' if args.as_vms else ''})")
    keep = keep_from(args)
    steps = args.steps or (source.cfg.trainer.steps if keep.steps
                           else min(source.cfg.trainer.steps, MAX_STEPS))
    for flag, at in (("--disrupt-at-step", args.disrupt_at_step),
                     ("--crash-at-step", args.crash_at_step)):
        if at is not None and at >= steps:
            raise UsageError(f"{flag} {at} is not before the run's last step {steps}: it would "
                             f"never happen; use 1..{steps - 1}")
    if sys.platform != "linux":
        raise UsageError(f"rehearse boots emulated TPU VMs in namespaces of their own, which "
                         f"Linux has and {sys.platform} has not; use a Linux machine or VM")
    if os.geteuid() != 0:
        _again_as_root()
    try:
        workdir = directory(args.workdir or Path("runs") / f"rehearse-{source.cfg.stack}",
                            "--workdir")
    except UserFileError as exc:
        raise UsageError(str(exc)) from None
    copy = workdir / "experiment"
    try:
        copy_experiment(source.experiment, copy, workdir)
    except LockError as exc:
        raise UsageError(f"{source.experiment}: cannot lock it for CPU from this venv's "
                         f"packages (rehearse installs offline): {exc}") from None
    raw, scaled = emulated_stack(source.cfg, copy, args.steps, jobset=source.jobset, keep=keep,
                                 experiment=source.experiment)
    print(f"{LOG_PREFIX} {scaled}", flush=True)
    source.fingerprint = fingerprint(source)
    source.files = tree_files(source.experiment)
    source.applied = stack_file.read_text()
    if source.jobset:
        from scripts.rehearse.jobset import rehearse_jobset

        return rehearse_jobset(source, raw, workdir, args)
    return _rehearse(source, raw, workdir, args)

def _rehearse(source: Source, raw: dict[str, Any], workdir: Path,
              args: argparse.Namespace) -> int:
    from scripts.emulators.boot_harness import Host, Stack
    from scripts.emulators.gcs_emulator import GcsEmulator
    from scripts.emulators.tpu_image import ImageUnavailable, build_image

    image_dir = workdir / "image"
    if image_dir.exists():
        shutil.rmtree(image_dir)
    image_dir.mkdir()
    try:
        image = build_image(image_dir)
    except ImageUnavailable as exc:
        raise UsageError(f"cannot build the emulated TPU image: {exc}") from None
    (workdir / "bucket").mkdir(exist_ok=True)
    hosts_dir, kept = workdir / "hosts", workdir / "logs"
    job: Job | None = None
    with GcsEmulator(root=workdir / "bucket") as gcs:
        try:
            stack = Stack(gcs, workdir / "experiment", source.cfg.stack, raw=raw)
            for bucket in stack.cfg.data_buckets:
                if bucket not in gcs.buckets():
                    gcs.create_bucket(bucket)
            print(f"{LOG_PREFIX} launch spec generation {stack.generation()} (code "
                  f"{stack.sha[:12]}) in gs://{stack.bucket}; booting "
                  f"{stack.cfg.slices} host(s)", flush=True)
            job = _boot(image, stack, hosts_dir)
            seen_events, next_check = 0, time.monotonic() + args.poll_s
            codes = CodeSteps(stack.generation(), stack.sha)
            while True:
                for name, tail in job.tails:
                    for line in tail.lines():
                        if echoed(line):
                            print(f"[{name}] {line}", flush=True)
                _, seen_events = report_events(stack, codes, seen_events)
                generation = stack.generation()
                done = all(f"for a new generation (every ~{stack.cfg.spec_poll_s}s): this host "
                           f"runs generation {generation}" in h.console.read_text()
                           for h in job.hosts)
                if args.exit_when_done and done:
                    statuses = [h.exit_status() for h in job.hosts]
                    print(f"{LOG_PREFIX} every host finished the launch spec; trainer exit "
                          f"statuses {statuses}", flush=True)
                    return 0 if all(s == 0 for s in statuses) else 1
                if time.monotonic() >= next_check:
                    next_check = time.monotonic() + args.poll_s
                    change = apply_edit(source, stack, workdir, args)
                    if change is not None:
                        codes.published(stack.generation(), stack.sha)
                    if change == "replaces":
                        Host.stop_all()
                        _keep_logs(job, kept)
                        job = _boot(image, stack, hosts_dir)
                time.sleep(0.5)
        finally:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut cleanup
            if job is not None:
                Host.stop_all()
                _keep_logs(job, kept)
                print(f"{LOG_PREFIX} the hosts' logs are in {kept}; the bucket stays in "
                      f"{workdir / 'bucket'} for the next rehearsal", flush=True)

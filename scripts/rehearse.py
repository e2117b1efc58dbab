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
import contextlib
import hashlib
import io
import math
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from infra.userfile import UserFileError, directory, resolve
from scripts.argtypes import UsageError, positive_int, report_error, seconds

LOG_PREFIX = "[rehearse]"
EXIT_USAGE = 2
EMULATED_CHIPS = 4  # one host of the stack's family; its chips are CPU devices here
MAX_SLICES = 2
JOBSET_NODES = 2  # pods a slice in a JobSet rehearsal: GKE runs multislice on multi-host pools
# Lines not echoed: the launcher's step markers, the collective library's connection lines and
# a traceback's frames (its last line, the error, is echoed). The kept logs hold every line.
NOT_ECHOED = ("MULTISLICE_STEP ", "[Gloo] ", "Traceback (most recent call last)", " ", "\t")
# How often the emulated hosts look for a new launch spec: the schema's minimum, so an edit made
# while steps remain reaches the trainers while they still train (a stack's default is 60 s).
REHEARSAL_SPEC_POLL_S = 5


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "rehearse",
        help="run a stack's experiment on emulated TPU VMs and apply your edits as pulumi up "
        "would (root, Linux)",
        description="Rehearse day two of a stack before paying for it: its experiment and trainer "
        "settings train on emulated TPU VMs (the real startup script, a GCS emulator holding the "
        "stack's bucket, at most 2 hosts), what the hosts log streams here, and every edit of "
        "the experiment's code or of the stack file is applied as pulumi up applies it: the "
        "launch spec is rewritten and the hosts resume on the new code. Ctrl-C stops it; the "
        "hosts' logs and the bucket stay in the work directory.",
    )
    parser.add_argument("--stack-config", type=Path, required=True, metavar="FILE",
                        help="the stack file (stacks/Pulumi.STACK.yaml)")
    parser.add_argument("--workdir", type=Path, metavar="DIR",
                        help="the emulated bucket, hosts and kept logs (default: "
                        "runs/rehearse-STACK); a second rehearsal resumes the same run")
    parser.add_argument("--steps", type=positive_int, metavar="N",
                        help="trainer steps for the rehearsal (default: the stack's)")
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
class Source:
    """What the user edits: the stack file and the experiment it names."""

    stack_file: Path
    experiment: Path
    cfg: Any
    fingerprint: str = ""  # of the files as last applied
    pending: str = ""  # of files seen changed once, applied if the next look sees them unchanged
    files: dict[str, str] = field(default_factory=dict)  # the archive's files as last applied
    applied: str = ""  # the stack file's text as last applied
    jobset: bool = False  # a GKE stack rehearsed as its JobSet (scripts/rehearse_gke.py)


def _load(stack_file: Path) -> Source:
    from scripts.local.from_stack import load_stack

    cfg, experiment = load_stack(stack_file)
    return Source(stack_file, experiment.resolve(), cfg)


def _fingerprint(source: Source) -> str:
    """The stack file's bytes and every file the experiment's archive would hold."""
    from infra.archive import tree_files

    digest = hashlib.sha256(source.stack_file.read_bytes())
    for name, sha in sorted(tree_files(source.experiment).items()):
        digest.update(f"{name}\0{sha}\0".encode())
    return digest.hexdigest()


def settled_edit(source: Source, fingerprint: str) -> bool:
    """Whether the files hold an edit to apply now: one seen changed on two looks in a row with
    the same contents. An edit of several files (code and the stack file, a `git checkout`) lands
    as one launch spec, never as a half-edited one that the hosts would start and then drop."""
    if fingerprint == source.fingerprint:
        source.pending = ""
        return False
    if fingerprint != source.pending:
        source.pending = fingerprint
        return False
    source.fingerprint, source.pending = fingerprint, ""
    return True


def emulated_type(accelerator_type: str) -> str:
    """The one-host type of the stack's family with EMULATED_CHIPS chips (v5litepod-16 ->
    v5litepod-4, v4-32 -> v4-8)."""
    from infra.topology import parse_accelerator_type

    family = accelerator_type.rsplit("-", 1)[0]
    for size in (EMULATED_CHIPS, 2 * EMULATED_CHIPS):  # v4 and v5p count cores, two a chip
        candidate = f"{family}-{size}"
        with contextlib.suppress(ValueError):
            topo = parse_accelerator_type(candidate)
            if topo.hosts == 1 and topo.devices == EMULATED_CHIPS:
                return candidate
    raise UsageError(f"accelerator_type {accelerator_type}: no one-host {EMULATED_CHIPS}-chip "
                     f"type of the {family} family to emulate it with")


def emulated_pool_type(accelerator_type: str) -> str:
    """The GKE slice of the stack's family with JOBSET_NODES nodes of EMULATED_CHIPS chips
    (v5litepod-16 -> v5litepod-8, v4-32 -> v4-16): the smallest multi-host node pool."""
    from infra.gke.topology import GkeTopologyError, gke_slice
    from infra.topology import parse_accelerator_type

    family = accelerator_type.rsplit("-", 1)[0]
    chips = JOBSET_NODES * EMULATED_CHIPS
    for size in (chips, 2 * chips):  # v4 and v5p count cores, two a chip
        with contextlib.suppress(ValueError, GkeTopologyError):
            shape = gke_slice(parse_accelerator_type(f"{family}-{size}"))
            if shape.nodes == JOBSET_NODES and shape.chips_per_node == EMULATED_CHIPS:
                return f"{family}-{size}"
    raise UsageError(f"accelerator_type {accelerator_type}: no GKE node pool of {JOBSET_NODES} "
                     f"{EMULATED_CHIPS}-chip nodes in the {family} family to emulate it with")


def emulated_stack(cfg: Any, experiment_copy: Path, steps: int | None, jobset: bool = False,
                   ) -> tuple[dict[str, Any], str]:
    """The stack's keys for the emulated job, and one line saying what was scaled. `jobset`: a
    GKE stack kept on GKE, its slices JOBSET_NODES pods each (else every stack runs as TPU VMs
    of one host a slice)."""
    from scripts.local.from_stack import DCN, ICI, scale_axes

    mesh = cfg.resolved_mesh()
    per_slice = EMULATED_CHIPS * (JOBSET_NODES if jobset else 1)
    ici = scale_axes({k: int(mesh[k]) for k in ICI}, per_slice)
    dcn = scale_axes({k: int(mesh[k]) for k in DCN}, MAX_SLICES)
    slices = math.prod(dcn.values())
    if per_slice % math.prod(ici.values()):
        raise UsageError(f"stack {cfg.stack}: its ICI mesh {ici} cannot fill one "
                         f"{per_slice}-chip slice")
    ici["ici_data"] *= per_slice // math.prod(ici.values())  # the slice's chips, all used
    # A GKE stack refuses the TPU-VM keys (their defaults included) once they are set: it keeps
    # only what its file set.
    raw = cfg.model_dump(mode="json", exclude={"stack"}, exclude_unset=jobset)
    raw.setdefault("trainer", {})
    raw["accelerator_type"] = (emulated_pool_type(cfg.accelerator_type) if jobset
                               else emulated_type(cfg.accelerator_type))
    raw["slices"] = slices
    raw["experiment_dir"] = str(experiment_copy)
    raw["trainer"]["mesh"] = {**ici, **dcn}
    raw["spec_poll_s"] = min(cfg.spec_poll_s, REHEARSAL_SPEC_POLL_S)
    if steps is not None:
        raw["trainer"]["steps"] = steps
    gke = cfg.orchestration == "gke"
    if not jobset:
        raw.pop("gke", None)
        raw["orchestration"] = "tpu-vm"  # a GKE pod runs the same startup script as a TPU VM
    changed = [f"{k} {mesh[k]} -> {v}" for k, v in {**ici, **dcn}.items() if mesh[k] != v]
    what = (f"a JobSet of {slices} emulated {raw['accelerator_type']} slice(s) of "
            f"{JOBSET_NODES} pods" if jobset else
            f"{slices} emulated {raw['accelerator_type']} host(s)")
    line = (f"stack {cfg.stack} ({cfg.slices} x {cfg.accelerator_type}) as {what}, "
            f"{EMULATED_CHIPS} CPU devices each: "
            + (f"mesh {', '.join(changed)}" if changed else "mesh unchanged")
            + (f"; steps {cfg.trainer.steps} -> {steps}" if steps is not None else "")
            + (f"; spec_poll_s {cfg.spec_poll_s} -> {raw['spec_poll_s']} (an edit reaches the "
               "hosts within that)" if raw["spec_poll_s"] != cfg.spec_poll_s else "")
            + "; the experiment's tpu extra emptied and its lock made again for CPU"
            + ("; its GKE pods as TPU VMs, which boot the same startup script (--as-vms)"
               if gke and not jobset else ""))
    return raw, line


def _copy_experiment(source: Path, dest: Path, workdir: Path) -> None:
    """The archive's files of `source` in `dest`, made installable on this machine's CPUs."""
    from infra.archive import tree_files
    from scripts.emulators.boot_harness import make_cpu_installable

    if dest.exists():
        shutil.rmtree(dest)
    for name in tree_files(source):
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source / name, target)
    make_cpu_installable(dest, workdir)


def _verdict(before: str, after: str, source: Source, workdir: Path) -> str:
    """The render verdict of the change of the stack file from text `before` to `after`, as
    `multislice render --diff` prints it (the experiment named by its absolute path in both)."""
    import yaml

    from scripts.render import build_manifest, diff_manifests

    files = []
    for side, text in (("before", before), ("after", after)):
        data = yaml.safe_load(text) or {}
        data.setdefault("config", {})["multislice:experiment_dir"] = str(source.experiment)
        path = workdir / "verdict" / side / source.stack_file.name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        files.append(path)
    try:  # the renders' own warnings (zone, capacity) are the stack's, said at preview
        with contextlib.redirect_stderr(io.StringIO()):
            text = diff_manifests(build_manifest(files[0]), build_manifest(files[1]))
    except Exception as exc:  # noqa: BLE001 - the rehearsal goes on; the verdict is a hint
        return f"verdict: unknown (the render failed: {str(exc).splitlines()[0]})"
    return next((line for line in text.splitlines() if line.startswith("verdict:")),
                "verdict: keeps the queued resource")


@dataclass
class Tail:
    """New lines of a growing file."""

    path: Path
    offset: int = 0
    partial: str = ""

    def lines(self) -> list[str]:
        try:
            with self.path.open("rb") as f:
                if f.seek(0, os.SEEK_END) < self.offset:  # a new boot truncated it
                    self.offset = 0
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        text = self.partial + data.decode(errors="replace")
        *done, self.partial = text.split("\n")
        return done


@dataclass
class Job:
    """The emulated hosts of one queued resource, and where their logs stream from."""

    hosts: list[Any]
    tails: list[tuple[str, Tail]] = field(default_factory=list)


def _boot(image: Any, stack: Any, hosts_dir: Path) -> Job:
    from infra.topology import parse_accelerator_type
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


def _events(stack: Any) -> list[dict[str, Any]]:
    with contextlib.suppress(Exception):  # no metrics.jsonl before the first trainer starts
        return stack.events()
    return []


def report_events(stack: Any, codes: CodeSteps, seen: int) -> tuple[list[dict[str, Any]], int]:
    """Print what the run's events after the first `seen` say (which steps each spec ran, the
    job's end); returns every event so far and their number."""
    events = _events(stack)
    for event in events[seen:]:
        for line in codes.observe(event):
            print(f"{LOG_PREFIX} {line}", flush=True)
        if event["event"] == "end":
            print(f"{LOG_PREFIX} the job finished at step {event['final_step']}", flush=True)
    return events, len(events)


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


def _main(args: argparse.Namespace) -> int:
    from infra.archive import tree_files
    from infra.lock import LockError

    try:
        stack_file = resolve(args.stack_config, "--stack-config")
    except UserFileError as exc:
        raise UsageError(str(exc)) from None
    source = _load(stack_file)
    source.jobset = source.cfg.orchestration == "gke" and not args.as_vms
    if not source.jobset and (args.disrupt_at_step or args.crash_at_step):
        raise UsageError(f"--disrupt-at-step and --crash-at-step act on a JobSet's pods; stack "
                         f"{source.cfg.stack!r} is rehearsed as TPU VMs (orchestration "
                         f"{source.cfg.orchestration!r}{', --as-vms' if args.as_vms else ''})")
    if sys.platform != "linux" or os.geteuid() != 0:
        raise UsageError("rehearse boots emulated TPU VMs in their own namespaces, which needs "
                         "root on Linux: run it with sudo (sudo .venv/bin/multislice rehearse "
                         "...)")
    try:
        workdir = directory(args.workdir or Path("runs") / f"rehearse-{source.cfg.stack}",
                            "--workdir")
    except UserFileError as exc:
        raise UsageError(str(exc)) from None
    copy = workdir / "experiment"
    try:
        _copy_experiment(source.experiment, copy, workdir)
    except LockError as exc:
        raise UsageError(f"{source.experiment}: cannot lock it for CPU from this venv's "
                         f"packages (rehearse installs offline): {exc}") from None
    raw, scaled = emulated_stack(source.cfg, copy, args.steps, jobset=source.jobset)
    print(f"{LOG_PREFIX} {scaled}", flush=True)
    source.fingerprint = _fingerprint(source)
    source.files = tree_files(source.experiment)
    source.applied = stack_file.read_text()
    if source.jobset:
        from scripts.rehearse_gke import rehearse_jobset

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
                        if line.strip() and not line.startswith(NOT_ECHOED):
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


class CodeSteps:
    """Which steps each launch spec (its code and settings) ran, from the run's events
    (metrics.jsonl), and how long an edit took from being applied (the launch spec rewritten) to
    the first step trained on it."""

    def __init__(self, generation: str, sha: str) -> None:
        self.code_of = {str(generation): sha}  # spec generation -> archive sha
        self.running: str | None = None  # the spec generation whose steps are being counted
        self.first_step: int | None = None
        self.last_step = 0
        # (spec generation, time) of the newest edit published, until its first step is seen
        self.applied: tuple[str, float] | None = None

    def published(self, generation: str, sha: str) -> None:
        self.code_of[str(generation)] = sha
        self.applied = (str(generation), time.time())

    def _name(self, generation: str | None) -> str:
        return f"code {self.code_of.get(str(generation), '?')[:12]} (spec generation {generation})"

    def observe(self, event: dict[str, Any]) -> list[str]:
        kind, lines = event["event"], []
        if kind == "distributed_init" and event.get("spec_generation") is not None:
            generation = str(event["spec_generation"])
            if generation != self.running:
                if self.running is not None and self.first_step is not None:
                    lines.append(f"{self._name(self.running)} ran steps {self.first_step}.."
                                 f"{self.last_step}")
                self.running, self.first_step = generation, None
        elif kind == "restore":
            lines.append(f"resumed at step {event['restored_step']} on "
                         f"{self._name(self.running)}")
        elif kind == "step":
            if self.first_step is None:
                self.first_step = int(event["step"])
                # The events lag the hosts' output: the old spec's first steps may be read
                # after the edit was published. Only the edited spec's own first step counts.
                if self.applied is not None and self.applied[0] == self.running:
                    lines.append(f"step {self.first_step} is the first on "
                                 f"{self._name(self.running)}: "
                                 f"{event['time'] - self.applied[1]:.1f}s after the edit was "
                                 "applied")
                    self.applied = None
            self.last_step = int(event["step"])
        elif kind == "end" and self.first_step is not None:
            lines.append(f"{self._name(self.running)} ran steps {self.first_step}.."
                         f"{event['final_step']}")
            self.first_step = None
        return lines


def apply_edit(source: Source, stack: Any, workdir: Path, args: argparse.Namespace) -> str | None:
    """Apply the user's edits, if any, as `pulumi up` would: 'keeps' (the spec was rewritten),
    'replaces' (the queued resource would be replaced: boot again), or None."""
    if not settled_edit(source, _fingerprint(source)):
        return None
    try:
        edited = _load(source.stack_file)
    except UsageError as exc:
        print(f"{LOG_PREFIX} not applied: {exc}", flush=True)
        return None
    from infra.archive import tree_files
    from scripts.render import GKE_NEW_RUN, KEEPS_WITH_NEW_SPEC

    files = tree_files(edited.experiment)
    changed = sorted(n for n in files.keys() | source.files.keys()
                     if files.get(n) != source.files.get(n))
    source.files = files
    edited_text = source.stack_file.read_text()
    # What a new launch spec alone does to the real stack: its VMs restart their trainers in
    # place; on GKE it is a new JobSet (the pods carry the spec's digest).
    new_spec = GKE_NEW_RUN if source.cfg.orchestration == "gke" else KEEPS_WITH_NEW_SPEC
    # Only a stack file edit can replace the slices: a code edit skips the renders.
    verdict = (_verdict(source.applied, edited_text, edited, workdir)
               if edited_text != source.applied else new_spec)
    source.applied = edited_text
    if changed and (verdict.startswith(("verdict: keeps the queued resource",
                                        "verdict: keeps the TPU node pools and the JobSet"))):
        verdict = new_spec  # a new archive is a new launch spec
    shown = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
    print(f"{LOG_PREFIX} your edit" + (f" (code: {shown})" if changed else "")
          + f": {verdict}", flush=True)
    source.cfg, source.experiment = edited.cfg, edited.experiment
    _copy_experiment(source.experiment, workdir / "experiment", workdir)
    raw, scaled = emulated_stack(edited.cfg, workdir / "experiment", args.steps,
                                 jobset=source.jobset)
    before = stack.generation()
    stack.raw = raw
    after = stack.publish_spec()
    print(f"{LOG_PREFIX} launch spec generation {before} -> {after} (code {stack.sha[:12]}); "
          f"{scaled}", flush=True)
    return "replaces" if verdict.startswith("verdict: REPLACES") else "keeps"

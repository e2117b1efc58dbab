"""What `multislice rehearse` emulates a stack with, and how it applies the user's edits.

Shared by the TPU-VM rehearsal (scripts/rehearse/command.py) and the JobSet rehearsal of a GKE stack
(scripts/rehearse/jobset.py): the stack scaled to the emulated machines (`emulated_stack`), the
experiment copied and locked for CPU, the edits watched (`settled_edit`) and applied as `pulumi
up` would (`apply_edit`: the render verdict, then a new launch spec), the hosts' or pods' logs
tailed, and the run's events told as which steps each spec ran (`CodeSteps`).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import math
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scripts.argtypes import UsageError
from scripts.local.laptop import Keep, keep_from, laptop_trainer
from scripts.report.goodput import restore_source

LOG_PREFIX = "[rehearse]"
EMULATED_CHIPS = 4  # one host of the stack's family; its chips are CPU devices here
MAX_SLICES = 2
JOBSET_NODES = 2  # pods a slice in a JobSet rehearsal: GKE runs multislice on multi-host pools
# Lines not echoed: the launcher's step markers, the collective library's connection lines and
# a traceback's frames (its last line, the error, is echoed). The kept logs hold every line.
NOT_ECHOED = ("MULTISLICE_STEP ", "[Gloo] ", "Traceback (most recent call last)", " ", "\t")
# TensorStore's credential chain logs an error for the missing gcloud file on every host, real
# TPU VMs and pods included, before it takes the metadata server's token (its
# google_auth_provider.cc): not a fault. A real refusal says PERMISSION_DENIED or
# UNAUTHENTICATED, which such a line never does. The host's own log keeps it.
_ABSL_LINE = re.compile(r"^[EWIF]\d{4} \d")
BENIGN = ("google_auth_provider.cc", "Could not find the credentials file in the standard gcloud")


# A trainer line the start-up script repeats on the host's console for operators ("[HOST attempt
# N] LINE"): the rehearsal shows it once, from the trainer's log.
_CONSOLE_TRAINER_LINE = re.compile(r"^\[\S+ attempt \d+\] ")


def echoed(line: str) -> bool:
    """Whether a host's log line is shown: not blank, not a step marker or a traceback's body
    (the trainer's own error line says it), not known benign noise, not the console's copy of a
    trainer line."""
    if not line.strip() or line.startswith(NOT_ECHOED) or _CONSOLE_TRAINER_LINE.match(line):
        return False
    return not (_ABSL_LINE.match(line) and all(part in line for part in BENIGN)
                and "PERMISSION_DENIED" not in line and "UNAUTHENTICATED" not in line)
# How often the emulated hosts look for a new launch spec: the schema's minimum, so an edit made
# while steps remain reaches the trainers while they still train (a stack's default is 60 s).
REHEARSAL_SPEC_POLL_S = 5


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
    jobset: bool = False  # a GKE stack rehearsed as its JobSet (scripts/rehearse/jobset.py)

def load_source(stack_file: Path) -> Source:
    from scripts.local.from_stack import load_stack

    cfg, experiment = load_stack(stack_file)
    return Source(stack_file, experiment.resolve(), cfg)

def fingerprint(source: Source) -> str:
    """The stack file's bytes and every file the experiment's archive would hold."""
    from infra.packaging.archive import tree_files

    digest = hashlib.sha256(source.stack_file.read_bytes())
    for name, sha in sorted(tree_files(source.experiment).items()):
        digest.update(f"{name}\0{sha}\0".encode())
    return digest.hexdigest()

def settled_edit(source: Source, current: str) -> bool:
    """Whether the files hold an edit to apply now: one seen changed on two looks in a row with
    the same contents. An edit of several files (code and the stack file, a `git checkout`) lands
    as one launch spec, never as a half-edited one that the hosts would start and then drop."""
    if current == source.fingerprint:
        source.pending = ""
        return False
    if current != source.pending:
        source.pending = current
        return False
    source.fingerprint, source.pending = current, ""
    return True

def emulated_type(accelerator_type: str) -> str:
    """The one-host type of the stack's family with EMULATED_CHIPS chips (v5litepod-16 ->
    v5litepod-4, v4-32 -> v4-8)."""
    from infra.stack_config.topology import parse_accelerator_type

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
    from infra.stack_config.topology import parse_accelerator_type

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
                   keep: Keep | None = None, experiment: Path | None = None,
                   ) -> tuple[dict[str, Any], str]:
    """The stack's keys for the emulated job, and one line saying what was scaled. `jobset`: a
    GKE stack kept on GKE, its slices JOBSET_NODES pods each (else every stack runs as TPU VMs
    of one host a slice). The model, batch and steps are brought to laptop scale
    (scripts/local/laptop.py) unless `keep` says otherwise; `experiment` (the user's, whose
    model the copy has: the render of an edit asked it already) is asked how, else the copy."""
    from infra.stack_config.mesh import group_values
    from scripts.local.from_stack import scale_axes

    mesh = cfg.resolved_mesh()
    per_slice = EMULATED_CHIPS * (JOBSET_NODES if jobset else 1)
    ici = scale_axes(group_values(mesh, "ici"), per_slice)
    dcn = scale_axes(group_values(mesh, "dcn"), MAX_SLICES)
    slices = math.prod(dcn.values())
    if per_slice % math.prod(ici.values()):
        raise UsageError(f"stack {cfg.stack}: its ICI mesh {ici} cannot fill one "
                         f"{per_slice}-chip slice")
    ici["ici_data"] *= per_slice // math.prod(ici.values())  # the slice's chips, all used
    # A GKE stack refuses the TPU-VM keys (their defaults included) once they are set: it keeps
    # only what its file set.
    raw = cfg.model_dump(mode="json", exclude={"stack"}, exclude_unset=jobset)
    if cfg.network is not None and "subnet_cidr" not in cfg.model_fields_set:
        del raw["subnet_cidr"]  # the stack's own subnet's: a shared network's stack sets none
    raw.setdefault("trainer", {})
    raw["accelerator_type"] = (emulated_pool_type(cfg.accelerator_type) if jobset
                               else emulated_type(cfg.accelerator_type))
    raw["slices"] = slices
    raw["experiment_dir"] = str(experiment_copy)
    trainer, said = laptop_trainer(cfg.trainer.model_dump(mode="json"),
                                   experiment or experiment_copy,
                                   {**ici, **dcn}, slices * (JOBSET_NODES if jobset else 1),
                                   keep or Keep(), steps)
    # only the trainer keys the raw keys hold (a GKE stack's: what its file set), and the scaled
    trainer = {k: v for k, v in trainer.items()
               if k in raw["trainer"] or k in ("steps", "overrides")}
    raw["trainer"] = {**raw["trainer"], **trainer, "mesh": {**ici, **dcn}}
    raw["spec_poll_s"] = min(cfg.spec_poll_s, REHEARSAL_SPEC_POLL_S)
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
            + "".join(f"; {phrase}" for phrase in said)
            + (f"; spec_poll_s {cfg.spec_poll_s} -> {raw['spec_poll_s']} (an edit reaches the "
               "hosts within that)" if raw["spec_poll_s"] != cfg.spec_poll_s else "")
            + "; the experiment's tpu extra emptied and its lock made again for CPU"
            + ("; its GKE pods as TPU VMs, which boot the same startup script (--as-vms)"
               if gke and not jobset else ""))
    return raw, line

def copy_experiment(source: Path, dest: Path, workdir: Path) -> None:
    """The archive's files of `source` in `dest`, made installable on this machine's CPUs."""
    from infra.packaging.archive import tree_files
    from scripts.emulators.boot_harness import make_cpu_installable

    if dest.exists():
        shutil.rmtree(dest)
    for name in tree_files(source):
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source / name, target)
    make_cpu_installable(dest, workdir)

def render_verdict(before: str, after: str, source: Source, workdir: Path) -> str:
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
        if event["event"] == "restore":
            source = restore_source([event])
            if source is not None:
                print(f"{LOG_PREFIX} a trainer start resumed at step {event.get('restored_step')}:"
                      f" {source.describe()}", flush=True)
        if event["event"] == "end":
            print(f"{LOG_PREFIX} the job finished at step {event['final_step']}", flush=True)
    return events, len(events)

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
    if not settled_edit(source, fingerprint(source)):
        return None
    try:
        edited = load_source(source.stack_file)
    except UsageError as exc:
        print(f"{LOG_PREFIX} not applied: {exc}", flush=True)
        return None
    from infra.packaging.archive import tree_files
    from scripts.render import GKE_KEEPS_WITH_NEW_SPEC, KEEPS_WITH_NEW_SPEC

    files = tree_files(edited.experiment)
    changed = sorted(n for n in files.keys() | source.files.keys()
                     if files.get(n) != source.files.get(n))
    source.files = files
    edited_text = source.stack_file.read_text()
    # What a new launch spec alone does to the real stack: its VMs, or its running JobSet's
    # pods, restart their trainers in place.
    new_spec = GKE_KEEPS_WITH_NEW_SPEC if source.cfg.orchestration == "gke" else KEEPS_WITH_NEW_SPEC
    # Only a stack file edit can replace the slices: a code edit skips the renders.
    verdict = (render_verdict(source.applied, edited_text, edited, workdir)
               if edited_text != source.applied else new_spec)
    source.applied = edited_text
    if changed and (verdict.startswith(("verdict: keeps the queued resource",
                                        "verdict: keeps the TPU node pools and the JobSet"))):
        verdict = new_spec  # a new archive is a new launch spec
    shown = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
    print(f"{LOG_PREFIX} your edit" + (f" (code: {shown})" if changed else "")
          + f": {verdict}", flush=True)
    source.cfg, source.experiment = edited.cfg, edited.experiment
    copy_experiment(source.experiment, workdir / "experiment", workdir)
    raw, scaled = emulated_stack(edited.cfg, workdir / "experiment", args.steps,
                                 jobset=source.jobset, keep=keep_from(args),
                                 experiment=edited.experiment)
    before = stack.generation()
    stack.raw = raw
    after = stack.publish_spec()
    print(f"{LOG_PREFIX} launch spec generation {before} -> {after} (code {stack.sha[:12]}); "
          f"{scaled}", flush=True)
    return ("replaces" if verdict.startswith("verdict: REPLACES") or "REPLACES the JobSet" in verdict
            else "keeps")

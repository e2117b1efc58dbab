"""`multislice local`: run an experiment as an emulated multislice job on this machine's CPUs.

Each emulated slice is one OS process (`python -m trainer.main ...`, cwd = the experiment) with D
CPU devices, joined by `jax.distributed` over a free loopback port (the MULTISLICE_* variables of
docs/CONTRACTS.md). Logs stream live prefixed `[slice i]` and are kept in RUN_DIR/logs/slice-i.log;
the launcher's own decisions go to RUN_DIR/launcher.jsonl (see scripts.local.supervisor).

Preemption drills (each fires once per invocation): `--kill-at STEP[:SLICE]` SIGKILLs a slice's
process group once it reports that step (a crash, or a host lost mid-step); `--preempt-at
STEP[:SLICE]` sends its trainer SIGTERM instead (a maintenance or spot notice: every slice saves a
checkpoint and exits 42). `--max-restarts N` then emulates Cloud TPU auto-repair by stopping every
slice and starting them all again on the same run directory, where the trainer resumes from its
latest checkpoint.

Exit codes:
    0    every slice exited 0
    1    a slice failed (non-zero exit, a signal, or the trainer's exit code 42 "preempted after
         saving a checkpoint") and no restart was left
    2    invalid arguments (bad counts, unknown experiment directory, ...), or a trainer that
         rejected its config, topology or data (its own exit code 2: never restarted)
    3    watchdog: no slice printed anything for --stall-timeout seconds
    130  interrupted by Ctrl-C (SIGINT); 143 when the launcher got SIGTERM

Only slice failures (codes 1) are restarted under --max-restarts; a stall or an interrupt ends the
run. Stopping means SIGTERM to each slice's process group, then SIGKILL after --stop-grace seconds
(a second Ctrl-C skips the wait).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from infra.stack_config.userfile import UserFileError, directory
from scripts.argtypes import (
    UsageError,
    non_negative_int,
    non_negative_seconds,
    positive_int,
    positive_seconds,
    report_error,
)
from scripts.local.attempt import Drill, LaunchPlan
from scripts.local.from_stack import DEFAULT_MAX_DEVICES, DEFAULT_MAX_SLICES, plan_from_stack
from scripts.local.laptop import Keep, add_keep_arguments, keep_from, kept_suffix
from scripts.local.supervisor import Supervisor
from scripts.local.typed_paths import absolute_trainer_paths
from scripts.new import experiment_dir

EXIT_USAGE = 2
DEFAULT_TRAINER_ARGS: tuple[str, ...] = ("--config", "tiny", "--steps", "20")
RESERVED_TRAINER_FLAGS = ("--run-dir", "--expect-slices", "--expect-devices-per-slice")


def parse_drill(text: str, *, preempt: bool = False) -> Drill:
    """'STEP', 'STEP:SLICE' (slice 0 by default) or 'STEP:SLICE:wipe' into a Drill; STEP may be
    `reform` for --kill-at (while an elastic job re-forms: Drill.step 0)."""
    flag = Drill(1, 0, preempt).flag
    wipe = text.endswith(":wipe")
    step_text, _, slice_text = text.removesuffix(":wipe").partition(":")
    if step_text == "reform" and not preempt:
        step_text = "0" if slice_text else "reform"
    try:
        step = int(step_text)
        slice_index = int(slice_text) if slice_text else 0
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{flag} {text!r}: expected STEP, STEP:SLICE or STEP:SLICE:wipe with integers, e.g. "
            "5, 5:1 or 5:1:wipe"
        ) from None
    if (step < 1 and not text.startswith("reform:")) or slice_index < 0:
        raise argparse.ArgumentTypeError(
            f"{flag} {text!r}: STEP must be >= 1 (or, for --kill-at, `reform`) and SLICE >= 0 "
            f"(got step {step}, slice {slice_index})"
        )
    return Drill(step=step, slice=slice_index, preempt=preempt, wipe=wipe)


def parse_kill_at(text: str) -> Drill:
    return parse_drill(text)


def parse_preempt_at(text: str) -> Drill:
    return parse_drill(text, preempt=True)


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    """The knobs shared by `local` and `demo` (everything but the experiment and trainer args)."""
    parser.add_argument("--run-dir", default=None,
                        help="run directory: local, or gs://BUCKET/PATH to rehearse the TPU storage "
                        "(default: runs/local-NAME-SxD, reused so a rerun resumes)")
    parser.add_argument("--log-dir", type=Path, default=None, metavar="DIR",
                        help="local directory for the slices' logs and launcher.jsonl (default: the "
                        "run dir when it is local, else runs/local-NAME-SxD)")
    parser.add_argument("--kill-at", type=parse_kill_at, action="append", default=[],
                        metavar="STEP[:SLICE[:wipe]]",
                        help="SIGKILL slice SLICE (default 0) once it reports global step STEP "
                        "(:wipe: and delete its local checkpoints, as a recreated VM's disk); "
                        "reform:SLICE: while an elastic job re-forms on fewer slices; "
                        "repeatable")
    parser.add_argument("--preempt-at", type=parse_preempt_at, action="append", default=[],
                        metavar="STEP[:SLICE]",
                        help="send slice SLICE's trainer SIGTERM (a preemption notice) at global step "
                        "STEP; repeatable")
    parser.add_argument("--max-restarts", type=non_negative_int, default=0, metavar="N",
                        help="after a failure, stop and restart all slices up to N times (default %(default)s)")
    parser.add_argument("--slice-down-for", type=non_negative_seconds, default=0.0,
                        metavar="SECONDS",
                        help="a slice that a drill or a crash took down stays away this long, as "
                        "Cloud TPU's repair or re-provisioning of its VMs would, before the job "
                        "restarts (default %(default)s: back at once); needs --max-restarts")
    parser.add_argument("--init-timeout", type=positive_int, default=120, metavar="SECONDS",
                        help="MULTISLICE_INIT_TIMEOUT_S for jax.distributed start-up (default %(default)s)")
    parser.add_argument("--stall-timeout", type=positive_seconds, default=600, metavar="SECONDS",
                        help="stop everything when no slice prints anything for this long (default %(default)s)")
    parser.add_argument("--stop-grace", type=positive_seconds, default=10, metavar="SECONDS",
                        help="wait this long after SIGTERM before SIGKILL when stopping slices (default %(default)s)")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "local",
        help="run an experiment as an emulated multislice job on CPU",
        description="Run an experiment as an emulated multislice job on this machine's CPUs: one "
        "OS process per slice, D CPU devices each, jax.distributed over loopback.",
        epilog="Arguments after -- go to the trainer (default: "
        + " ".join(DEFAULT_TRAINER_ARGS)
        + "); the launcher adds --run-dir and --expect-*. Exit codes: 0 ok, 1 a slice failed, "
        "2 bad arguments or a config the trainer rejected, 3 stalled, 130 Ctrl-C.",
    )
    parser.add_argument("--experiment", type=Path, default=None, metavar="DIR",
                        help="rendered experiment directory (default: the template, rendered to a temp dir)")
    parser.add_argument("--stack-config", type=Path, default=None, metavar="FILE",
                        help="run a stack's trainer (Pulumi.<stack>.yaml: its experiment, preset, "
                        "steps, overrides and mesh, as its TPU VMs run them), the mesh scaled "
                        f"to at most {DEFAULT_MAX_SLICES} slices x {DEFAULT_MAX_DEVICES} CPU "
                        "devices unless --slices/--devices-per-slice say otherwise, and the "
                        "model, batch and steps brought to what a laptop runs in minutes "
                        "(one line says what was scaled)")
    parser.add_argument("--slices", type=positive_int, default=None, metavar="S",
                        help="number of emulated slices (one OS process each); required "
                        "without --stack-config")
    parser.add_argument("--devices-per-slice", type=positive_int, default=None, metavar="D",
                        help="CPU devices per slice; required without --stack-config")
    add_keep_arguments(parser)
    add_launch_arguments(parser)
    parser.add_argument("trainer_args", nargs="*", metavar="-- TRAINER_ARGS",
                        help="arguments for the trainer (python -m trainer.main)")
    parser.set_defaults(func=main, passthrough="trainer_args")


def default_run_dir(experiment: Path | None, slices: int, devices_per_slice: int) -> Path:
    """A stable default, so running the same command again resumes the same run."""
    name = experiment.expanduser().resolve().name if experiment is not None else "template"
    return Path("runs") / f"local-{name}-{slices}x{devices_per_slice}"


def check_trainer_args(trainer_args: Sequence[str]) -> tuple[str, ...]:
    for arg in trainer_args:
        flag = arg.split("=", 1)[0]
        if flag in RESERVED_TRAINER_FLAGS:
            raise UsageError(
                f"trainer argument {arg!r} is set by the launcher; use `multislice local "
                "--run-dir`, --slices and --devices-per-slice instead"
            )
    return tuple(trainer_args) if trainer_args else DEFAULT_TRAINER_ARGS


def trainer_steps(trainer_args: Sequence[str]) -> int | None:
    """The trainer's --steps (the last one wins, as in argparse), if given as a whole number."""
    steps = None
    for index, arg in enumerate(trainer_args):
        if arg == "--steps" and index + 1 < len(trainer_args):
            text = trainer_args[index + 1]
        elif arg.startswith("--steps="):
            text = arg.split("=", 1)[1]
        else:
            continue
        steps = int(text) if text.strip().isdigit() else None
    return steps


def resolve_run_dir(run_dir: str | Path) -> str | Path:
    """A local run dir as an absolute Path; gs://BUCKET/PATH as text (checked for its form)."""
    text = str(run_dir)
    # Checked as text: Path("gs://b/r") would quietly become the local directory "gs:/b/r".
    if text.startswith("gs:/"):
        bucket, _, path = text.removeprefix("gs://").partition("/")
        if not text.startswith("gs://") or not bucket or not path.strip("/"):
            raise UsageError(
                f"--run-dir {run_dir}: expected gs://BUCKET/PATH (a path inside a bucket)"
            )
        return text.rstrip("/")
    try:
        return directory(Path(run_dir), "--run-dir", create=False)  # made once it is used
    except UserFileError as exc:
        raise UsageError(str(exc)) from None


def _summary_location(run_dir: str | Path) -> tuple[Any, str]:
    if isinstance(run_dir, str):  # gs://
        from scripts.gcs import filesystem

        return filesystem(), f"{run_dir}/summary.json"
    return None, str(run_dir / "summary.json")


def summary_version(run_dir: str | Path) -> str | None:
    """What identifies RUN_DIR/summary.json as it is now: its GCS generation or local mtime;
    None when there is none. Compared before and after a run, it tells whether the run wrote
    one, whatever the clocks of this host and of the storage say."""
    fs, path = _summary_location(run_dir)
    if fs is not None:
        fs.invalidate_cache(path)  # a listing cached earlier in this process would be stale
        try:
            info = fs.info(path)
        except FileNotFoundError:
            return None
        return str(info.get("generation") or info.get("updated") or info.get("mtime"))
    try:
        return str(Path(path).stat().st_mtime_ns)
    except FileNotFoundError:
        return None


def _read_summary(run_dir: str | Path, before: str | None) -> tuple[str, dict[str, Any] | None]:
    """(where, summary.json if it changed since `before`). Raises OSError or ValueError."""
    fs, path = _summary_location(run_dir)
    if summary_version(run_dir) in (None, before):
        return path, None
    text = fs.cat_file(path) if fs is not None else Path(path).read_text(encoding="utf-8")
    return path, json.loads(text)


def print_summary(run_dir: str | Path, before: str | None, restarts: int) -> None:
    """One line from RUN_DIR/summary.json, when this invocation wrote it (`before`: its
    summary_version when the invocation started)."""
    try:
        path, summary = _read_summary(run_dir, before)
    except (OSError, ValueError) as err:
        print(f"[multislice] could not read {run_dir}/summary.json: {err}", file=sys.stderr)
        return
    if summary is None:
        print(f"[multislice] no summary.json was written by this run in {run_dir}", file=sys.stderr)
        return
    print(f"[multislice] summary: {format_summary(summary, restarts)}", file=sys.stderr)


def format_summary(summary: dict[str, Any], restarts: int) -> str:
    def num(key: str, fmt: str) -> str:
        value = summary.get(key)
        return "n/a" if not isinstance(value, int | float) else format(value, fmt)

    mfu = summary.get("mfu")  # a fraction of peak
    mfu_text = f"{100 * mfu:.2f}%" if isinstance(mfu, int | float) else "n/a"
    eval_text = (f", eval loss {num('eval_loss', '.4f')}"
                 if isinstance(summary.get("eval_loss"), int | float) else "")
    return (
        f"final step {summary.get('final_step', 'n/a')}, final loss {num('final_loss', '.4f')}"
        f"{eval_text}, {num('tokens_per_s', ',.0f')} tokens/s, MFU {mfu_text}, "
        f"restarts {restarts}"
    )


def run_local(
    *,
    experiment: Path | None,
    slices: int,
    devices_per_slice: int,
    trainer_args: Sequence[str],
    run_dir: str | Path | None = None,
    log_dir: Path | None = None,
    kill_at: Sequence[Drill] = (),
    preempt_at: Sequence[Drill] = (),
    max_restarts: int = 0,
    init_timeout_s: int = 120,
    stall_timeout_s: float = 600.0,
    stop_grace_s: float = 10.0,
    slice_down_s: float = 0.0,
) -> int:
    """Validate, launch, supervise; returns the exit code documented in this module."""
    drills = (*(replace(d, preempt=False) for d in kill_at),
              *(replace(d, preempt=True) for d in preempt_at))
    try:
        if slice_down_s and not max_restarts:
            raise UsageError(
                f"--slice-down-for {slice_down_s:g}: without --max-restarts N the job ends at "
                "the first failure, so no slice is waited for; give --max-restarts 1 or more")
        for drill in drills:
            if drill.slice >= slices:
                raise UsageError(
                    f"{drill.flag} {drill}: slice {drill.slice} does not exist; "
                    f"with --slices {slices} it must be 0..{slices - 1}"
                )
        args = check_trainer_args(trainer_args)
        steps = trainer_steps(args)
        for drill in drills:
            if steps is not None and drill.step > steps:
                raise UsageError(
                    f"{drill.flag} {drill}: step {drill.step} is beyond the trainer's --steps "
                    f"{steps}, so the drill would never fire; use a step from 1 to {steps}"
                )
        default = default_run_dir(experiment, slices, devices_per_slice)
        run_path = resolve_run_dir(run_dir or default)
        remote = isinstance(run_path, str)
        if remote:
            from scripts.gcs import StorageUnreachable, check_reachable

            try:
                check_reachable(str(run_path))
            except StorageUnreachable as err:
                raise UsageError(f"--run-dir {err}") from None
        try:
            logs_path = (directory(log_dir, "--log-dir", create=False) if log_dir is not None
                         else Path(default).resolve() if remote else run_path)
        except UserFileError as exc:
            raise UsageError(str(exc)) from None
        with experiment_dir(experiment) as exp:  # checked before anything is created
            if log_dir is not None:
                try:
                    directory(log_dir, "--log-dir")
                except UserFileError as exc:
                    raise UsageError(str(exc)) from None
            if remote:
                reused = False
            else:
                reused = run_path.is_dir() and any(run_path.iterdir())
                run_path.mkdir(parents=True, exist_ok=True)
            print(
                f"[multislice] run dir: {run_path}"
                + (" (exists: the trainer resumes from its latest checkpoint)" if reused else "")
                + (f"; logs in {logs_path}" if logs_path != run_path else ""),
                file=sys.stderr,
                flush=True,
            )
            plan = LaunchPlan(
                experiment_dir=exp,
                log_dir=logs_path,
                slices=slices,
                devices_per_slice=devices_per_slice,
                trainer_args=(
                    *args,
                    "--run-dir", str(run_path),
                    "--expect-slices", str(slices),
                    "--expect-devices-per-slice", str(devices_per_slice),
                ),
                drills=drills,
                max_restarts=max_restarts,
                init_timeout_s=init_timeout_s,
                stall_timeout_s=stall_timeout_s,
                stop_grace_s=stop_grace_s,
                slice_down_s=slice_down_s,
                base_env=dict(os.environ),
            )
            before = summary_version(run_path)
            supervisor = Supervisor(plan)
            code = supervisor.run()
            print_summary(run_path, before, supervisor.restarts)
            verdict = "done" if code == 0 else "stopped" if code >= 128 else "FAILED"
            print(
                f"[multislice] {verdict}: {supervisor.outcome}; "
                f"logs in {logs_path / 'logs'}; exit code {code}",
                file=sys.stderr,
            )
            return code
    except UsageError as err:
        report_error("local", err)
        return EXIT_USAGE


def main(args: argparse.Namespace) -> int:
    experiment, slices, devices = args.experiment, args.slices, args.devices_per_slice
    # Typed here, read here: the trainers run in the experiment directory (typed_paths.py).
    trainer_args, made_absolute = absolute_trainer_paths(args.trainer_args, Path.cwd())
    if made_absolute:
        print(f"[multislice] relative to {Path.cwd()}: {', '.join(made_absolute)}",
              file=sys.stderr, flush=True)
    run_dir = args.run_dir
    try:
        if args.stack_config is not None:
            if experiment is not None:
                raise UsageError("--experiment and --stack-config: give one (the stack names "
                                 "its experiment in multislice:experiment_dir)")
            check_trainer_args(trainer_args)
            plan = plan_from_stack(args.stack_config, slices, devices, keep_from(args))
            print(f"[multislice] {plan.scaled}", file=sys.stderr, flush=True)
            experiment, slices, devices = plan.experiment, plan.slices, plan.devices_per_slice
            trainer_args = [*plan.trainer_args, *trainer_args]
            if run_dir is None:
                stack = args.stack_config.stem.removeprefix("Pulumi.")
                run_dir = Path("runs") / (f"local-stack-{stack}-{slices}x{devices}"
                                          + kept_suffix(keep_from(args)))
        elif keep_from(args) != Keep():
            raise UsageError("--keep-model, --keep-batch and --keep-steps keep a stack's own "
                             "settings: give them with --stack-config")
        elif slices is None or devices is None:
            raise UsageError("--slices and --devices-per-slice are required (or --stack-config "
                             "FILE, which takes them from the stack)")
    except UsageError as err:
        report_error("local", err)
        return EXIT_USAGE
    return run_local(
        experiment=experiment,
        slices=slices,
        devices_per_slice=devices,
        trainer_args=trainer_args,
        run_dir=run_dir,
        log_dir=args.log_dir,
        kill_at=args.kill_at,
        preempt_at=args.preempt_at,
        max_restarts=args.max_restarts,
        init_timeout_s=args.init_timeout,
        stall_timeout_s=args.stall_timeout,
        stop_grace_s=args.stop_grace,
        slice_down_s=args.slice_down_for,
    )

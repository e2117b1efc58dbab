"""`multislice run`: run one command on every worker of every slice, without the fan-out deadlock.

gcloud's batched SSH runs a command on the first N workers and waits for them to finish before it
starts the next batch. A multislice job cannot finish until every worker has joined, so with more
workers than the batch limit the first batch waits forever. Here every SSH call is short:

1. launch: each worker starts the command detached (its own session and process group, output to
   a log file, exit status to a file under a per-run directory) and the SSH call returns at once;
2. poll: short SSH calls read each worker's status and the new part of its log;
3. on the first failure (or an unreachable worker) every other worker's process group is killed.

The concurrency limit bounds how many SSH connections are open at a time; since none of them waits
on the command, every worker is running long before any of them can finish.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import io
import re
import secrets
import shlex
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from scripts.transports import (
    TRANSPORT_FAILURE_EXIT_CODE,
    GcloudTransport,
    IapTunnel,
    OpenSSHTransport,
    Transport,
    Worker,
)

REMOTE_ROOT = "~/.multislice/runs"
_RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_LAUNCHED = "MULTISLICE_LAUNCHED"
_STATUS = "MULTISLICE_STATUS"
_STOPPED = "MULTISLICE_STOPPED"
_UPLOADED = "MULTISLICE_UPLOADED"
UPLOAD_EXCLUDES = (".git", ".venv", "__pycache__", ".pytest_cache", ".ruff_cache", "runs", "*.pyc")

EXIT_OK = 0
EXIT_WORKER_FAILED = 1
EXIT_UNREACHABLE = 3
EXIT_TIMEOUT = 4
EXIT_INTERRUPTED = 130


@dataclass(frozen=True)
class RunOptions:
    command: str
    run_id: str
    log_dir: Path
    max_concurrency: int = 16
    poll_interval_s: float = 5.0
    # How long a worker may stay unreachable (at launch or while polling) before the run fails.
    unreachable_timeout_s: float = 120.0
    call_timeout_s: float = 60.0  # one SSH call, end to end
    stop_grace_s: float = 10.0  # SIGTERM, then SIGKILL after this long
    run_timeout_s: float | None = None
    workdir: str | None = None
    env: tuple[tuple[str, str], ...] = ()
    upload: Path | None = None
    tail_lines: int = 20
    remote_root: str = REMOTE_ROOT  # per-run directories go under here on every worker
    max_log_chunk_bytes: int = 4 * 1024 * 1024

    def __post_init__(self) -> None:
        if not _RUN_ID_RE.match(self.run_id):
            raise ValueError(
                f"run id {self.run_id!r} is not allowed; use 1-64 letters, digits, '.', '_' or '-', "
                "starting with a letter or digit"
            )
        if self.max_concurrency < 1:
            raise ValueError(f"max concurrency must be at least 1, got {self.max_concurrency}")
        for key, _ in self.env:
            if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", key):
                raise ValueError(f"environment variable name {key!r} is not a valid shell name")


@dataclass
class WorkerFailure:
    worker: Worker
    exit_code: int | None  # None: the process vanished without writing an exit status
    reason: str
    last_lines: list[str]

    def describe(self) -> str:
        code = "no exit status" if self.exit_code is None else f"exit code {self.exit_code}"
        lines = "\n".join(f"    {line}" for line in self.last_lines) or "    (empty log)"
        return f"{self.worker.label} failed ({code}): {self.reason}\n  last log lines:\n{lines}"


@dataclass
class RunResult:
    exit_code: int
    log_dir: Path
    exit_codes: dict[tuple[int, int], int] = field(default_factory=dict)
    failure: WorkerFailure | None = None
    unreachable: list[tuple[Worker, str]] = field(default_factory=list)
    stopped: list[Worker] = field(default_factory=list)
    message: str = ""


# ---------------------------------------------------------------------------------------------
# Remote shell snippets (POSIX sh; every value is quoted by shlex).


def remote_path(path: str) -> str:
    """Quote a remote path for sh, keeping a leading ~/ relative to the remote $HOME."""
    if path == "~":
        return '"$HOME"'
    if path.startswith("~/"):
        return '"$HOME"/' + shlex.quote(path[2:])
    return shlex.quote(path)


def worker_dir(options: RunOptions, worker: Worker) -> str:
    # Slice and worker are in the path so workers that share a filesystem never collide.
    leaf = f"{options.run_id}/s{worker.slice_index}-w{worker.worker_index}"
    return f"{remote_path(options.remote_root.rstrip('/'))}/{leaf}"


# The wrapper is the leader of a new session and process group: its pid is the group id that
# `stop` kills. It writes "CODE EPOCH" to exit only after the command and its log are complete.
_WRAPPER = (
    'echo $$ > "$0/pid.tmp" && mv "$0/pid.tmp" "$0/pid"; '
    'if command -v bash >/dev/null 2>&1; then bash -c "$1"; else sh -c "$1"; fi; '
    'echo "$? $(date +%s)" > "$0/exit.tmp"; mv "$0/exit.tmp" "$0/exit"'
)


def launch_script(options: RunOptions, worker: Worker, nonce: str = "") -> str:
    """Start the command detached; `nonce` tells a retried launch from a reused run id."""
    d = worker_dir(options, worker)
    env = {
        "MULTISLICE_RUN_ID": options.run_id,
        "MULTISLICE_SLICE_INDEX": str(worker.slice_index),
        "MULTISLICE_WORKER_INDEX": str(worker.worker_index),
        **dict(options.env),
    }
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    cd = f"cd {remote_path(options.workdir)} && " if options.workdir else ""
    return (
        f"d={d}; "
        # A retried SSH call must not start the command twice; a reused run id is an error.
        'if [ -e "$d/pid" ]; then '
        f'if [ "$(cat "$d/nonce" 2>/dev/null)" = {shlex.quote(nonce)} ]; then echo {_LAUNCHED} again; exit 0; fi; '
        'echo "$d already holds an earlier run; choose another --run-id" >&2; exit 17; fi; '
        f'mkdir -p "$d" && echo {shlex.quote(nonce)} > "$d/nonce" && '
        f"{cd}export {exports} && "
        f'(setsid sh -c {shlex.quote(_WRAPPER)} "$d" {shlex.quote(options.command)} '
        '> "$d/log" 2>&1 < /dev/null &) && '
        # Wait (briefly) for the pid file so a stop right after launch always finds the group.
        'i=0; while [ ! -f "$d/pid" ] && [ $i -lt 200 ]; do sleep 0.05; i=$((i+1)); done; '
        f'[ -f "$d/pid" ] && echo {_LAUNCHED}'
    )


# True while any process of group $1 is alive. Zombies do not count: where nothing reaps orphans
# (some containers' init), a finished or killed group would otherwise look alive forever.
_ALIVE_FN = (
    "alive() { if command -v ps >/dev/null 2>&1; then "
    "ps -e -o pgid= -o stat= | awk -v g=\"$1\" '$1 == g && $2 !~ /^Z/ { f = 1 } END { exit !f }'; "
    'else kill -s 0 -- -"$1" 2>/dev/null; fi; }; '
)


def poll_script(options: RunOptions, worker: Worker, offset: int) -> str:
    d = worker_dir(options, worker)
    return (
        f"{_ALIVE_FN}d={d}; "
        'if [ -f "$d/pid" ] && alive "$(cat "$d/pid")"; then st=running; '
        'elif [ -f "$d/exit" ]; then st="exited $(cat "$d/exit")"; '
        'elif [ -f "$d/pid" ]; then st=vanished; '
        "else st=missing; fi; "
        'size=$(wc -c < "$d/log" 2>/dev/null || echo 0); '
        f'echo "{_STATUS} $st size $size"; '
        f'[ -f "$d/log" ] && tail -c +{offset + 1} "$d/log" | head -c {options.max_log_chunk_bytes}; '
        "exit 0"
    )


def stop_script(options: RunOptions, worker: Worker) -> str:
    d = worker_dir(options, worker)
    ticks = max(1, int(options.stop_grace_s * 10))
    return (
        f"{_ALIVE_FN}d={d}; "
        'if [ -f "$d/pid" ] && [ ! -f "$d/exit" ]; then p=$(cat "$d/pid"); '
        'kill -s TERM -- -"$p" 2>/dev/null; i=0; '
        f'while alive "$p" && [ $i -lt {ticks} ]; do sleep 0.1; i=$((i+1)); done; '
        'kill -s KILL -- -"$p" 2>/dev/null; echo stopped > "$d/stopped"; '
        f"echo {_STOPPED} killed; else echo {_STOPPED} idle; fi"
    )


def upload_script(dest: str) -> str:
    dest_q = remote_path(dest)
    return f"mkdir -p {dest_q} && tar -xzf - -C {dest_q} && echo {_UPLOADED}"


def make_archive(directory: Path, excludes: Iterable[str] = UPLOAD_EXCLUDES) -> bytes:
    """A gzipped tar of `directory`'s contents (paths relative to it), without caches and venvs."""
    patterns = tuple(excludes)

    def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        parts = Path(info.name).parts
        for part in parts:
            for pattern in patterns:
                if Path(part).match(pattern):
                    return None
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        return info

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for child in sorted(directory.iterdir()):
            tar.add(child, arcname=child.name, filter=keep)
    return buffer.getvalue()


# ---------------------------------------------------------------------------------------------
# The runner.


@dataclass
class _CallResult:
    returncode: int
    stdout: bytes
    stderr: str
    timed_out: bool = False

    @property
    def transport_failed(self) -> bool:
        return self.timed_out or self.returncode == TRANSPORT_FAILURE_EXIT_CODE

    def error_text(self) -> str:
        if self.timed_out:
            return "the SSH call timed out"
        text = self.stderr.strip().splitlines()
        return text[-1] if text else f"ssh exited with {self.returncode}"


def _call(argv: list[str], timeout_s: float, stdin: bytes | None = None) -> _CallResult:
    try:
        proc = subprocess.run(
            argv,
            input=stdin if stdin is not None else b"",
            capture_output=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        stderr = exc.stderr.decode(errors="replace") if exc.stderr else ""
        return _CallResult(TRANSPORT_FAILURE_EXIT_CODE, b"", stderr, timed_out=True)
    except FileNotFoundError as exc:
        raise RuntimeError(f"cannot run {argv[0]!r}: {exc.strerror}; is it installed?") from exc
    return _CallResult(proc.returncode, proc.stdout, proc.stderr.decode(errors="replace"))


@dataclass
class _WorkerState:
    worker: Worker
    log_path: Path
    offset: int = 0  # bytes of the remote log already copied to log_path
    exit_size: int = 0  # remote log size at the last poll
    launched: bool = False
    exit_code: int | None = None
    exit_time: float | None = None
    status: str = "pending"
    unreachable_since: float | None = None
    last_error: str = ""

    def tail(self, n: int) -> list[str]:
        if not self.log_path.exists():
            return []
        data = self.log_path.read_bytes()[-64 * 1024 :]
        return data.decode(errors="replace").splitlines()[-n:]


class FanOut:
    """Runs `options.command` on `workers` through `transport`; see the module docstring."""

    def __init__(
        self,
        workers: Sequence[Worker],
        transport: Transport,
        options: RunOptions,
        progress: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        _check_workers(workers)
        for worker in workers:
            transport.argv(worker, "true")  # a worker this transport cannot address fails here
        self.workers = list(workers)
        self.transport = transport
        self.options = options
        self.progress = progress or (lambda message: None)
        self.clock = clock
        options.log_dir.mkdir(parents=True, exist_ok=True)
        self.states = [
            _WorkerState(w, options.log_dir / f"slice-{w.slice_index}-worker-{w.worker_index}.log")
            for w in self.workers
        ]
        for state in self.states:
            state.log_path.write_bytes(b"")
        self._pool = cf.ThreadPoolExecutor(max_workers=options.max_concurrency)
        self.nonce = secrets.token_hex(8)

    # -- one call per worker, at most max_concurrency at a time ---------------------------------

    def _map(
        self, fn: Callable[[_WorkerState], _CallResult], states: Sequence[_WorkerState]
    ) -> list[_CallResult]:
        return list(self._pool.map(fn, states))

    def _remote(self, state: _WorkerState, script: str, stdin: bytes | None = None) -> _CallResult:
        argv = self.transport.argv(state.worker, script)
        return _call(argv, self.options.call_timeout_s, stdin)

    # -- phases ----------------------------------------------------------------------------------

    def _until_reachable(
        self, states: list[_WorkerState], action: Callable[[_WorkerState], _CallResult], marker: str
    ) -> tuple[list[_WorkerState], list[tuple[_WorkerState, str]]]:
        """Run `action` on every worker, retrying the unreachable ones until the timeout.

        Returns the workers where the remote side failed (not the transport) and those still
        unreachable when the time ran out; every other worker succeeded.
        """
        deadline = self.clock() + self.options.unreachable_timeout_s
        pending = list(states)
        failed: list[tuple[_WorkerState, str]] = []
        while pending:
            results = self._map(action, pending)
            retry: list[_WorkerState] = []
            for state, result in zip(pending, results, strict=True):
                if marker.encode() in result.stdout:
                    state.unreachable_since = None
                elif result.transport_failed:
                    state.last_error = result.error_text()
                    retry.append(state)
                else:
                    detail = (
                        result.stderr.strip() or result.stdout.decode(errors="replace")
                    ).strip()
                    failed.append((state, f"exit {result.returncode}: {detail[-2000:]}"))
            if retry and self.clock() >= deadline:
                return retry, failed
            pending = retry
            if pending:
                time.sleep(min(1.0, self.options.poll_interval_s))
        return [], failed

    def upload(self, archive: bytes, dest: str) -> RunResult | None:
        self.progress(f"uploading {len(archive) / 1e6:.1f} MB to {len(self.states)} workers")
        unreachable, failed = self._until_reachable(
            self.states, lambda s: self._remote(s, upload_script(dest), archive), _UPLOADED
        )
        return self._launch_problem(unreachable, failed, "upload")

    def launch(self) -> RunResult | None:
        n = len(self.states)
        self.progress(
            f"launching on {n} workers, at most {self.options.max_concurrency} SSH connections at a time"
        )

        step = max(1, n // 10)
        lock = threading.Lock()
        launched = [0]

        def launch_one(state: _WorkerState) -> _CallResult:
            result = self._remote(state, launch_script(self.options, state.worker, self.nonce))
            if _LAUNCHED.encode() in result.stdout:
                state.launched = True
                state.status = "running"
                with lock:
                    launched[0] += 1
                    if launched[0] % step == 0 and launched[0] < n:
                        self.progress(f"launched {launched[0]}/{n}")
            return result

        unreachable, failed = self._until_reachable(self.states, launch_one, _LAUNCHED)
        problem = self._launch_problem(unreachable, failed, "launch")
        if problem is None:
            self.progress(
                f"all {n} workers launched; polling every {self.options.poll_interval_s:g}s"
            )
        return problem

    def _launch_problem(
        self, unreachable: list[_WorkerState], failed: list[tuple[_WorkerState, str]], phase: str
    ) -> RunResult | None:
        if failed:
            state, detail = failed[0]
            failure = WorkerFailure(state.worker, None, f"{phase} failed: {detail}", [])
            return self._abort(
                RunResult(EXIT_WORKER_FAILED, self.options.log_dir, failure=failure),
                skip=[s for s, _ in failed],
            )
        if unreachable:
            result = RunResult(
                EXIT_UNREACHABLE,
                self.options.log_dir,
                unreachable=[(s.worker, s.last_error) for s in unreachable],
            )
            # A launch whose SSH call timed out may still have started: try to stop it too.
            return self._abort(result)
        return None

    def poll_once(self) -> None:
        active = [s for s in self.states if s.status == "running" or s.offset < s.exit_size]

        def poll_one(state: _WorkerState) -> _CallResult:
            return self._remote(state, poll_script(self.options, state.worker, state.offset))

        for state, result in zip(active, self._map(poll_one, active), strict=True):
            self._absorb(state, result)

    def _absorb(self, state: _WorkerState, result: _CallResult) -> None:
        header, _, body = result.stdout.partition(b"\n")
        if result.transport_failed or not header.startswith(_STATUS.encode()):
            if state.unreachable_since is None:
                state.unreachable_since = self.clock()
            state.last_error = (
                result.error_text()
                if result.transport_failed
                else (f"unexpected reply {header[:200]!r} (exit {result.returncode})")
            )
            return
        state.unreachable_since = None
        if body:
            with state.log_path.open("ab") as f:
                f.write(body)
            state.offset += len(body)
        fields = header.decode(errors="replace").split()
        status, size = fields[1], int(fields[-1])
        state.exit_size = size
        if state.status != "running":
            return  # already finished; this call only fetched the rest of its log
        if status == "exited":
            try:
                state.exit_code, state.exit_time = int(fields[2]), float(fields[3])
            except (IndexError, ValueError):
                status = "unreadable"
            else:
                state.status = "done" if state.exit_code == 0 else "failed"
                if state.exit_code != 0:
                    self.progress(f"{state.worker.label} exited with {state.exit_code}")
                return
        if status in ("vanished", "missing", "unreadable"):
            state.status = "failed"
            state.exit_code = None
            state.last_error = {
                "vanished": "its process group is gone without an exit status "
                "(killed, or the VM restarted)",
                "missing": "its run directory is gone (the VM was replaced or restarted)",
            }.get(status, f"its exit status file is unreadable: {header[:200]!r}")
            self.progress(f"{state.worker.label}: {state.last_error}")

    def _abort(self, result: RunResult, skip: Sequence[_WorkerState] = ()) -> RunResult:
        """Stop every worker that may still be running, then fetch what is left of their logs."""
        skipped = {id(s) for s in skip}
        targets = [
            s for s in self.states if id(s) not in skipped and s.status in ("running", "pending")
        ]
        if targets:
            self.progress(f"stopping {len(targets)} workers")
            outcomes = self._map(
                lambda s: self._remote(s, stop_script(self.options, s.worker)), targets
            )
            for state, outcome in zip(targets, outcomes, strict=True):
                if f"{_STOPPED} killed".encode() in outcome.stdout:
                    result.stopped.append(state.worker)
                    state.status = "stopped"
            fetch = [s for s in targets if s.launched]
            for state, res in zip(
                fetch,
                self._map(
                    lambda s: self._remote(s, poll_script(self.options, s.worker, s.offset)), fetch
                ),
                strict=True,
            ):
                self._absorb(state, res)
        result.exit_codes = {
            (s.worker.slice_index, s.worker.worker_index): s.exit_code
            for s in self.states
            if s.exit_code is not None
        }
        return result

    def run(self) -> RunResult:
        try:
            return self._run()
        except KeyboardInterrupt:
            self.progress("interrupted: stopping every worker")
            return self._abort(
                RunResult(EXIT_INTERRUPTED, self.options.log_dir, message="interrupted")
            )
        except Exception:
            # A bug or a local error must not leave detached commands running on the workers.
            self.progress("internal error: stopping every worker")
            self._abort(RunResult(EXIT_WORKER_FAILED, self.options.log_dir))
            raise
        finally:
            self._pool.shutdown(wait=True)

    def _run(self) -> RunResult:
        started = self.clock()
        if self.options.upload is not None:
            dest = self.options.workdir or f"~/multislice/{self.options.upload.resolve().name}"
            problem = self.upload(make_archive(self.options.upload), dest)
            if problem is not None:
                return problem
        problem = self.launch()
        if problem is not None:
            return problem
        last_report = self.clock()
        while True:
            self.poll_once()
            failed = [s for s in self.states if s.status == "failed"]
            if failed:
                first = min(
                    failed, key=lambda s: (s.exit_time or float("inf"), self.states.index(s))
                )
                reason = first.last_error or "the command exited with a non-zero status"
                # Let the failing worker's log arrive in full before quoting its last lines.
                self._drain(first)
                failure = WorkerFailure(
                    first.worker, first.exit_code, reason, first.tail(self.options.tail_lines)
                )
                return self._abort(
                    RunResult(EXIT_WORKER_FAILED, self.options.log_dir, failure=failure)
                )
            lost = [
                s
                for s in self.states
                if s.unreachable_since is not None
                and self.clock() - s.unreachable_since >= self.options.unreachable_timeout_s
            ]
            if lost:
                result = RunResult(
                    EXIT_UNREACHABLE,
                    self.options.log_dir,
                    unreachable=[(s.worker, s.last_error) for s in lost],
                )
                return self._abort(result)
            if all(s.status == "done" and s.offset >= s.exit_size for s in self.states):
                return self._abort(RunResult(EXIT_OK, self.options.log_dir))
            now = self.clock()
            timeout = self.options.run_timeout_s
            if timeout is not None and now - started >= timeout:
                return self._abort(
                    RunResult(
                        EXIT_TIMEOUT,
                        self.options.log_dir,
                        message=f"the run did not finish within --timeout {timeout:g}s",
                    )
                )
            if now - last_report >= 15:
                counts = _count(self.states)
                self.progress(", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
                last_report = now
            if not any(s.status == "done" and s.offset < s.exit_size for s in self.states):
                time.sleep(self.options.poll_interval_s)

    def _drain(self, state: _WorkerState) -> None:
        for _ in range(8):
            if state.offset >= state.exit_size:
                return
            self._absorb(
                state, self._remote(state, poll_script(self.options, state.worker, state.offset))
            )


def _count(states: Iterable[_WorkerState]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for state in states:
        counts[state.status] = counts.get(state.status, 0) + 1
    return counts


def _check_workers(workers: Sequence[Worker]) -> None:
    if not workers:
        raise ValueError("no workers to run on: the worker list is empty")
    seen: dict[tuple[int, int], Worker] = {}
    for worker in workers:
        key = (worker.slice_index, worker.worker_index)
        if key in seen:
            raise ValueError(
                f"slice {key[0]} worker {key[1]} is listed twice: {seen[key].host} and {worker.host}"
            )
        seen[key] = worker


def run_on_workers(
    workers: Sequence[Worker],
    transport: Transport,
    options: RunOptions,
    progress: Callable[[str], None] | None = None,
) -> RunResult:
    """Launch `options.command` detached on every worker, poll until all finish or one fails."""
    return FanOut(workers, transport, options, progress).run()


def format_result(result: RunResult) -> str:
    lines: list[str] = []
    if result.failure is not None:
        lines.append(result.failure.describe())
    if result.unreachable:
        lines.append(f"{len(result.unreachable)} worker(s) unreachable (timed out after retrying):")
        lines += [f"  {worker.label}: {error}" for worker, error in result.unreachable]
    if result.message:
        lines.append(result.message)
    if result.stopped:
        lines.append(f"stopped {len(result.stopped)} other worker(s)")
    if result.exit_code == EXIT_OK:
        lines.append(f"all {len(result.exit_codes)} workers exited with 0")
    lines.append(f"logs: {result.log_dir}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Command line.


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
    source = parser.add_argument_group("workers")
    source.add_argument("--queued-resource", help="queued resource id (workers from the TPU API)")
    source.add_argument("--project", help="Google Cloud project of the queued resource")
    source.add_argument("--zone", help="zone of the queued resource")
    source.add_argument(
        "--hosts", type=Path, help="file of 'SLICE WORKER HOST [PORT]' lines instead of the TPU API"
    )
    ssh = parser.add_argument_group("transport")
    ssh.add_argument("--transport", choices=("ssh", "gcloud"), default="ssh")
    ssh.add_argument("--user", help="remote user (ssh transport)")
    ssh.add_argument("--identity-file", help="private key for ssh")
    ssh.add_argument("--known-hosts", help="known_hosts file for ssh (default: ssh's own)")
    ssh.add_argument(
        "--iap", action="store_true", help="tunnel through IAP (ssh: ProxyCommand; gcloud: flag)"
    )
    ssh.add_argument("--internal-ip", action="store_true", help="gcloud transport: --internal-ip")
    ssh.add_argument(
        "--ssh-port", type=int, help="SSH port of discovered workers (default: ssh's, 22)"
    )
    ssh.add_argument("--connect-timeout", type=int, default=10, help="seconds (default 10)")
    run = parser.add_argument_group("run")
    run.add_argument("--max-concurrency", type=int, default=16, help="SSH connections at once")
    run.add_argument("--poll-interval", type=float, default=5.0, help="seconds between polls")
    run.add_argument(
        "--unreachable-timeout",
        type=float,
        default=120.0,
        help="seconds a worker may stay unreachable before the run fails (default 120)",
    )
    run.add_argument("--timeout", type=float, help="fail (and stop all) after this many seconds")
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
    parser.add_argument("remote_command", nargs=argparse.REMAINDER, help="-- COMMAND ...")
    parser.set_defaults(func=main)


def _options_from_args(args: argparse.Namespace) -> RunOptions:
    command = list(args.remote_command)
    if command and command[0] == "--":
        command = command[1:]
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
        poll_interval_s=args.poll_interval,
        unreachable_timeout_s=args.unreachable_timeout,
        call_timeout_s=max(30.0, 3.0 * args.connect_timeout),
        run_timeout_s=args.timeout,
        workdir=workdir,
        env=tuple(env),
        upload=args.upload,
        remote_root=args.remote_root,
    )


def _workers_from_args(args: argparse.Namespace) -> list[Worker]:
    from scripts.transports import discover_workers, parse_hosts_file

    if args.hosts is not None:
        if args.queued_resource:
            raise ValueError("give either --hosts or --queued-resource, not both")
        return parse_hosts_file(args.hosts.read_text(), source=str(args.hosts))
    missing = [
        f"--{n}"
        for n in ("queued-resource", "project", "zone")
        if not getattr(args, n.replace("-", "_"))
    ]
    if missing:
        raise ValueError(
            f"missing {', '.join(missing)}: workers come from a queued resource unless --hosts is given"
        )
    if args.ssh_port is not None and not 0 < args.ssh_port < 65536:
        raise ValueError(f"--ssh-port {args.ssh_port} is not a port number (1-65535)")
    return discover_workers(args.project, args.zone, args.queued_resource, ssh_port=args.ssh_port)


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


def main(args: argparse.Namespace) -> int:
    try:
        options = _options_from_args(args)
        transport = _transport_from_args(args)
        workers = _workers_from_args(args)
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"multislice run: {exc}", file=sys.stderr)
        return 2

    def progress(message: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)

    try:
        result = run_on_workers(workers, transport, options, progress)
    except ValueError as exc:
        print(f"multislice run: {exc}", file=sys.stderr)
        return 2
    print(format_result(result), file=sys.stderr if result.exit_code else sys.stdout)
    return result.exit_code

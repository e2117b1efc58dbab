"""The `multislice run` engine: one command on every worker of every slice, no fan-out deadlock.

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

import concurrent.futures as cf
import secrets
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from scripts.fanout.options import RunOptions
from scripts.fanout.remote import (
    LAUNCHED,
    STATUS,
    STOPPED,
    UPLOADED,
    launch_script,
    make_archive,
    poll_script,
    stop_script,
    upload_script,
)
from scripts.fanout.transports import TRANSPORT_FAILURE_EXIT_CODE, Transport
from scripts.fanout.workers import Worker, check_workers

EXIT_OK = 0
EXIT_WORKER_FAILED = 1
EXIT_UNREACHABLE = 3
EXIT_TIMEOUT = 4
EXIT_INTERRUPTED = 130


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


HOST_KEY_REFUSED = (
    "ssh refused its host key (Host key verification failed): the key it showed is not one the "
    "TPU API publishes for it, nor in --known-hosts (a VM re-created since, or a machine posing "
    "as it); nothing ran there")


@dataclass
class _CallResult:
    returncode: int
    stdout: bytes
    stderr: str
    timed_out: bool = False

    @property
    def host_key_refused(self) -> bool:
        """ssh refused the worker's host key: retrying cannot change that."""
        return self.returncode == TRANSPORT_FAILURE_EXIT_CODE and (
            "Host key verification failed" in self.stderr)

    @property
    def transport_failed(self) -> bool:
        return self.timed_out or (self.returncode == TRANSPORT_FAILURE_EXIT_CODE
                                  and not self.host_key_refused)

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
        check_workers(workers)
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
                elif result.host_key_refused:
                    failed.append((state, HOST_KEY_REFUSED))
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
            self.states, lambda s: self._remote(s, upload_script(dest), archive), UPLOADED
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
            if LAUNCHED.encode() in result.stdout:
                state.launched = True
                state.status = "running"
                with lock:
                    launched[0] += 1
                    if launched[0] % step == 0 and launched[0] < n:
                        self.progress(f"launched {launched[0]}/{n}")
            return result

        unreachable, failed = self._until_reachable(self.states, launch_one, LAUNCHED)
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
        if result.transport_failed or not header.startswith(STATUS.encode()):
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
                if f"{STOPPED} killed".encode() in outcome.stdout:
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

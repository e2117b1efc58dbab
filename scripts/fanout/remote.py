"""The POSIX sh snippets `multislice run` sends to each worker, and the upload archive.

Every value is quoted by shlex. Each snippet prints a marker line the engine looks for, so a reply
that lacks it (an SSH failure, a login banner gone wrong) is never mistaken for success.
Per-run files on a worker, under RunOptions.remote_root/RUN_ID/sSLICE-wWORKER/:
`pid` (the command's process group), `nonce`, `log`, `exit` ("CODE EPOCH"), `stopped`.
"""

from __future__ import annotations

import io
import shlex
import tarfile
from collections.abc import Iterable
from pathlib import Path

from scripts.fanout.options import RunOptions
from scripts.fanout.workers import Worker

LAUNCHED = "MULTISLICE_LAUNCHED"
STATUS = "MULTISLICE_STATUS"
STOPPED = "MULTISLICE_STOPPED"
UPLOADED = "MULTISLICE_UPLOADED"
UPLOAD_EXCLUDES = (".git", ".venv", "__pycache__", ".pytest_cache", ".ruff_cache", "runs", "*.pyc")


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
        f'if [ "$(cat "$d/nonce" 2>/dev/null)" = {shlex.quote(nonce)} ]; then echo {LAUNCHED} again; exit 0; fi; '
        'echo "$d already holds an earlier run; choose another --run-id" >&2; exit 17; fi; '
        f'mkdir -p "$d" && echo {shlex.quote(nonce)} > "$d/nonce" && '
        f"{cd}export {exports} && "
        f'(setsid sh -c {shlex.quote(_WRAPPER)} "$d" {shlex.quote(options.command)} '
        '> "$d/log" 2>&1 < /dev/null &) && '
        # Wait (briefly) for the pid file so a stop right after launch always finds the group.
        'i=0; while [ ! -f "$d/pid" ] && [ $i -lt 200 ]; do sleep 0.05; i=$((i+1)); done; '
        f'[ -f "$d/pid" ] && echo {LAUNCHED}'
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
        f'echo "{STATUS} $st size $size"; '
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
        f"echo {STOPPED} killed; else echo {STOPPED} idle; fi"
    )


def upload_script(dest: str) -> str:
    dest_q = remote_path(dest)
    return f"mkdir -p {dest_q} && tar -xzf - -C {dest_q} && echo {UPLOADED}"


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

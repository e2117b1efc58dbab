"""`multislice logs`: the trainer's log of a stack's hosts (TPU VMs) or pods (GKE), from the copy
the start-up script ships to the bucket (RUN_DIR/logs/HOST.log every minute and at every exit; a
pod's also as HOST.run-UID.attempt-N.log when it ends, since the next attempt's pod starts a new
file; UID is the JobSet object's, so a replaced or recreated JobSet's attempts overwrite none).

Every log is read in ranges of CHUNK_BYTES, so memory stays bounded whatever its size; `--follow`
polls each object and prints what was appended (a log that shrank is a new pod's: it starts over,
with a line saying so). The same logs reach Cloud Logging through the hosts' consoles, prefixed
with host and attempt; `logging_link` is the console query `multislice status` prints.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scripts.argtypes import UsageError, positive_seconds, whole_number

CHUNK_BYTES = 1 << 20
EXIT_OK, EXIT_NOT_FOUND, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
_ATTEMPT_OBJECT = re.compile(
    r"^(?P<host>.+?)(?:\.run-(?P<run>[0-9a-f-]{1,8}))?\.attempt-(?P<attempt>\d+)\.log\Z")
_VM_RESTART = re.compile(r"^=== restart (\d+) ")


@dataclass(frozen=True)
class HostLog:
    host: str
    object_name: str
    attempt: int | None = None  # a pod's finished attempt; None: the host's current log
    run: str | None = None  # the JobSet object (its UID's start) whose attempt it was
    updated: float = 0.0  # when the object was written (seconds since the epoch)

    @property
    def label(self) -> str:
        return f"{self.host} run {self.run}" if self.run else self.host


def logging_link(cfg: Any) -> str:
    """The Cloud Logging console query of the stack's hosts (TPU VMs) or pods (GKE)."""
    if cfg.orchestration == "gke":
        from infra.gke import manifest as gke_manifest

        query = (f'resource.type="k8s_container"\n'
                 f'resource.labels.cluster_name="{gke_manifest.cluster_name(cfg)}"\n'
                 f'resource.labels.namespace_name="{gke_manifest.namespace(cfg)}"\n'
                 f'labels."k8s-pod/jobset_sigs_k8s_io/jobset-name"="{cfg.names.jobset}"')
        project = gke_manifest.cluster_project(cfg)
    else:
        nodes = " OR ".join(f'"{node}"' for node in cfg.names.node_ids)
        query = f'resource.type="tpu_worker"\nresource.labels.node_id=({nodes})'
        project = cfg.project
    return ("https://console.cloud.google.com/logs/query;query="
            f"{urllib.parse.quote(query, safe='')}?project={project}")


TAIL_BYTES = 64 * 1024  # how much of a log's end status reads for its last error line


def tail_text(blob: Any, max_bytes: int = TAIL_BYTES) -> str:
    """The whole lines in the last `max_bytes` of a log object (a line cut at the start of the
    range is left out), decoded."""
    size = int(blob.size or 0)
    start = max(0, size - max_bytes)
    if size == 0:
        return ""
    text = blob.download_as_bytes(start=start).decode(errors="replace")
    return text.split("\n", 1)[1] if start and "\n" in text else text


def _read_range(blob: Any, start: int, end: int) -> Iterator[bytes]:
    """Bytes start..end-1 of the object, CHUNK_BYTES at a time."""
    while start < end:
        stop = min(end, start + CHUNK_BYTES)
        yield blob.download_as_bytes(start=start, end=stop - 1)
        start = stop


MAX_LINE_BYTES = 64 * 1024  # a longer line is printed cut: memory is bounded by line too
# C0 controls but tab, DEL and C1 controls: a host writes these bytes, the deployer's terminal
# would obey them (colours, cursor moves, a title, OSC 52 into the clipboard)
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """Host-written text with every control character shown as an escape (\\x1b), never
    obeyed by the terminal it is printed on."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


class _Lines:
    """Splits a stream of chunks into lines, keeping at most one partial line, itself at most
    MAX_LINE_BYTES: the rest of a longer line is counted, not kept, and the line ends with a
    note of how much was cut."""

    def __init__(self) -> None:
        self.partial = b""
        self.cut = 0  # bytes of the current line dropped past MAX_LINE_BYTES

    def _line(self, data: bytes, cut: int) -> str:
        text = printable(data.decode(errors="replace"))
        return f"{text} ...[{cut:,} bytes of this line cut]" if cut else text

    def feed(self, chunk: bytes) -> list[str]:
        out = []
        *lines, rest = chunk.split(b"\n")
        for line in lines:
            whole = self.partial + line
            cut = self.cut + max(0, len(whole) - MAX_LINE_BYTES)
            out.append(self._line(whole[:MAX_LINE_BYTES], cut))
            self.partial, self.cut = b"", 0
        whole = self.partial + rest
        self.cut += max(0, len(whole) - MAX_LINE_BYTES)
        self.partial = whole[:MAX_LINE_BYTES]
        return out

    def rest(self) -> str:
        return self._line(self.partial, self.cut) if self.partial or self.cut else ""


class _AttemptFilter:
    """A VM's one log holds its restarts: the lines of attempt N of its current spec."""

    def __init__(self, attempt: int | None) -> None:
        self.attempt, self.current = attempt, 0
        self.seen: set[int] = set()  # the restarts of the current spec met so far

    def keep(self, line: str) -> bool:
        if self.attempt is None:
            return True
        if line.startswith("=== spec generation "):
            self.current, self.seen = 0, {0}
        elif (match := _VM_RESTART.match(line)) is not None:
            self.current = int(match[1])
            self.seen.add(self.current)
        else:
            self.seen.add(self.current)
        return self.current == self.attempt


def _list_logs(client: Any, cfg: Any, startup: bool = False) -> list[HostLog]:
    """The trainer logs in the run's logs/ (or with `startup`, the start-up logs)."""
    prefix = cfg.names.run_dir.removeprefix(f"gs://{cfg.names.bucket}/") + "/logs/"
    found = []
    for item in client.list_blobs(cfg.names.bucket, prefix=prefix):
        name = item.name[len(prefix):]
        if "/" in name or not name.endswith(".log") or \
                name.endswith(".startup.log") != startup:
            continue
        if startup:
            found.append(HostLog(name.removesuffix(".startup.log"), item.name))
            continue
        match = _ATTEMPT_OBJECT.match(name)
        updated = item.updated.timestamp() if getattr(item, "updated", None) else 0.0
        found.append(HostLog(match["host"], item.name, int(match["attempt"]), match["run"],
                             updated) if match else HostLog(name[:-4], item.name))
    # a host's attempts in order, those of several JobSet objects by when they were written
    return sorted(found, key=lambda h: (h.host, h.attempt if h.attempt is not None else -1,
                                        h.updated))


def _slices(client: Any, cfg: Any) -> dict[str, str]:
    """host -> slice, from the hosts' spec reports (HOST.spec)."""
    import json

    prefix = cfg.names.run_dir.removeprefix(f"gs://{cfg.names.bucket}/") + "/logs/"
    slices = {}
    for item in client.list_blobs(cfg.names.bucket, prefix=prefix):
        if item.name.endswith(".spec"):
            try:
                row = json.loads(item.download_as_bytes())
            except ValueError:
                continue
            slices[str(row.get("host", ""))] = str(row.get("slice", ""))
    return slices


def choose(logs: list[HostLog], hosts: set[str] | None, attempt: int | None
           ) -> tuple[list[tuple[HostLog, int | None]], str]:
    """The logs to print, each with the VM attempt to filter it to, or a problem line."""
    chosen = [log for log in logs if hosts is None or log.host in hosts]
    if not chosen:
        return [], ""
    out: list[tuple[HostLog, int | None]] = []
    for host in sorted({log.host for log in chosen}):
        mine = [log for log in chosen if log.host == host]
        if attempt is None:
            out += [(log, None) for log in mine if log.attempt is None]
            continue
        kept = [log for log in mine if log.attempt == attempt]
        if kept:  # one per JobSet object that had an attempt N, the oldest first
            out += [(log, None) for log in sorted(kept, key=lambda h: h.updated)]
        elif not any(log.attempt is not None for log in mine):  # a VM: one file, restarts in it
            out += [(log, attempt) for log in mine if log.attempt is None]
    if not out:
        have = sorted({log.attempt for log in chosen if log.attempt is not None})
        names = ", ".join(sorted({log.host for log in chosen}))
        kept_attempts = ", ".join(map(str, have)) or "none: the current log only"
        return [], f"no attempt {attempt} in the logs of {names} (attempts kept: {kept_attempts})"
    return out, ""


def print_logs(client: Any, cfg: Any, *, hosts: set[str] | None = None,
               attempt: int | None = None, follow: bool = False, interval_s: float = 5.0,
               write: Callable[[str], None] = print,
               warn: Callable[[str], None] = lambda line: print(line, file=sys.stderr),
               sleep: Callable[[float], None] = time.sleep,
               stop: Callable[[], bool] = lambda: False) -> int:
    """Print the chosen logs (each line prefixed with its host when there are several); a
    problem is one line to `warn`."""
    bucket = client.bucket(cfg.names.bucket)
    logs = _list_logs(client, cfg)
    chosen, problem = choose(logs, hosts, attempt)
    where = f"{cfg.names.run_dir}/logs/"
    if problem:
        warn(f"multislice logs: {problem}")
        return EXIT_NOT_FOUND
    if not chosen:
        asked = ", ".join(sorted(hosts)) if hosts else "any host"
        startup = [log for log in _list_logs(client, cfg, startup=True)
                   if hosts is None or log.host in hosts]
        if startup and attempt is None:
            # A host that never started its trainer stopped during boot: its start-up log says
            # why (no environment, a refused index, a bad spec).
            warn(f"multislice logs: no trainer log of {asked} in {where} yet; printing the "
                 f"start-up log of {', '.join(sorted({log.host for log in startup}))}, where "
                 "a boot error is")
            chosen = [(log, None) for log in startup]
        else:
            known = ", ".join(sorted({log.host for log in logs})) or \
                "none yet: no host has started its trainer"
            warn(f"multislice logs: no trainer log of {asked} in {where} (hosts with logs: "
                 f"{known})")
            return EXIT_NOT_FOUND
    several = len({log.label for log, _ in chosen}) > 1
    offsets = {log.object_name: 0 for log, _ in chosen}
    splitters = {log.object_name: _Lines() for log, _ in chosen}
    filters = {log.object_name: _AttemptFilter(vm_attempt) for log, vm_attempt in chosen}
    while True:
        for log, _ in chosen:
            blob = bucket.get_blob(log.object_name)
            if blob is None:
                continue
            size, start = int(blob.size or 0), offsets[log.object_name]
            if size < start:  # replaced by a shorter log: a new pod's
                write(f"[{log.label}] (a new log: the pod was recreated)")
                start, splitters[log.object_name] = 0, _Lines()
                filters[log.object_name] = _AttemptFilter(filters[log.object_name].attempt)
            for chunk in _read_range(blob, start, size):
                for line in splitters[log.object_name].feed(chunk):
                    if filters[log.object_name].keep(line):
                        write(f"[{log.label}] {line}" if several else line)
            offsets[log.object_name] = size
        if not follow or stop():
            for log, _ in chosen:  # a last line without its newline
                rest = splitters[log.object_name].rest()
                if rest and filters[log.object_name].keep(rest):
                    write(f"[{log.label}] {rest}" if several else rest)
            missing = [(log.host, sorted(f.seen)) for log, _ in chosen
                       if (f := filters[log.object_name]).attempt is not None
                       and f.attempt not in f.seen]
            for host, seen in missing:
                warn(f"multislice logs: no restart {attempt} in {host}'s log of its current "
                     f"spec (restarts in it: {', '.join(map(str, seen)) or 'none'})")
            return EXIT_NOT_FOUND if missing and len(missing) == len(chosen) else EXIT_OK
        sleep(interval_s)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "logs", help="print (and follow) the trainer's log of a stack's hosts or pods",
        description="The trainer's log (steps, losses, warnings, tracebacks) of every host or "
        "pod of the stack, from the copy in its bucket (RUN_DIR/logs/HOST.log), for TPU VMs "
        "and GKE alike. Memory stays bounded on a log of any size. Exit 0, 1 (no such log), "
        "2 (bad arguments or stack), 130 (Ctrl-C).")
    parser.add_argument("--stack-config", type=Path, required=True, metavar="Pulumi.<stack>.yaml")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--host", metavar="H", help="one host (a TPU VM's hostname, a pod's "
                       "name without its suffix: JOBSET-slice-S-P)")
    which.add_argument("--slice", type=whole_number(0), metavar="S",
                       help="every host of slice S")
    parser.add_argument("--attempt", type=whole_number(0), metavar="N",
                        help="a pod's JobSet attempt N, or a VM's restart N of its current spec")
    parser.add_argument("--follow", action="store_true",
                        help="keep printing what the hosts append (every --interval seconds)")
    parser.add_argument("--interval", type=positive_seconds, default=5.0, metavar="S",
                        help="seconds between polls with --follow (default 5)")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from scripts.local.from_stack import load_stack

    try:
        cfg, _ = load_stack(args.stack_config, check_files=False)
    except UsageError as exc:
        print(f"multislice logs: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        from google.cloud import storage

        from scripts.gcs import check_reachable

        check_reachable(cfg.names.run_dir)
        client = storage.Client(project=cfg.project)
        hosts = {args.host} if args.host else None
        if args.slice is not None:
            hosts = {h for h, s in _slices(client, cfg).items() if s == str(args.slice)}
            if not hosts:
                print(f"multislice logs: no host reports slice {args.slice} in "
                      f"{cfg.names.run_dir}/logs/ (HOST.spec)", file=sys.stderr)
                return EXIT_NOT_FOUND
        return print_logs(client, cfg, hosts=hosts, attempt=args.attempt, follow=args.follow,
                          interval_s=args.interval,
                          write=lambda line: print(line, flush=True))
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except Exception as exc:  # no credentials, no bucket, a refused read: one line
        first = (str(exc).splitlines() or [""])[0][:300]
        print(f"multislice logs: cannot read {cfg.names.run_dir}/logs/: "
              f"{type(exc).__name__}: {first}", file=sys.stderr)
        return EXIT_NOT_FOUND

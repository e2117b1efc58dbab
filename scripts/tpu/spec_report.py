"""Which launch spec each TPU VM runs, from what the VMs report to the stack's bucket.

The stack's launch spec object (gs://BUCKET/launch/STACK.json, written by `pulumi up`) says what
every VM should run; each VM's startup script writes RUN_DIR/logs/HOST.spec (generation, code
hash, state) whenever it applies, starts, finishes or gives up on a spec. `multislice status`
shows both, so an operator sees whether an update has landed on every host.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class HostSpec:
    host: str
    generation: str
    archive_sha256: str
    state: str  # applying | running | finished | stopped | failed
    time: str
    current: bool  # runs the generation the spec object has now
    error: str = ""  # a failed host's last error line, from its start-up log


@dataclass
class SpecReport:
    uri: str
    generation: str  # "" when the object does not exist
    archive_sha256: str
    hosts: list[HostSpec] = field(default_factory=list)
    error: str = ""  # why the bucket could not be read

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def landed(self) -> bool:
        return bool(self.hosts) and all(h.current for h in self.hosts)


def last_error_line(bucket: Any, object_name: str) -> str:
    """The last line of a start-up log that says ERROR (else its last line), from at most its
    last TAIL_BYTES; "" when there is no such log."""
    from scripts.logs import printable, tail_text

    blob = bucket.get_blob(object_name)
    if blob is None:
        return ""
    lines = [line for line in tail_text(blob).splitlines() if line.strip()]
    errors = [line for line in lines if "ERROR" in line]
    line = (errors or lines or [""])[-1]
    # the log's own prefix ("2026-...Z multislice-startup: ") says nothing a table needs
    return printable(line.split("multislice-startup: ", 1)[-1][:300])


def read_spec_report(cfg: Any, client: Any = None) -> SpecReport:
    """The spec object and every host's report; errors become `error`, never an exception (the
    queued resource's status is still worth showing)."""
    names = cfg.names
    report = SpecReport(uri=names.launch_spec_uri, generation="", archive_sha256="")
    try:
        from google.cloud import storage

        if client is None:
            from scripts.gcs import check_reachable

            check_reachable(names.launch_spec_uri)  # seconds, not the client's 2-minute retries
            client = storage.Client(project=cfg.project)
        bucket = client.bucket(names.bucket)
        blob = bucket.get_blob(names.launch_spec_object)
        if blob is not None:
            report.generation = str(blob.generation)
            pinned = bucket.blob(names.launch_spec_object, generation=blob.generation)
            spec = json.loads(pinned.download_as_bytes())
            report.archive_sha256 = str(spec.get("archive_sha256", ""))
        logs = names.run_dir.removeprefix(f"gs://{names.bucket}/") + "/logs/"
        for item in client.list_blobs(names.bucket, prefix=logs):
            if not item.name.endswith(".spec"):
                continue
            row = json.loads(item.download_as_bytes())
            report.hosts.append(HostSpec(
                host=str(row.get("host", item.name.rsplit("/", 1)[-1][:-5])),
                generation=str(row.get("generation", "")),
                archive_sha256=str(row.get("archive_sha256", "")),
                state=str(row.get("state", "")),
                time=str(row.get("time", "")),
                current=str(row.get("generation", "")) == report.generation,
            ))
            if report.hosts[-1].state == "failed":
                report.hosts[-1].error = last_error_line(
                    bucket, f"{logs}{report.hosts[-1].host}.startup.log")
    except Exception as exc:  # no credentials, no bucket yet, a malformed report: say which
        report.error = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"
    report.hosts.sort(key=lambda h: h.host)
    return report


def spec_renderable(report: SpecReport) -> Any:
    from rich.console import Group
    from rich.markup import escape
    from rich.table import Table

    if report.error:
        return Group(f"launch spec {report.uri}: [yellow]cannot read the bucket[/yellow] "
                     f"({report.error}); it needs Google credentials that can read it, or "
                     "STORAGE_EMULATOR_HOST pointing at a storage emulator (README: Rehearse "
                     "operations against the TPU API emulator)")
    if not report.generation:
        head = f"launch spec {report.uri}: [red]does not exist[/red] (run pulumi up)"
    else:
        head = (f"launch spec {report.uri}: generation {report.generation}, code "
                f"{report.archive_sha256[:12]}")
    if not report.hosts:
        return Group(head, "no host has reported a spec yet")
    landed = sum(h.current for h in report.hosts)
    table = Table()
    for column in ("host", "generation", "code", "state"):
        table.add_column(column, no_wrap=True)
    table.add_column("reported", overflow="fold")
    failed = any(h.error for h in report.hosts)
    if failed:
        table.add_column("last error (logs --host H prints the rest)", overflow="fold")
    for h in report.hosts:
        generation = h.generation if h.current else f"[yellow]{h.generation} (old)[/yellow]"
        table.add_row(h.host, generation, h.archive_sha256[:12], h.state, h.time,
                      *([f"[red]{escape(h.error)}[/red]" if h.error else ""] if failed else []))
    return Group(f"{head}; on {landed} of {len(report.hosts)} reporting hosts", table)

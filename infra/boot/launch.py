"""Turn the launch spec (the bucket object that metadata ``launch-spec-uri`` names) into what the
startup script needs.

Runs on the TPU VM under the system python3 before any venv exists, so: standard library only.
The startup script fetches this file from metadata (``multislice-launch-py``) and calls::

    python3 launch.py check SPEC URI      # fail early, naming what is wrong (URI: where SPEC was read)
    python3 launch.py get SPEC KEY        # one top-level value (archive_uri, python_version, ...)
    python3 launch.py argv SPEC           # trainer arguments, NUL-separated (no shell parsing)
    python3 launch.py gcs-object URI      # gs://B/K -> "B K" with K percent-encoded for the API
    python3 launch.py json-field KEY      # one string field of the JSON object on stdin
    python3 launch.py lock-python LOCK    # the exact CPython (3.X.Y) the lock's header names
    python3 launch.py changes OLD NEW     # what differs between two specs, for the log
    python3 launch.py archive-sha256 FILE # sha256 of the tar inside a .tar.gz (the archive's name)
    python3 launch.py elastic-live LISTING SLICE SLICES WORKERS STALE_S
                                          # the slices whose every host beat recently (below)

The spec is written by infra/manifest.py:launch_spec; the trainer flags follow docs/CONTRACTS.md.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import re
import sys
import urllib.parse
import zlib
from typing import Any

SUPPORTED_VERSIONS = (3,)
REQUIRED_KEYS = (
    "version",
    "stack",
    "trainer",
    "archive_uri",
    "archive_sha256",
    "run_dir",
    "logs_uri",
    "python_version",
    "mesh",
    "expect_slices",
    "expect_devices_per_slice",
    "envs_uri",
    "lock_file",
    "init_timeout_s",
    "max_restarts",
    "run_as",
    "storage_retry_s",
    "spec_poll_s",
)
GS_KEYS = ("archive_uri", "run_dir", "logs_uri", "envs_uri")
# Optional keys and their defaults (a spec without them reads as before they existed).
DEFAULTS = {"egress": "nat", "package_index": "", "python_mirror": "", "env_sha256": ""}
EGRESS = ("nat", "none")


class LaunchSpecError(ValueError):
    pass


def check_place(spec: dict[str, Any], spec_uri: str) -> None:
    """A spec names only objects of the bucket it was read from, where the deployer put them:
    the hosts would otherwise fetch code or an environment from, or write checkpoints and logs
    to, a bucket a rewritten spec chose."""
    bucket, _, name = spec_uri.removeprefix("gs://").partition("/")
    if not spec_uri.startswith("gs://") or not bucket or not name:
        raise LaunchSpecError(f"{spec_uri!r} is not a gs://BUCKET/OBJECT URI")
    own = f"gs://{bucket}/"
    expected = {"archive_uri": f"{own}code/{spec['archive_sha256']}.tar.gz",
                "envs_uri": f"{own}envs"}
    for key, want in expected.items():
        if spec[key] != want:
            raise LaunchSpecError(f"{key} {spec[key]!r} is not {want!r}: a spec names only its "
                                  f"own bucket's objects ({spec_uri})")
    run_dir = str(spec["run_dir"])
    if not (run_dir.startswith(f"{own}runs/") and "/" not in run_dir.removeprefix(f"{own}runs/")
            and run_dir != f"{own}runs/"):
        raise LaunchSpecError(f"run_dir {run_dir!r} is not a {own}runs/NAME directory: a spec "
                              f"names only its own bucket's objects ({spec_uri})")
    if spec["logs_uri"] != f"{run_dir}/logs":
        raise LaunchSpecError(f"logs_uri {spec['logs_uri']!r} is not {run_dir + '/logs'!r}")


def load(path: str, spec_uri: str | None = None) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as fh:
            spec = json.load(fh)
    except (OSError, json.JSONDecodeError) as exc:
        raise LaunchSpecError(f"launch spec {path!r} cannot be read as JSON: {exc}") from None
    check(spec)
    if spec_uri is not None:
        check_place(spec, spec_uri)
    return spec


def check(spec: Any) -> None:
    if not isinstance(spec, dict):
        raise LaunchSpecError(f"launch spec must be a JSON object, got {type(spec).__name__}")
    missing = [k for k in REQUIRED_KEYS if k not in spec]
    if missing:
        raise LaunchSpecError(
            f"launch spec lacks {', '.join(missing)}; required: {', '.join(REQUIRED_KEYS)}"
        )
    if spec["version"] not in SUPPORTED_VERSIONS:
        raise LaunchSpecError(
            f"launch spec version {spec['version']!r} is not supported; "
            f"this launcher reads {SUPPORTED_VERSIONS}"
        )
    sha = spec["archive_sha256"]
    if not (isinstance(sha, str) and len(sha) == 64 and all(c in "0123456789abcdef" for c in sha)):
        raise LaunchSpecError(f"archive_sha256 {sha!r} is not a hex sha256 digest")
    for key in GS_KEYS:
        bucket, _, path = str(spec[key]).removeprefix("gs://").partition("/")
        if not str(spec[key]).startswith("gs://") or not bucket or not path:
            raise LaunchSpecError(f"{key} {spec[key]!r} is not a gs://BUCKET/PATH URI")
    if not (isinstance(spec["run_as"], str) and re.fullmatch(r"[a-z_][a-z0-9_-]{0,31}",
                                                             spec["run_as"])):
        raise LaunchSpecError(f"run_as {spec['run_as']!r} is not a user name")
    if not isinstance(spec["trainer"], dict):
        raise LaunchSpecError(f"trainer {spec['trainer']!r} is not an object")
    for key in ("init_timeout_s", "max_restarts", "storage_retry_s", "spec_poll_s"):
        if not isinstance(spec[key], int) or isinstance(spec[key], bool) or spec[key] < 0:
            raise LaunchSpecError(f"{key} {spec[key]!r} is not a non-negative integer")
    if spec.get("egress", "nat") not in EGRESS:
        raise LaunchSpecError(f"egress {spec['egress']!r} is not one of {', '.join(EGRESS)}")
    for key in ("env_sha256",):
        value = spec.get(key, "")
        if value and not (isinstance(value, str) and re.fullmatch(r"[0-9a-f]{64}", value)):
            raise LaunchSpecError(f"{key} {value!r} is not a hex sha256 digest")
    if not str(spec["archive_uri"]).endswith(f"/{sha}.tar.gz"):
        raise LaunchSpecError(
            f"archive_uri {spec['archive_uri']!r} does not name the archive by its hash {sha}"
        )


def gcs_object(uri: str) -> str:
    """``gs://BUCKET/KEY`` -> ``BUCKET KEY`` with KEY percent-encoded as the JSON API wants it."""
    bucket, _, key = uri.removeprefix("gs://").partition("/")
    if not uri.startswith("gs://") or not bucket or not key:
        raise LaunchSpecError(f"{uri!r} is not a gs://BUCKET/OBJECT URI")
    return f"{bucket} {urllib.parse.quote(key, safe='')}"


LOCK_HEADER = "# multislice-lock: "


def lock_python(path: str) -> str:
    """The interpreter (3.X.Y) recorded in the lock's header line (infra/lock.py)."""
    try:
        with open(path, encoding="utf-8") as fh:
            first = fh.readline()
        header = json.loads(first[len(LOCK_HEADER):]) if first.startswith(LOCK_HEADER) else {}
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise LaunchSpecError(f"lock {path!r} cannot be read: {exc}") from None
    interpreter = header.get("interpreter") if isinstance(header, dict) else None
    if not (isinstance(interpreter, str) and re.fullmatch(r"3\.\d+\.\d+", interpreter)):
        raise LaunchSpecError(f"lock {path!r} names no interpreter 3.X.Y in its header (found "
                              f"{interpreter!r}); remake it with `multislice lock` and pulumi up")
    return interpreter


def toml_scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(str(value))  # a TOML basic string uses JSON's escapes for these characters


def trainer_argv(spec: dict[str, Any]) -> list[str]:
    """``python -m trainer.main`` arguments for this spec (docs/CONTRACTS.md)."""
    trainer = spec["trainer"]
    argv = [
        "--config",
        str(trainer.get("config", "default")),
        "--steps",
        str(int(trainer.get("steps", 1000))),
        "--run-dir",
        str(spec["run_dir"]),
    ]
    if trainer.get("seed") is not None:
        argv += ["--seed", str(int(trainer["seed"]))]
    for key in ("ici_data", "ici_fsdp", "ici_tensor", "dcn_data", "dcn_fsdp", "dcn_tensor"):
        argv += ["--set", f"mesh.{key}={int(spec['mesh'][key])}"]
    # Pipeline stages only when there are any: an experiment forked before the pipeline axis
    # existed has no such keys, and one stage is its default anyway.
    for key in ("ici_pipeline", "dcn_pipeline"):
        if int(spec["mesh"].get(key, 1)) != 1:
            argv += ["--set", f"mesh.{key}={int(spec['mesh'][key])}"]
    # Axes the experiment adds (its trainer/config.py MESH_AXES: infra/mesh.py), every key given;
    # the built-in keys are spelled here because this module runs on the hosts, stdlib only
    builtin = {f"{group}_{axis}" for group in ("ici", "dcn")
               for axis in ("data", "fsdp", "tensor", "pipeline")}
    for key in sorted(set(spec["mesh"]) - builtin):
        argv += ["--set", f"mesh.{key}={int(spec['mesh'][key])}"]
    for key, value in sorted((trainer.get("overrides") or {}).items()):
        argv += ["--set", f"{key}={toml_scalar(value)}"]
    argv += [
        "--expect-slices",
        str(int(spec["expect_slices"])),
        "--expect-devices-per-slice",
        str(int(spec["expect_devices_per_slice"])),
    ]
    return argv


def _leaves(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_leaves(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: value}


def changes(old: dict[str, Any], new: dict[str, Any]) -> str:
    """``field old -> new, ...`` for every field that differs (digests shortened)."""
    def shown(value: Any) -> str:
        text = json.dumps(value, sort_keys=True) if value is not None else "(none)"
        return text[1:13] if isinstance(value, str) and len(value) == 64 else text

    was, now = _leaves(old), _leaves(new)
    # archive_uri follows archive_sha256, trainer.mesh.* (with -1 fills) the resolved mesh.*,
    # trainer.max_restarts (and the like) the top-level copy the startup script reads
    def derived(key: str) -> bool:
        return key == "archive_uri" or key.startswith("trainer.mesh.") or (
            key.startswith("trainer.") and key.removeprefix("trainer.") in new)

    keys = sorted(k for k in was.keys() | now.keys() if was.get(k) != now.get(k) and not
                  derived(k))
    return ", ".join(f"{k} {shown(was.get(k))} -> {shown(now.get(k))}" for k in keys) or \
        "no field differs"


def archive_sha256(path: str) -> str:
    """sha256 of the tar a .tar.gz holds: what infra/archive.py names the archive by, so the
    name depends on the tree alone, not on the deployer's zlib (zlib and zlib-ng differ)."""
    digest = hashlib.sha256()
    try:
        with gzip.open(path, "rb") as fh:
            while chunk := fh.read(1 << 20):
                digest.update(chunk)
    except (OSError, EOFError, zlib.error) as exc:  # BadGzipFile is an OSError
        raise LaunchSpecError(f"{path} is not a whole gzip file ({exc})") from None
    return digest.hexdigest()


HEARTBEAT = re.compile(r"(?:^|/)s(\d+)-w(\d+)@([0-9A-Za-z.:\-\[\]]+)$")


def _rfc3339(text: str) -> float:
    """Seconds of a GCS `updated` time (YYYY-MM-DDThh:mm:ss.fffZ, any number of fraction digits:
    the image's Python 3.10 fromisoformat takes only 3 or 6), comparable between objects."""
    import calendar

    match = re.fullmatch(r"(\d{4})-(\d\d)-(\d\d)T(\d\d):(\d\d):(\d\d)(\.\d+)?Z", text)
    if not match:
        raise LaunchSpecError(f"not an RFC 3339 UTC time: {text[:40]!r}")
    whole = calendar.timegm(tuple(int(g) for g in match.groups()[:6]) + (0, 0, 0))
    return whole + float(match.group(7) or 0)


def elastic_live(listing: dict[str, Any], own_slice: int, slices: int, workers: int,
                 stale_s: float) -> tuple[list[int], str]:
    """(live slices, the address of the first live slice's worker 0) from a GCS listing of the
    hosts' heartbeat objects (`.../alive/sSLICE-wWORKER@ADDRESS`, rewritten every few seconds
    by each host's startup script while it trains or waits to). A slice is live when every one
    of its workers wrote within `stale_s` of the newest beat of this host's own slice (the
    bucket's clock on both sides: the hosts' clocks never meet). Every host that reads the
    same listing finds the same answer."""
    newest: dict[tuple[int, int], tuple[float, str]] = {}
    for item in listing.get("items") or []:
        match = HEARTBEAT.search(str(item.get("name", "")))
        if not match or not item.get("updated"):
            continue
        place = (int(match.group(1)), int(match.group(2)))
        when = _rfc3339(str(item["updated"]))
        if place not in newest or when > newest[place][0]:
            newest[place] = (when, match.group(3))
    own = [newest[(own_slice, w)][0] for w in range(workers) if (own_slice, w) in newest]
    if not own:
        raise LaunchSpecError(f"no heartbeat of this host's slice {own_slice} in the listing")
    reference = max(own)
    live = [s for s in range(slices)
            if all((s, w) in newest and newest[(s, w)][0] >= reference - stale_s
                   for w in range(workers))]
    return live, newest[(live[0], 0)][1] if live else ""


def _scalar(spec: dict[str, Any], key: str) -> str:
    spec = {**DEFAULTS, **spec}
    if key not in spec or isinstance(spec[key], dict | list):
        raise LaunchSpecError(f"launch spec has no scalar key {key!r}")
    return str(spec[key])


def main(argv: list[str]) -> int:
    usage = ("usage: launch.py check SPEC [URI] | get SPEC KEY | fields SPEC KEY... | argv SPEC | "
             "gcs-object URI | json-field KEY | lock-python LOCK | changes OLD NEW | "
             "archive-sha256 FILE | elastic-live LISTING SLICE SLICES WORKERS STALE_S")
    if not argv:
        print(usage, file=sys.stderr)
        return 2
    cmd, args = argv[0], argv[1:]
    try:
        if cmd == "check" and len(args) in (1, 2):
            load(*args)
        elif cmd == "get" and len(args) == 2:
            sys.stdout.write(_scalar(load(args[0]), args[1]))
        elif cmd == "fields" and len(args) >= 2:  # one interpreter start for a host's settings
            spec = load(args[0])
            sys.stdout.write("".join(_scalar(spec, key) + "\0" for key in args[1:]))
        elif cmd == "argv" and len(args) == 1:
            sys.stdout.write("\0".join(trainer_argv(load(args[0]))) + "\0")
        elif cmd == "gcs-object" and len(args) == 1:
            sys.stdout.write(gcs_object(args[0]) + "\n")
        elif cmd == "changes" and len(args) == 2:
            sys.stdout.write(changes(load(args[0]), load(args[1])))
        elif cmd == "archive-sha256" and len(args) == 1:
            sys.stdout.write(archive_sha256(args[0]))
        elif cmd == "elastic-live" and len(args) == 5:
            with open(args[0], encoding="utf-8") as listing:
                live, address = elastic_live(json.load(listing), int(args[1]), int(args[2]),
                                             int(args[3]), float(args[4]))
            sys.stdout.write(",".join(map(str, live)) + " " + address + "\n")
        elif cmd == "lock-python" and len(args) == 1:
            sys.stdout.write(lock_python(args[0]))
        elif cmd == "json-field" and len(args) == 1:
            try:
                value = json.load(sys.stdin)[args[0]]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise LaunchSpecError(f"no string field {args[0]!r} in the JSON on stdin "
                                      f"({type(exc).__name__})") from None
            if not isinstance(value, str):
                raise LaunchSpecError(f"field {args[0]!r} is not a string")
            sys.stdout.write(value)
        else:
            print(usage, file=sys.stderr)
            return 2
    except LaunchSpecError as exc:
        print(f"launch.py: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

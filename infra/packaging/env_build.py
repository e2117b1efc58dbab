"""The environment of an experiment's lock, built on the deployer's machine exactly as a TPU host
or GKE pod builds it, and published to the stack's bucket: for hosts with no public internet
(`multislice:egress: none`). Used by `multislice env-publish` and by `pulumi up` itself
(infra/preview/env_check.py) where the deployer's machine qualifies.

It is the hosts' own build, not a second one: the start-up script's functions (infra/boot/
startup.sh: `install_uv`, `build_env`, `mark_env_complete` and what they use, uv's pinned version
and wheel hashes) run unchanged in a private mount namespace whose /opt is a directory of this
run, so the environment lands at /opt/multislice/envs/KEY, the absolute path every host uses (a
venv's interpreter path is absolute). The key is the hosts' (env_key: the
lock's sha256, the CPython its header names, x86_64 like the TPU hosts, so this builds on Linux
x86_64 only), uv and the lock are installed with their hashes enforced, and the archive is
published as KEY.tar.gz, then KEY.tar.gz.sha256 (whose presence says the archive is whole);
`pulumi up` pins that digest in the launch spec (env_sha256), and a host installs the archive
only when its bytes match the spec's digest. The package index is whatever pip and uv are pointed at on this machine
(PIP_INDEX_URL, UV_INDEX_URL, UV_PYTHON_INSTALL_MIRROR...), an organisation's mirror included.

Root builds in a mount namespace (`unshare --mount`); another user in a user namespace of their
own (`unshare --user --map-root-user --mount`) where the kernel allows that. The build holds
nothing of the deployer's: its environment keeps only the installers' settings, the network's
proxy and certificates and PATH (build_environ), HOME is a scratch directory, the deployer's home
directories and credential files are hidden in its namespace (HIDE: an empty tmpfs, /dev/null;
what the kept settings name is bound back), and no package code runs in it (wheels only;
bytecode compiled without the site module, so no `.pth` file runs).
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infra.packaging.lock import read_header

STARTUP = Path(__file__).resolve().parents[1] / "boot" / "startup.sh"
HOST_MACHINE = "x86_64"  # `uname -m` on every TPU VM and GKE TPU node
FORMAT = "tar.gz"  # every host reads it (a host without zstd cannot read tar.zst)


def env_key(lock: Path) -> str | None:
    """The hosts' key of the environment of `lock` (infra/boot/startup.sh ENV_KEY), or None for
    a lock without our header (the lock checks name that)."""
    header = read_header(lock) if lock.is_file() else None
    interpreter = header.get("interpreter") if header else None
    if not isinstance(interpreter, str):
        return None
    return f"{hashlib.sha256(lock.read_bytes()).hexdigest()}-cpython{interpreter}-{HOST_MACHINE}"
_FUNCTIONS = ("free_kib", "exact_index", "index_answer", "index_refused", "reach_hint",
              "last_line", "install_uv", "build_env", "compile_env_bytecode", "env_tree_digest",
              "mark_env_complete")
_ASSIGNMENTS = ("UV_VERSION", "UV_WHEEL_SHA256")


def startup_parts() -> str:
    """The start-up script's build functions and uv's pins, as its text has them."""
    text = STARTUP.read_text()
    parts = []
    for name in _ASSIGNMENTS:
        match = re.search(rf"^{name}=(\([^)]*\)|.*)$", text, re.M)
        if match is None:
            raise RuntimeError(f"{STARTUP} has no {name}= line")
        parts.append(match.group(0))
    for name in _FUNCTIONS:
        match = (re.search(rf"^{name}\(\) \{{[^\n]*\}}$", text, re.M)  # a one-line function
                 or re.search(rf"^{name}\(\) \{{\n.*?^\}}$", text, re.M | re.S))
        if match is None:
            raise RuntimeError(f"{STARTUP} does not define {name}()")
        parts.append(match.group(0))
    return "\n".join(parts)


# $1 work dir, $2 lock, $3 key, $4 interpreter, $5 output tarball ("" for none), $6 the
# directory that holds envs/ ("" for /opt/multislice, with this run's own /opt mounted there).
HIDE = r"""
hide_deployers_files() {
  # The deployer's home and credential files ("$@") behind an empty tmpfs (a directory) or
  # /dev/null (a file), so nothing the build runs can read them; what the installers' own
  # settings name ($keep, a line each: a cache, a wheel directory, a CA bundle) is bound back
  # where they look for it.
  local path n
  local -a kept=()
  mkdir -p "$work/keep"
  while IFS= read -r path; do
    [[ -n "$path" && -e "$path" ]] || continue
    n="${#kept[@]}"
    if [[ -d "$path" ]]; then mkdir -p "$work/keep/$n"; else : >"$work/keep/$n"; fi
    mount --bind "$path" "$work/keep/$n"
    kept+=("$path")
  done <<<"$keep"
  for path in "$@"; do
    if [[ -d "$path" ]]; then
      mount -t tmpfs -o mode=0700 multislice-hidden "$path"
    elif [[ -e "$path" ]]; then
      mount --bind /dev/null "$path"
    fi
  done
  for n in "${!kept[@]}"; do
    if [[ -d "$work/keep/$n" ]]; then
      mkdir -p "${kept[$n]}"
    else
      mkdir -p "$(dirname "${kept[$n]}")" && { [[ -e "${kept[$n]}" ]] || : >"${kept[$n]}"; }
    fi
    mount --bind "$work/keep/$n" "${kept[$n]}"
  done
}
"""

BUILD = r"""
set -euo pipefail
work="$1" lock="$2" key="$3" interpreter="$4" out="$5" opt_dir="$6" keep="$7"
shift 7
%(hide)sif [[ -z "$opt_dir" ]]; then
  mount --make-rprivate /
  mount --bind "$work/opt" /opt
  hide_deployers_files "$@"
  opt_dir=/opt/multislice
fi
OPT_DIR="$opt_dir"
STARTUP_LOG="$work/build.log"
index_env() {
  # The stack's index and CPython mirror (multislice:package_index), as the hosts use them; the
  # deployer's own token for Artifact Registry, from the environment, never argv. No index:
  # this machine's own pip and uv settings name it.
  INDEX_ENV=()
  [[ -n "${PACKAGE_INDEX:-}" ]] || return 0
  local url="$PACKAGE_INDEX"
  [[ -z "${INDEX_TOKEN:-}" ]] || url="${url%%://*}://oauth2accesstoken:${INDEX_TOKEN}@${url#*://}"
  exact_index "$url"
}
WHERE="this machine" WHO="your account" MEMBER="user:YOU"  # what reach_hint's advice names
INDEX_REFUSED="$work/index-refused"
log() { printf '%s env-publish: %s\n' "$(date -u +%FT%TZ)" "$*" >&2; printf '%s\n' "$*" >>"$STARTUP_LOG"; }
die() { log "ERROR: $*"; exit 1; }
%(parts)s
LOCK="$lock" LOCK_FILE="$(basename "$lock")" ENV_KEY="$key" INTERPRETER="$interpreter"
ENV_DIR="$OPT_DIR/envs/$ENV_KEY"
VENV="$ENV_DIR/venv"
UV="$OPT_DIR/tools/uv-$UV_VERSION/bin/uv"
mkdir -p "$OPT_DIR"
build_env
mark_env_complete
[[ -z "$out" ]] || tar -C "$ENV_DIR" -czf "$out" python venv
"""
# Where an image built by infra/boot/Dockerfile.env keeps its environments: not under
# /opt/multislice, which a GKE pod's node cache (a hostPath volume) hides. startup.sh looks
# here first (IMAGE_ENVS).
IMAGE_ENVS_ROOT = "/usr/local/share/multislice"


def machine_problem() -> str | None:
    """Why this machine cannot build what a TPU host would, or None."""
    if sys.platform != "linux" or platform.machine() != HOST_MACHINE:
        return (f"this machine is {sys.platform} {platform.machine()}; the TPU hosts are Linux "
                f"{HOST_MACHINE}, and an environment (its CPython, its wheels) is built for one "
                "machine: run it on a Linux x86_64 machine (a CI runner, a Cloud Shell, a VM)")
    for tool in ("unshare", "tar", "python3"):
        if shutil.which(tool) is None:
            return f"{tool} is not on PATH; it is what the build needs (util-linux, tar, python3)"
    if subprocess.run(["python3", "-m", "pip", "--version"], capture_output=True).returncode:
        return "python3 has no pip, which installs the pinned uv as a host does: install pip"
    if not Path("/opt").is_dir():
        return "/opt does not exist here; the build mounts its own directory there"
    return None


def published(bucket: Any, key: str) -> str | None:
    """The environment object for `key` the bucket holds already, or None."""
    return f"envs/{key}.{FORMAT}" if published_sha256(bucket, key) else None


def published_sha256(bucket: Any, key: str) -> str | None:
    """The sha256 a deployer wrote beside the environment archive of `key` (its `.sha256`
    object, written after the archive), or None. Only deployers write envs/ (the hosts' grant
    is conditioned on their run), so this is what `pulumi up` pins in the launch spec; the
    hosts never read it. A record is taken only when it holds the archive's crc32c (what Cloud
    Storage reports of an object without a download), as every deployer's publish of this
    toolkit writes it, and only while the archive is still those bytes: an archive replaced
    after its record was written is not pinned (the hosts would refuse it by its sha256). A
    record without it predates those records, when hosts could write envs/ too: it is not
    pinned after an upgrade, so a deployer publishes the environment again
    (`legacy_record` says so)."""
    name = f"envs/{key}.{FORMAT}"
    text = _record_text(bucket, key)
    digest = parse_sha256(text)
    if digest is None:
        return None
    archive = bucket.get_blob(name)
    if archive is None:
        return None
    recorded = recorded_crc32c(text)
    return digest if recorded is not None and archive.crc32c == recorded else None


def legacy_record(bucket: Any, key: str) -> bool:
    """Whether `key`'s `.sha256` record is one of before this toolkit's records (a digest and
    no crc32c line): what `published_sha256` no longer pins."""
    text = _record_text(bucket, key)
    return parse_sha256(text) is not None and recorded_crc32c(text) is None


def _record_text(bucket: Any, key: str) -> str:
    """The `.sha256` record beside `key`'s environment archive ("" when there is none)."""
    blob = bucket.get_blob(f"envs/{key}.{FORMAT}.sha256")
    return blob.download_as_text() if blob is not None and blob.size else ""


def parse_sha256(text: str) -> str | None:
    """`SHA  KEY.tar.gz` (sha256sum's format, the record's first line) -> SHA, or None for what
    is not a hex sha256."""
    first = (text.splitlines() or [""])[0].split()
    return first[0] if first and re.fullmatch(r"[0-9a-f]{64}", first[0]) else None


def recorded_crc32c(text: str) -> str | None:
    """The archive's crc32c a record's `crc32c BASE64` line holds (records of before this
    toolkit's have none)."""
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) == 2 and fields[0] == "crc32c":
            return fields[1]
    return None


@dataclass(frozen=True)
class Index:
    """Where a build takes its packages and interpreter: the stack's package_index (None: this
    machine's own pip and uv settings)."""

    url: str | None = None
    python_mirror: str | None = None
    token: str | None = None  # the password given as user oauth2accesstoken; None: none

    def environ(self) -> dict[str, str]:
        """What the build script reads: the URLs and the token."""
        if not self.url:
            return {}
        return {"PACKAGE_INDEX": self.url, "PYTHON_MIRROR": self.python_mirror or "",
                **({"INDEX_TOKEN": self.token} if self.token else {})}


def build(lock: Path, key: str, interpreter: str, out: Path | None, log: Path,
          into: str | None = None, index: Index = Index()) -> None:
    """The hosts' build, at /opt/multislice in a mount namespace of its own, or in place under
    `into` (an image's IMAGE_ENVS_ROOT, as root in a `docker build`), from `index`; packed to
    `out` when given. Raises RuntimeError with the log's last error line and the log's path
    (the whole build's output, uv's and pip's errors included), or the script's own output
    when it ended before writing a log."""
    hidden = [] if into else deployers_files(os.environ)
    work = Path(tempfile.mkdtemp(prefix="multislice-env-", dir=_outside(hidden)))
    try:
        (work / "opt").mkdir()
        script = BUILD.replace("%(parts)s", startup_parts()).replace("%(hide)s", HIDE)
        namespace = [] if into else (["unshare", "--mount"] if os.geteuid() == 0
                                     else ["unshare", "--user", "--map-root-user", "--mount"])
        (work / "home").mkdir()
        # The lock, and the archive until it is done, live in the build's own directory: the
        # experiment (and the output path) may be under the home the build does not see.
        shutil.copyfile(lock, work / lock.name)
        environ = build_environ(os.environ, index, work / "home")
        keep = "\n".join(_named_paths(environ, hidden))
        done = subprocess.run([*namespace, "bash", "-c", script, "env-publish", str(work),
                               str(work / lock.name), key, interpreter,
                               str(work / "env.tar.gz") if out else "", into or "", keep,
                               *hidden],
                              capture_output=True, text=True, env=environ)
        if done.returncode == 0 and out:
            shutil.move(work / "env.tar.gz", out)
        kept = (work / "build.log").exists()
        if kept:
            log.write_text(redact((work / "build.log").read_text(errors="replace")))
        if done.returncode != 0:
            lines = [line for line in done.stderr.splitlines() if line.strip()]
            error = next((line for line in reversed(lines) if "ERROR" in line),
                         lines[-1] if lines else f"exit {done.returncode}")
            if "unshare" in error and os.geteuid() != 0:
                error += " (this kernel refuses user namespaces: run it as root, e.g. sudo)"
            where = f"build log: {log}" if kept else "it ended before its log began"
            raise RuntimeError(redact(f"{error.split('env-publish: ', 1)[-1]} ({where})"))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def deployers_files(environ: Any) -> list[str]:
    """What the build must not read: the deployer's home directories (HOME, the account's, a
    sudo user's) and the credential files and directories Google's tools name."""
    import pwd

    paths = [environ.get("HOME", "")]
    for user in (os.getuid(), environ.get("SUDO_USER")):
        try:
            paths.append(pwd.getpwuid(user).pw_dir if isinstance(user, int)
                         else pwd.getpwnam(user).pw_dir if user else "")
        except KeyError:
            continue
    paths += [environ.get("GOOGLE_APPLICATION_CREDENTIALS", ""), environ.get("CLOUDSDK_CONFIG", "")]
    out: list[str] = []
    for path in paths:
        if path and os.path.isabs(path) and os.path.exists(path) and path != "/":
            real = os.path.realpath(path)
            if real not in out and real != "/":
                out.append(real)
    return out


def _outside(hidden: list[str]) -> str | None:
    """A temporary directory's parent that no hidden path contains (None: the default)."""
    for base in (tempfile.gettempdir(), "/tmp", "/var/tmp"):
        real = os.path.realpath(base)
        if os.path.isdir(real) and not any(
                real == h or real.startswith(h.rstrip("/") + "/") for h in hidden):
            return real
    raise RuntimeError(f"no temporary directory outside {', '.join(hidden)} for the build: set "
                       "TMPDIR to one")


def _named_paths(environ: dict[str, str], hidden: list[str]) -> list[str]:
    """Existing absolute paths the kept settings name (a cache, a wheel directory, a config
    file, a CA bundle), which the build must still reach; for a PATH directory inside a hidden
    one, the tool's whole directory there (~/.pyenv for ~/.pyenv/shims: a shim runs the rest of
    its tree); never a hidden directory itself."""
    out = []

    def keep(path: str) -> None:
        if os.path.isabs(path) and os.path.exists(path) and path not in out \
                and os.path.realpath(path) not in hidden:
            out.append(path)

    for name, value in environ.items():
        if name == "PATH":
            for entry in value.split(os.pathsep):
                real = os.path.realpath(entry) if entry else ""
                inside = [h for h in hidden if real.startswith(h.rstrip("/") + "/")]
                if inside:
                    below = real[len(inside[0].rstrip("/")) + 1:].split("/", 1)[0]
                    keep(os.path.join(inside[0], below))
            continue
        if name == "HOME":
            continue
        parts = value.split(os.pathsep) if name.startswith(("PIP_", "UV_")) else [value]
        for part in parts:
            for word in part.split():
                keep(word)
    return out


# What the build keeps of the deployer's environment: where to find programs, the locale, the
# proxy and certificates of this network, and the installers' own settings (PIP_*, UV_*: where
# they fetch from). Nothing else, so no credential variable (GOOGLE_APPLICATION_CREDENTIALS,
# CLOUDSDK_*, a CI token) reaches it, and HOME is a scratch directory, not the deployer's.
_KEPT = frozenset({"PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "SSL_CERT_FILE", "SSL_CERT_DIR",
                   "http_proxy", "https_proxy", "no_proxy", "HTTP_PROXY", "HTTPS_PROXY",
                   "NO_PROXY"})
_KEPT_PREFIXES = ("PIP_", "UV_")


def build_environ(environ: Any, index: Index, home: Path) -> dict[str, str]:
    """The build's environment: what _KEPT keeps of `environ`, the stack's index, and `home`."""
    kept = {name: value for name, value in environ.items()
            if name in _KEPT or name.startswith(_KEPT_PREFIXES)}
    return {**kept, "HOME": str(home), **index.environ()}


def redact(text: str) -> str:
    """A URL's password (the index token the build put there) never reaches a message."""
    return re.sub(r"(://[^/:@\s]+:)[^@\s]+@", r"\1***@", text)


@dataclass(frozen=True)
class Published:
    uri: str
    sha256: str
    size_mib: float
    build_s: float
    upload_s: float


def build_and_publish(bucket: Any, lock: Path, key: str, interpreter: str,
                      log: Path, index: Index = Index()) -> Published:
    """Build the environment here from `index` and publish it to `bucket` (a
    google-cloud-storage Bucket) as a host does; raises RuntimeError (one line) when the build
    fails."""
    name = f"envs/{key}.{FORMAT}"
    with tempfile.TemporaryDirectory(prefix="multislice-env-out-") as tmp:
        out = Path(tmp) / f"{key}.{FORMAT}"
        started = time.monotonic()
        build(lock, key, interpreter, out, log, index=index)
        build_s = time.monotonic() - started
        digest = hashlib.sha256()
        with out.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
        started = time.monotonic()
        archive = bucket.blob(name)
        archive.upload_from_filename(str(out))  # its properties, crc32c included, come back
        # last: its presence says the archive is whole
        bucket.blob(f"{name}.sha256").upload_from_string(
            sha256_text(key, digest.hexdigest(), archive.crc32c))
        return Published(f"gs://{bucket.name}/{name}", digest.hexdigest(),
                         out.stat().st_size / 2**20, build_s, time.monotonic() - started)


def sha256_text(key: str, archive_sha256: str, crc32c: str | None = None) -> str:
    """The `.sha256` object beside an environment archive (published_sha256 reads it): the
    archive's sha256 as sha256sum writes it, then the crc32c Cloud Storage reported for it."""
    return f"{archive_sha256}  {key}.{FORMAT}\n" + (f"crc32c {crc32c}\n" if crc32c else "")


def main(argv: list[str]) -> int:
    """`python3 -m infra.packaging.env_build --into DIR LOCK`: the build of a container image
    (infra/boot/Dockerfile.env), in place under DIR; standard library only."""
    if len(argv) != 3 or argv[0] != "--into":
        print("usage: python3 -m infra.packaging.env_build --into DIR LOCK", file=sys.stderr)
        return 2
    into, lock = argv[1], Path(argv[2])
    key = env_key(lock)
    if key is None:
        print(f"{lock}: no `multislice lock` header naming its interpreter", file=sys.stderr)
        return 2
    interpreter = key.split("-cpython", 1)[1].rsplit("-", 1)[0]
    try:
        build(lock, key, interpreter, None, Path(tempfile.gettempdir()) / "env-build.log",
              into=into)
    except RuntimeError as exc:
        print(f"the build failed: {exc}", file=sys.stderr)
        return 1
    print(f"environment {key} built in {into}/envs/{key}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

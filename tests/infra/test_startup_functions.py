"""Functions of infra/boot/startup.sh, run on their own with a stand-in for the HTTP call.

The boot tests run the whole script on emulated hosts; a race between two of its processes
shows there only now and then (CI once saw one read another's answer). Here the interleaving is
forced."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STARTUP = ROOT / "infra" / "boot" / "startup.sh"
LAUNCH_PY = ROOT / "infra" / "boot" / "launch.py"
ROUNDS = 3

# Stands in for gcs_call: writes the object's metadata where `-o` says, waits (so that a
# concurrent call writes in between), then prints the HTTP status. An object's generation is
# the length of its name as the URL spells it (percent-encoded) times 111.
FAKE_GCS_CALL = r"""
gcs_call() {
  local out="" url=""
  shift
  while [[ $# -gt 0 ]]; do
    case "$1" in -o) out="$2"; shift 2 ;; *) url="$1"; shift ;; esac
  done
  local name="${url%%\?*}"; name="${name##*/}"
  printf '{"generation": "%s"}' "$(( ${#name} * 111 ))" >"$out"
  sleep 0.3
  echo 200
}
"""


def startup_functions(*names: str) -> str:
    text = STARTUP.read_text()
    bodies = []
    for name in names:
        match = re.search(rf"^{name}\(\) \{{\n.*?^\}}\n", text, re.M | re.S)
        assert match, f"{name} is not defined in {STARTUP}"
        bodies.append(match.group(0))
    return "\n".join(bodies)


def test_concurrent_generation_reads_each_get_their_own_objects_generation(tmp_path):
    # Two processes of the script (a pod's stop watch and its trainer loop) read generations at
    # once: each must read its own answer, never the other's.
    script = f"""
set -u
STATE_DIR={tmp_path}
LAUNCH_PY={LAUNCH_PY}
GCS_URL=http://storage.invalid
{FAKE_GCS_CALL}
{startup_functions("gcs_generation")}
for round in $(seq {ROUNDS}); do
  gcs_generation gs://bucket/envs/k.claim >"$STATE_DIR/claim.$round" &
  sleep 0.1
  gcs_generation gs://bucket/launch/spec.json >"$STATE_DIR/spec.$round" &
  wait
done
"""
    subprocess.run(["bash", "-c", script], check=True, timeout=60)
    for round_ in range(1, ROUNDS + 1):
        assert (tmp_path / f"claim.{round_}").read_text().strip() == str(len("envs%2Fk.claim") * 111)
        assert (tmp_path / f"spec.{round_}").read_text().strip() == str(len("launch%2Fspec.json") * 111)
    assert not list(tmp_path.glob("object*.json")), "response files are left behind"


def run_functions(script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "-c", "set -euo pipefail\n" + script], capture_output=True,
                          text=True, timeout=60)


ENV_FUNCTIONS = startup_functions("env_tree_digest", "mark_env_complete", "env_marker_matches",
                                  "env_verified")


def env_check(env_dir: Path, key: str = "k1", pinned: str = "") -> subprocess.CompletedProcess[str]:
    return run_functions(f"""
log() {{ echo "$*"; }}
ENV_DIR={env_dir} ENV_KEY={key} ENV_SHA={pinned!r} IMAGE_ENVS=/usr/local/share/multislice/envs
{ENV_FUNCTIONS}
if env_verified; then echo VERIFIED; else echo REBUILD; fi
""")


def test_an_environment_is_trusted_only_as_its_marker_pinned_it(tmp_path):
    env_dir = tmp_path / "envs" / "k1"
    (env_dir / "venv" / "bin").mkdir(parents=True)
    (env_dir / "venv" / "pyvenv.cfg").write_text("home = /x\n")
    (env_dir / "venv" / "bin" / "python").symlink_to("/opt/python3")
    marked = run_functions(f"""
ENV_DIR={env_dir} ENV_KEY=k1 ENV_SHA=""
{ENV_FUNCTIONS}
mark_env_complete""")
    assert marked.returncode == 0, marked.stderr
    assert env_check(env_dir).stdout.splitlines()[-1] == "VERIFIED"
    # bytecode Python writes as it imports is not part of the environment
    (env_dir / "venv" / "__pycache__").mkdir()
    (env_dir / "venv" / "__pycache__" / "x.pyc").write_bytes(b"\0")
    assert env_check(env_dir).stdout.splitlines()[-1] == "VERIFIED"
    # another key (a foreign environment at this path) is never taken for this one
    assert env_check(env_dir, key="k2").stdout.splitlines()[-1] == "REBUILD"
    assert not env_dir.exists()


def test_a_changed_environment_is_removed_and_rebuilt(tmp_path):
    def fresh() -> Path:
        env_dir = tmp_path / "k1"
        (env_dir / "venv").mkdir(parents=True)
        (env_dir / "venv" / "pyvenv.cfg").write_text("home = /x\n")
        (env_dir / "venv" / "lib.py").write_text("x = 1\n")
        assert run_functions(f"ENV_DIR={env_dir} ENV_KEY=k1 ENV_SHA=''\n{ENV_FUNCTIONS}\n"
                             "mark_env_complete").returncode == 0
        return env_dir

    damages = {
        "a byte appended": lambda d: (d / "venv" / "pyvenv.cfg").write_text("home = /x\n\n"),
        "a file removed": lambda d: (d / "venv" / "lib.py").unlink(),
        "a file added": lambda d: (d / "venv" / "extra.py").write_text(""),
        "an older toolkit's empty marker": lambda d: (d / ".complete").write_text(""),
        "no marker (an unpack cut short)": lambda d: (d / ".complete").unlink(),
    }
    for what, damage in damages.items():
        env_dir = fresh()
        damage(env_dir)
        result = env_check(env_dir)
        assert result.stdout.splitlines()[-1] == "REBUILD", what
        assert "failed verification" in result.stdout and not env_dir.exists(), what


def test_an_environment_is_reused_only_from_the_archive_the_spec_pins(tmp_path):
    """A host's own build is replaced once the spec pins the deployer's, and an installed
    archive once the spec pins another; what the spec pins is kept."""
    env_dir = tmp_path / "k1"
    (env_dir / "venv").mkdir(parents=True)
    (env_dir / "venv" / "pyvenv.cfg").write_text("home = /x\n")

    def mark(origin: str) -> None:
        assert run_functions(f"ENV_DIR={env_dir} ENV_KEY=k1 ENV_SHA={origin!r}\n"
                             f"{ENV_FUNCTIONS}\nmark_env_complete").returncode == 0

    mark("")  # built by this host
    assert env_check(env_dir).stdout.splitlines()[-1] == "VERIFIED"
    result = env_check(env_dir, pinned="a" * 64)
    assert result.stdout.splitlines()[-1] == "REBUILD" and "from built" in result.stdout
    (env_dir / "venv").mkdir(parents=True)
    (env_dir / "venv" / "pyvenv.cfg").write_text("home = /x\n")
    mark("a" * 64)  # installed from the archive the spec pinned
    assert env_check(env_dir, pinned="a" * 64).stdout.splitlines()[-1] == "VERIFIED"
    assert env_check(env_dir, pinned="b" * 64).stdout.splitlines()[-1] == "REBUILD"


def test_the_storage_token_goes_on_curls_stdin_never_in_its_argv(tmp_path):
    """/proc/PID/cmdline is readable by every user of the host (a trainer.run_as user too):
    the bearer token reaches curl on its stdin, and the request carries it."""
    import http.server
    import threading

    seen: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            seen.append(self.headers.get("Authorization", ""))
            self.send_response(200 if seen[-1] == "Bearer ya29.secret-token" else 401)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        result = run_functions(f"""
log() {{ echo "LOG $*"; }}
metadata() {{ echo '{{"access_token": "ya29.secret-token", "expires_in": 3599}}'; }}
curl() {{ printf '%s\\n' "$@" >>{tmp_path}/argv; command curl "$@"; }}
LAUNCH_PY={LAUNCH_PY} STORAGE_RETRY_S=0
{startup_functions("gcs_call")}
gcs_call "GET gs://b/o" -o {tmp_path}/out http://127.0.0.1:{server.server_port}/o
""")
    finally:
        server.shutdown()
    assert result.returncode == 0 and result.stdout.strip() == "200", result
    assert seen == ["Bearer ya29.secret-token"]
    argv = (tmp_path / "argv").read_text()
    assert "ya29" not in argv and "@-" in argv.splitlines()


STOP_FUNCTIONS = startup_functions("millis", "pod_stop_watch")


def stop_watch(tmp_path: Path, progress: list[str | None]) -> list[str]:
    """Runs pod_stop_watch once a second over the progress file's successive contents (None: no
    file) against a `sleep` standing in for the trainer; prints what it logged and whether the
    trainer was killed."""
    lines = "\n".join(
        "rm -f $PROGRESS_FILE" if text is None else f"echo '{text}' >$PROGRESS_FILE"
        for text in progress)
    script = f"""
log() {{ echo "LOG $*"; }}
PROGRESS_FILE={tmp_path}/last-step STUCK_MIN_S=10
{STOP_FUNCTIONS}
sleep 60 & pid=$!
term_at=0 term_step=""
now=1000
while read -r line; do
  eval "$line"
  pod_stop_watch "$now"
  now=$(( now + 1 ))
done <<'LINES'
{lines}
LINES
kill -TERM "$pid" 2>/dev/null || true  # still running: ended here, by SIGTERM
code=0
wait "$pid" || code=$?
if (( code == 137 )); then echo KILLED; else echo ALIVE; fi
"""
    result = run_functions(script)
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def test_a_pod_whose_trainer_finishes_no_step_after_sigterm_ends_it_at_the_limit(tmp_path):
    # step time 0.4 s: 3 step times are under the 10 s floor
    out = stop_watch(tmp_path, ["12 1000.0 0.4"] * 12)
    assert out[-1] == "KILLED"
    assert out[0] == ("LOG no step finished in 10s after SIGTERM (last finished: 12): a peer is "
                      "gone and no checkpoint can be saved; ending the trainer now instead of at "
                      "JAX's heartbeat timeout")
    # slow steps (7.5 s) get 3 of them: not killed at 12 s
    assert stop_watch(tmp_path, ["12 1000.0 7.5"] * 13) == ["ALIVE"]
    # a trainer that evaluated for 6.2 s between two steps gets twice that (13 s), not 10
    assert stop_watch(tmp_path, ["12 1000.0 0.4 6.2"] * 13) == ["ALIVE"]
    assert stop_watch(tmp_path, ["12 1000.0 0.4 6.2"] * 15)[-1] == "KILLED"
    # 3 step times of 4.2 s, rounded up to the second: 13 s
    assert stop_watch(tmp_path, ["12 1000.0 4.2 0"] * 13) == ["ALIVE"]
    assert stop_watch(tmp_path, ["12 1000.0 4.2 0"] * 14)[-1] == "KILLED"
    assert stop_watch(tmp_path, ["12 1000.0 0.4 x"] * 12)[-1] == "KILLED"  # garbled: the floor
    # killed before its first step (nothing to save), and with a garbled file
    assert stop_watch(tmp_path, [None] * 12)[-1] == "KILLED"
    assert stop_watch(tmp_path, ["12 x y"] * 12)[-1] == "KILLED"


def test_a_pod_whose_trainer_finishes_a_step_after_sigterm_is_left_to_save(tmp_path):
    out = stop_watch(tmp_path, ["12 1000.0 0.4"] * 3 + ["13 1003.0 0.4"] * 20)
    assert out == ["ALIVE"]


def test_a_pod_links_only_what_its_init_container_installed_from_the_spec_archive(tmp_path):
    """The trainer's container of a pod on the stack's own pools takes the environment its init
    container installed on the node (read-only to it) when the marker says it is this lock's,
    from the archive the spec pins, and unchanged: linked where the venv's paths point. Anything
    else, it installs in its own filesystem and leaves the node's alone."""
    sha = "a" * 64
    node = tmp_path / "node-envs"
    env = node / "k1"
    (env / "venv" / "bin").mkdir(parents=True)
    (env / "venv" / "pyvenv.cfg").write_text("home = /x\n")
    own = tmp_path / "opt" / "envs" / "k1"
    marked = run_functions(f"""
ENV_DIR={env} ENV_KEY=k1 ENV_SHA={sha}
{ENV_FUNCTIONS}
mark_env_complete""")
    assert marked.returncode == 0, marked.stderr

    def link(pinned: str) -> str:
        result = run_functions(f"""
log() {{ echo "LOG $*"; }}
die() {{ echo "DIE $*"; exit 1; }}
ENV_DIR={own} ENV_KEY=k1 ENV_SHA={pinned} NODE_ENVS={node} IMAGE_ENVS=/usr/local/share/multislice/envs
{ENV_FUNCTIONS}
{startup_functions("node_env_linked")}
if node_env_linked; then echo "LINKED $ENV_DIR"; else echo "OWN $ENV_DIR"; fi
""")
        assert result.returncode == 0, result.stderr
        return result.stdout

    out = link(sha)
    assert out.splitlines()[-1] == f"LINKED {own}" and "read-only here" in out
    assert own.is_symlink() and own.resolve() == env.resolve()
    # another archive pinned: not this one
    assert link("b" * 64).splitlines()[-1] == f"OWN {own}"
    # a FIFO planted as a .pth (no regular file, yet Python reads code through it): caught
    import os

    os.mkfifo(env / "venv" / "evil.pth")
    assert link(sha).splitlines()[-1] == f"OWN {own}"
    (env / "venv" / "evil.pth").unlink()
    assert link(sha).splitlines()[-1] == f"LINKED {own}"
    # changed on the node: not used, and not removed (read-only to the trainer's container)
    (env / "venv" / "sitecustomize.py").write_text("planted\n")
    out = link(sha)
    assert out.splitlines()[-1] == f"OWN {own}" and "installing it in this pod" in out
    assert (env / "venv" / "sitecustomize.py").exists()


CODE_FUNCTIONS = startup_functions("code_tree_digest", "node_code_copied", "compile_node_code")


def test_a_pods_code_from_the_node_is_compiled_once_and_taken_only_as_its_init_container_left_it(
        tmp_path):
    """The init container byte-compiles the code it unpacked on the node with the trainer's
    interpreter and writes the digest of the whole; the trainer's container copies it into its
    own filesystem and takes the copy only if its digest is that one. Older archives are pruned."""
    sha, old_sha = "c" * 64, "d" * 64
    node = tmp_path / "node-envs"
    env = node / "k1"
    (env / "venv" / "bin").mkdir(parents=True)
    (env / "venv" / "bin" / "python").symlink_to(Path(sys.executable))
    (env / ".complete").write_text("k1 tree sha\n")
    node_code = node / "code" / sha
    (node_code / "trainer").mkdir(parents=True)
    (node_code / "trainer" / "main.py").write_text("print('trained')\n")
    (node_code / ".complete").touch()
    (node / "code" / old_sha).mkdir()
    opt = tmp_path / "opt"
    init = run_functions(f"""
log() {{ echo "LOG $*"; }}
STARTUP_LOG={tmp_path}/startup.log OPT_DIR={opt} NODE_ENVS={node} ENV_KEY=k1
IMAGE_ENVS=/usr/local/share/multislice/envs ENV_DIR={opt}/envs/k1 VENV={opt}/envs/k1/venv
CODE_DIR={node_code}
{CODE_FUNCTIONS}
compile_node_code""")
    assert init.returncode == 0, init.stderr + init.stdout
    assert list((node_code / "trainer" / "__pycache__").glob("main.*.pyc"))
    assert (node_code / ".digest").is_file() and not (node / "code" / old_sha).exists()

    def take() -> str:
        result = run_functions(f"""
log() {{ echo "LOG $*"; }}
NODE_CODE={node_code} ARCHIVE_SHA={sha} CODE_DIR={tmp_path}/pod/code/{sha}
{CODE_FUNCTIONS}
if node_code_copied; then echo TAKEN; else echo FETCH; fi""")
        assert result.returncode == 0, result.stderr
        return result.stdout

    out = take()
    assert out.splitlines()[-1] == "TAKEN", out
    copied = tmp_path / "pod" / "code" / sha
    assert (copied / "trainer" / "main.py").read_text() == "print('trained')\n"
    assert list((copied / "trainer" / "__pycache__").glob("main.*.pyc"))
    # a changed byte on the node, source or bytecode: fetched instead, nothing half-copied kept
    pyc = next((node_code / "trainer" / "__pycache__").glob("main.*.pyc"))
    pyc.write_bytes(pyc.read_bytes()[:-1] + bytes([pyc.read_bytes()[-1] ^ 1]))
    out = take()
    assert out.splitlines()[-1] == "FETCH" and "is not the" in out, out
    assert not (tmp_path / "pod" / "code" / f"{sha}.tmp").exists()


def _prepare_user_as_nobody(bounding: str) -> subprocess.CompletedProcess[str]:
    script = f"""
set -euo pipefail
shopt -s nullglob  # as startup.sh: no TPU device files here
log() {{ echo "LOG $*"; }}
die() {{ echo "DIE $*"; exit 1; }}
RUN_AS=nobody
{startup_functions("prepare_user")}
prepare_user
"${{RUN[@]}}" true && echo "RAN as $("${{RUN[@]}}" id -un)"
"""
    return subprocess.run(["setpriv", f"--bounding-set={bounding}", "bash", "-c", script],
                          capture_output=True, text=True, timeout=30)


def test_a_trainer_user_gets_ipc_lock_only_where_the_start_up_script_may_grant_it():
    """A TPU VM's start-up script keeps every capability and hands CAP_IPC_LOCK to the trainer
    user; a GKE pod keeps none (Pod Security baseline), and setpriv must not ask for it there:
    the user's memlock limit then decides, in one line."""
    import os

    if os.geteuid() != 0:
        import pytest

        pytest.skip("prepare_user makes and drops to a user: root only")
    vm = _prepare_user_as_nobody("+all")
    assert "RAN as nobody" in vm.stdout, vm.stdout + vm.stderr
    assert "CapEff 0000000000004000" in vm.stdout  # CAP_IPC_LOCK, ambient, and nothing else
    pod = _prepare_user_as_nobody("-ipc_lock")
    assert "setpriv" not in pod.stderr, pod.stderr  # never asked for what it cannot grant
    memlock = subprocess.run(["bash", "-c", "ulimit -Hl"], capture_output=True,
                             text=True).stdout.strip()
    if memlock == "unlimited":
        assert "RAN as nobody" in pod.stdout, pod.stdout + pod.stderr
    else:
        assert f"DIE step 4 (trainer user): nobody can lock only {memlock} KiB of memory and " \
               "lacks CAP_IPC_LOCK" in pod.stdout, pod.stdout + pod.stderr


def test_a_pods_sigterm_during_a_back_off_or_an_upload_ends_it_at_once(tmp_path):
    """bash runs a trap only once its foreground command ends: a pod deleted while its script
    sleeps through an exit-5 back-off (up to 60 s) or retries an upload (up to storage_retry_s)
    would end only then. `interruptible` runs them in the background and waits, so the pod's
    trap runs at once, well within the grace period."""
    import time

    script = f"""
{startup_functions("interruptible")}
trap 'echo TRAPPED; exit 143' TERM
echo READY
interruptible sleep 60 >/dev/null  # (the orphaned sleep holds no pipe of the test's)
echo SLEPT
"""
    proc = subprocess.Popen(["bash", "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "READY\n"
    time.sleep(0.3)
    started = time.monotonic()
    proc.terminate()
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 143 and "SLEPT" not in out  # the trap's exit, not the sleep's end
    assert time.monotonic() - started < 5


def test_a_host_the_index_refused_builds_again_after_a_growing_bounded_wait_or_on_a_new_spec(
        tmp_path):
    """An index that refuses a host's token (a reader grant IAM has not propagated yet) is
    retried by the host itself, after 1x, 2x, 4x the first wait up to a ceiling, without a new
    spec; a new spec that comes first ends the wait."""
    script = f"""
log() {{ echo "LOG $*"; }}
gcs_put() {{ :; }}
spec_changed() {{ [[ -f {tmp_path}/new-spec ]] && NEW_GENERATION=2; }}
sleep() {{ SLEPT=$(( SLEPT + $1 )); NOW=$(( NOW + $1 )); }}
date() {{ echo "$NOW"; }}
NOW=1000 SLEPT=0 LOGS_URI="" SPEC_POLL_S=30 GENERATION=1 HOST_ID=h
INDEX_RETRY_S=60 INDEX_RETRY_MAX_S=100 index_retries=0
{startup_functions("wait_for_index_retry_or_spec")}
for try in 1 2 3; do
  SLEPT=0
  wait_for_index_retry_or_spec && echo "RETRY after $SLEPT" || echo "SPEC after $SLEPT"
done
touch {tmp_path}/new-spec
SLEPT=0
wait_for_index_retry_or_spec && echo "RETRY after $SLEPT" || echo "SPEC after $SLEPT"
"""
    result = run_functions(script)
    assert result.returncode == 0, result.stderr
    said = [line for line in result.stdout.splitlines() if not line.startswith("LOG")]
    assert said == ["RETRY after 60", "RETRY after 100", "RETRY after 100", "SPEC after 30"]
    assert "LOG the package index refused this host (the ERROR above): building again in 60s " \
           "(try 2), or on a new spec" in result.stdout


def test_the_environments_bytecode_is_compiled_without_running_a_packages_pth(tmp_path):
    # A locked wheel may ship a .pth file, which the interpreter's site module runs at every
    # start. The build compiles the environment's bytecode (so no trainer writes into it) with
    # site off: the .pth's code does not run as whoever builds (a deployer, CI), and cannot read
    # their credentials. uv's --compile-bytecode (which the build used) starts the interpreter
    # with site on, as plain compileall does here: the marker shows that case is caught.
    import venv

    venv.create(tmp_path / "venv", with_pip=False)
    python = tmp_path / "venv" / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path("
                                              "'purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    marker = tmp_path / "ran"
    (Path(site) / "evil.pth").write_text(
        f"import os; open({str(marker)!r}, 'w').write(os.environ.get('SECRET_TOKEN', ''))\n")
    (Path(site) / "pkg").mkdir()
    (Path(site) / "pkg" / "__init__.py").write_text("VALUE = 1\n")
    done = run_functions(f"""
STARTUP_LOG={tmp_path / 'build.log'}
{startup_functions("compile_env_bytecode")}
SECRET_TOKEN=ya29.secret compile_env_bytecode {python}""")
    assert done.returncode == 0, done.stderr
    assert not marker.exists()
    assert list((Path(site) / "pkg" / "__pycache__").glob("__init__.cpython-*.pyc"))
    subprocess.run([str(python), "-m", "compileall", "-q", site], check=True,
                   env={**os.environ, "SECRET_TOKEN": "ya29.secret"})
    assert marker.read_text() == "ya29.secret"  # with site on, the .pth ran and read it


def test_the_deployers_build_keeps_the_installers_settings_and_no_credential():
    from infra.packaging.env_build import Index, build_environ

    deployer = {"PATH": "/usr/bin", "HOME": "/home/me", "PIP_FIND_LINKS": "/srv/wheels",
                "UV_CACHE_DIR": "/srv/uv", "HTTPS_PROXY": "http://proxy:3128",
                "GOOGLE_APPLICATION_CREDENTIALS": "/home/me/key.json",
                "CLOUDSDK_AUTH_ACCESS_TOKEN": "ya29.x", "GITHUB_TOKEN": "ghp_x",
                "AWS_SECRET_ACCESS_KEY": "x", "SOMETHING": "else"}
    environ = build_environ(deployer, Index("https://idx.example/simple/", token="ya29.t"),
                            Path("/tmp/w/home"))
    assert environ == {"PATH": "/usr/bin", "HOME": "/tmp/w/home", "PIP_FIND_LINKS": "/srv/wheels",
                       "UV_CACHE_DIR": "/srv/uv", "HTTPS_PROXY": "http://proxy:3128",
                       "PACKAGE_INDEX": "https://idx.example/simple/", "PYTHON_MIRROR": "",
                       "INDEX_TOKEN": "ya29.t"}


def test_the_deployers_build_cannot_read_their_home_or_credentials_but_reaches_its_caches(
        tmp_path):
    # The environment build runs the lock's installers on the deployer's machine (or CI's): in
    # its mount namespace the deployer's home and Google's credential files are an empty tmpfs
    # and /dev/null, while what the installers' own settings name (here uv's cache, inside that
    # home) is bound back where they look. This is env_build's own snippet, run as build() runs
    # it (the real build then installs through it: tests/infra/test_startup_script.py).
    from infra.packaging.env_build import HIDE, _named_paths, deployers_files

    home = tmp_path / "home"
    (home / ".config" / "gcloud").mkdir(parents=True)
    (home / ".config" / "gcloud" / "application_default_credentials.json").write_text(
        '{"refresh_token": "1//secret"}')
    (home / ".cache" / "uv").mkdir(parents=True)
    (home / ".cache" / "uv" / "entry").write_text("cached wheel")
    key = tmp_path / "ci-key.json"
    key.write_text('{"private_key": "-----BEGIN secret"}')
    environ = {"HOME": str(home), "GOOGLE_APPLICATION_CREDENTIALS": str(key),
               "UV_CACHE_DIR": str(home / ".cache" / "uv"), "PATH": os.environ["PATH"]}
    hidden = deployers_files(environ)
    assert str(home) in hidden and str(key) in hidden
    keep = "\n".join(_named_paths({"UV_CACHE_DIR": environ["UV_CACHE_DIR"]}, hidden))
    work = tmp_path / "work"
    work.mkdir()
    script = HIDE + f"""
work={work} keep="$1"
shift
hide_deployers_files "$@"
cat {home}/.config/gcloud/application_default_credentials.json 2>/dev/null || echo "no adc"
ls -A {home}/.config 2>/dev/null | grep -q . && echo "config listed" || echo "no config"
printf 'key: [%s]\\n' "$(cat {key})"
cat {home}/.cache/uv/entry
echo made > {home}/.cache/uv/new
"""
    command = ["unshare", "--mount", "bash", "-c", script, "hide", keep, *hidden]
    if os.geteuid() != 0:
        command[1:2] = ["--user", "--map-root-user", "--mount"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0 and "unshare" in done.stderr:
        pytest.skip(f"no mount namespace here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["no adc", "no config", "key: []", "cached wheel"]
    assert "secret" not in done.stdout
    # the cache the installers wrote through the binding is the deployer's own, as before
    assert (home / ".cache" / "uv" / "new").read_text() == "made\n"

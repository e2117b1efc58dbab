"""Functions of infra/boot/startup.sh, run on their own with a stand-in for the HTTP call.

The boot tests run the whole script on emulated hosts; a race between two of its processes
shows there only now and then (CI once saw a first boot skip publishing its environment). Here
the interleaving is forced."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

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
    # The background environment publisher reads the claim's generation while the trainer loop
    # polls the spec's: each must read its own answer, or the publisher takes the spec's
    # generation for another host's claim and publishes nothing.
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

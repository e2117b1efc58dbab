#!/bin/bash
# TPU VM startup script for a multislice experiment. Fixed content (no templating): everything
# specific to the experiment comes from the `launch-spec` metadata value, read by launch.py (also
# from metadata). Runs on every boot and after every repair, so every step is idempotent:
#   1. read launch-spec + launch.py from the metadata server
#   2. fetch the experiment archive by content hash (verified) and unpack it once
#   3. create or reuse a venv with the requested Python (uv), install the experiment once
#   4. run the trainer as an unprivileged user with the fixed run directory; it resumes from the
#      latest complete checkpoint there
#   5. log to a local file and to the bucket; record the exit status
# Overrides (test harness only): MULTISLICE_METADATA_URL, MULTISLICE_BUCKET_ROOT (a local directory
# standing in for GCS), MULTISLICE_STATE_DIR, MULTISLICE_LOG_DIR, MULTISLICE_RUN_AS,
# MULTISLICE_UV, MULTISLICE_VENV (use an existing venv instead of creating one).
set -euo pipefail
umask 022

METADATA_URL="${MULTISLICE_METADATA_URL:-http://metadata.google.internal/computeMetadata/v1}"
STATE_DIR="${MULTISLICE_STATE_DIR:-/var/lib/multislice}"
LOG_DIR="${MULTISLICE_LOG_DIR:-/var/log/multislice}"
RUN_AS="${MULTISLICE_RUN_AS:-multislice}"
SPEC="$STATE_DIR/launch-spec.json"
LAUNCH_PY="$STATE_DIR/launch.py"

log() { printf '%s multislice-startup: %s\n' "$(date -u +%FT%TZ)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

metadata() {
  # $1: attribute name. Connection failures are retried (the metadata server can lag right
  # after boot); an HTTP error such as 404 (curl exit 22) means the attribute is not there.
  local attempt rc
  for attempt in 1 2 3 4 5; do
    rc=0
    curl -fsS --max-time 10 -H "Metadata-Flavor: Google" \
      "$METADATA_URL/instance/attributes/$1" || rc=$?
    case "$rc" in
      0) return 0 ;;
      22) return 1 ;;
    esac
    sleep "$attempt"
  done
  return 1
}

bucket_get() {
  # $1: gs:// URI, $2: local destination
  if [[ -n "${MULTISLICE_BUCKET_ROOT:-}" ]]; then
    cp "$(python3 "$LAUNCH_PY" local "$1")" "$2"
  else
    gcloud storage cp --quiet "$1" "$2"
  fi
}

bucket_put() {
  # $1: local file, $2: gs:// URI
  if [[ -n "${MULTISLICE_BUCKET_ROOT:-}" ]]; then
    local dest
    dest="$(python3 "$LAUNCH_PY" local "$2")"
    mkdir -p "$(dirname "$dest")"
    cp "$1" "$dest.tmp" && mv "$dest.tmp" "$dest"
  else
    gcloud storage cp --quiet "$1" "$2" >/dev/null
  fi
}

mkdir -p "$STATE_DIR" "$LOG_DIR"
# One instance at a time: a re-run of the startup script while training runs is a no-op.
exec 9>"$STATE_DIR/lock"
if ! flock -n 9; then
  log "another startup run holds $STATE_DIR/lock; nothing to do"
  exit 0
fi

# 1. launch spec (contents never logged: they are the user's config)
metadata launch-spec >"$SPEC.tmp" || die "cannot read metadata attribute launch-spec"
metadata multislice-launch-py >"$LAUNCH_PY.tmp" || die "cannot read metadata attribute multislice-launch-py"
mv "$SPEC.tmp" "$SPEC"
mv "$LAUNCH_PY.tmp" "$LAUNCH_PY"
python3 "$LAUNCH_PY" check "$SPEC"

spec_get() { python3 "$LAUNCH_PY" get "$SPEC" "$1"; }
ARCHIVE_URI="$(spec_get archive_uri)"
ARCHIVE_SHA="$(spec_get archive_sha256)"
PY_VERSION="$(spec_get python_version)"
LOGS_URI="$(spec_get logs_uri)"
HOST_ID="$(hostname -s)"
TRAIN_LOG="$LOG_DIR/train.log"

# 2. experiment code, by content hash
CODE_DIR="$STATE_DIR/code/$ARCHIVE_SHA"
if [[ ! -f "$CODE_DIR/.complete" ]]; then
  log "fetching experiment archive $ARCHIVE_SHA"
  tmp_archive="$STATE_DIR/archive.tar.gz"
  bucket_get "$ARCHIVE_URI" "$tmp_archive"
  actual="$(sha256sum "$tmp_archive" | cut -d' ' -f1)"
  [[ "$actual" == "$ARCHIVE_SHA" ]] || die "archive hash mismatch: expected $ARCHIVE_SHA, got $actual"
  rm -rf "$CODE_DIR.tmp"
  mkdir -p "$CODE_DIR.tmp"
  tar -xzf "$tmp_archive" -C "$CODE_DIR.tmp" --no-same-owner
  rm -rf "$CODE_DIR" && mv "$CODE_DIR.tmp" "$CODE_DIR"
  rm -f "$tmp_archive"
  touch "$CODE_DIR/.complete"
fi

# 3. venv with the requested Python, keyed by Python version and code hash
if [[ -n "${MULTISLICE_VENV:-}" ]]; then
  VENV="$MULTISLICE_VENV"
else
  VENV="$STATE_DIR/venvs/py$PY_VERSION-$ARCHIVE_SHA"
  if [[ ! -f "$VENV/.complete" ]]; then
    UV="${MULTISLICE_UV:-}"
    if [[ -z "$UV" ]]; then
      if command -v uv >/dev/null; then
        UV="$(command -v uv)"
      else
        log "installing uv from PyPI"
        python3 -m pip install --quiet --target "$STATE_DIR/tools" uv
        UV="$STATE_DIR/tools/bin/uv"
      fi
    fi
    log "creating venv (Python $PY_VERSION) and installing the experiment"
    rm -rf "$VENV"
    "$UV" venv --quiet --python "$PY_VERSION" "$VENV"
    # The experiment's `tpu` extra pulls jax[tpu] (libtpu); without it JAX would run on the host CPU.
    "$UV" pip install --quiet --python "$VENV/bin/python" "${CODE_DIR}[tpu]"
    touch "$VENV/.complete"
  fi
fi

# 4. unprivileged user
if [[ "$RUN_AS" != "$(id -un)" ]]; then
  id -u "$RUN_AS" >/dev/null 2>&1 || useradd --system --create-home --shell /usr/sbin/nologin "$RUN_AS"
  chown -R "$RUN_AS" "$LOG_DIR"
  RUN=(runuser -u "$RUN_AS" --)
else
  RUN=()
fi
mapfile -d '' TRAINER_ARGS < <(python3 "$LAUNCH_PY" argv "$SPEC")
RUN_DIR_LOCAL="$(python3 "$LAUNCH_PY" local "$(spec_get run_dir)")"
if [[ "$RUN_DIR_LOCAL" != gs://* ]]; then
  mkdir -p "$RUN_DIR_LOCAL"
  [[ ${#RUN[@]} -eq 0 ]] || chown -R "$RUN_AS" "$RUN_DIR_LOCAL"
fi

# 5. train, shipping the log to the bucket every minute and at the end
ship_logs() { bucket_put "$TRAIN_LOG" "$LOGS_URI/$HOST_ID.log" || log "log upload failed (will retry)"; }
log "starting trainer (log: $TRAIN_LOG, bucket: $LOGS_URI/$HOST_ID.log)"
printf '=== boot %s ===\n' "$(date -u +%FT%TZ)" >>"$TRAIN_LOG"
(
  cd "$CODE_DIR"
  exec "${RUN[@]}" env PYTHONUNBUFFERED=1 "$VENV/bin/python" -m trainer.main "${TRAINER_ARGS[@]}"
) >>"$TRAIN_LOG" 2>&1 &
TRAINER_PID=$!
while kill -0 "$TRAINER_PID" 2>/dev/null; do
  for _ in $(seq 60); do
    kill -0 "$TRAINER_PID" 2>/dev/null || break
    sleep 1
  done
  ship_logs
done
status=0
wait "$TRAINER_PID" || status=$?
printf '%s exit=%s\n' "$(date -u +%FT%TZ)" "$status" >"$STATE_DIR/exit-status"
ship_logs
bucket_put "$STATE_DIR/exit-status" "$LOGS_URI/$HOST_ID.exit"
log "trainer exited with status $status"
exit "$status"

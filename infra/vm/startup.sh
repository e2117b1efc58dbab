#!/bin/bash
# TPU VM startup script for a multislice experiment. Fixed content (no templating): everything
# specific to the experiment comes from the `launch-spec` metadata value, read by launch.py (also
# from metadata). Runs on every boot and after every repair, so every step is idempotent:
#   1. read launch-spec + launch.py from the metadata server
#   2. fetch the experiment archive by content hash (verified) and unpack it once
#   3. the Python environment of the experiment's lock (requirements-tpu.lock), built once per
#      lock for the whole job: the first host builds it with `uv pip sync --require-hashes` and
#      publishes it to gs://BUCKET/envs/; every other host, and every later boot, unpacks that
#   4. run the trainer as an unprivileged user on the gs:// run directory; it resumes from the
#      latest complete checkpoint there. Exits a restart can fix (a peer not up yet, exit 42
#      after a preemption notice while the VM keeps running, a crash) are retried with backoff,
#      up to the spec's max_restarts; exit 2 (config, topology, data) and 3 (diverged) are not
#   5. log to a local file and to the bucket; record the exit status
# Storage goes through the GCS JSON API with the VM service account's token from the metadata
# server (no Cloud SDK needed). The endpoints honour the variables Google's own clients read:
# GCE_METADATA_HOST (host:port of the metadata server) and STORAGE_EMULATOR_HOST (GCS API URL).
# Paths for a test harness: MULTISLICE_STATE_DIR, MULTISLICE_LOG_DIR, MULTISLICE_RUN_AS.
set -euo pipefail
umask 022

METADATA_URL="http://${GCE_METADATA_HOST:-metadata.google.internal}/computeMetadata/v1"
GCS_URL="${STORAGE_EMULATOR_HOST:-https://storage.googleapis.com}"
STATE_DIR="${MULTISLICE_STATE_DIR:-/var/lib/multislice}"
LOG_DIR="${MULTISLICE_LOG_DIR:-/var/log/multislice}"
RUN_AS="${MULTISLICE_RUN_AS:-multislice}"
SPEC="$STATE_DIR/launch-spec.json"
LAUNCH_PY="$STATE_DIR/launch.py"
ENV_WAIT_S=1800  # how long a host waits for another host to publish the environment
UV_VERSION="0.13.9"  # installed from PyPI only when the image has no uv

log() { printf '%s multislice-startup: %s\n' "$(date -u +%FT%TZ)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

metadata() {
  # $1: path under computeMetadata/v1. Connection failures are retried (the metadata server can
  # lag right after boot); an HTTP error such as 404 (curl exit 22) means it is not there.
  local attempt rc
  for attempt in 1 2 3 4 5; do
    rc=0
    curl -fsS --max-time 10 -H "Metadata-Flavor: Google" "$METADATA_URL/$1" || rc=$?
    case "$rc" in
      0) return 0 ;;
      22) return 1 ;;
    esac
    sleep "$attempt"
  done
  return 1
}

# --- the GCS JSON API ------------------------------------------------------------------------
gcs_curl() {
  # curl with the service account's bearer token; prints the HTTP status code.
  local token
  token="$(metadata instance/service-accounts/default/token | python3 "$LAUNCH_PY" json-field access_token)" \
    || { log "cannot get an access token from the metadata server"; return 2; }
  curl -sS --retry 5 --retry-connrefused --connect-timeout 20 -w '%{http_code}' \
    -H "Authorization: Bearer $token" "$@"
}

gcs_get() {
  # $1: gs:// URI, $2: local file. 0 fetched, 1 no such object, 2 any other failure.
  local bucket key code
  read -r bucket key < <(python3 "$LAUNCH_PY" gcs-object "$1")
  code="$(gcs_curl -o "$2.part" "$GCS_URL/storage/v1/b/$bucket/o/$key?alt=media")" || code=000
  case "$code" in
    200) mv "$2.part" "$2"; return 0 ;;
    404) rm -f "$2.part"; return 1 ;;
    *) rm -f "$2.part"; log "GET $1: HTTP $code"; return 2 ;;
  esac
}

gcs_put() {
  # $1: local file, $2: gs:// URI (streamed, any size)
  local bucket key code
  read -r bucket key < <(python3 "$LAUNCH_PY" gcs-object "$2")
  code="$(gcs_curl -o /dev/null -X POST -T "$1" -H "Content-Type: application/octet-stream" \
    "$GCS_URL/upload/storage/v1/b/$bucket/o?uploadType=media&name=$key")" || code=000
  [[ "$code" == 200 ]] || { log "upload $2: HTTP $code"; return 2; }
}

gcs_create() {
  # $1: text, $2: gs:// URI. Creates the object only if it does not exist (ifGenerationMatch=0,
  # atomic in GCS): 0 this call created it, 1 it already existed, 2 any other failure.
  local bucket key code body
  read -r bucket key < <(python3 "$LAUNCH_PY" gcs-object "$2")
  body="$STATE_DIR/create.body"
  printf -- '--multislice\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n{"name": %s}\r\n--multislice\r\nContent-Type: text/plain\r\n\r\n%s\r\n--multislice--\r\n' \
    "$(python3 -c 'import json, sys; print(json.dumps(sys.argv[1]))' "${2#gs://*/}")" "$1" >"$body"
  code="$(gcs_curl -o /dev/null -X POST --data-binary "@$body" \
    -H "Content-Type: multipart/related; boundary=multislice" \
    "$GCS_URL/upload/storage/v1/b/$bucket/o?uploadType=multipart&ifGenerationMatch=0")" || code=000
  rm -f "$body"
  case "$code" in
    200) return 0 ;;
    412) return 1 ;;
    *) log "create $2: HTTP $code"; return 2 ;;
  esac
}

mkdir -p "$STATE_DIR" "$LOG_DIR"
# One instance at a time: a re-run of the startup script while training runs is a no-op.
exec 9>"$STATE_DIR/lock"
if ! flock -n 9; then
  log "another startup run holds $STATE_DIR/lock; nothing to do"
  exit 0
fi
BOOT_START="$(date +%s.%N)"
since_boot() { python3 -c 'import sys, time; print(f"{time.time() - float(sys.argv[1]):.1f}")' "$BOOT_START"; }

# 1. launch spec (contents never logged: they are the user's config)
metadata instance/attributes/launch-spec >"$SPEC.tmp" || die "cannot read metadata attribute launch-spec"
metadata instance/attributes/multislice-launch-py >"$LAUNCH_PY.tmp" || die "cannot read metadata attribute multislice-launch-py"
mv "$SPEC.tmp" "$SPEC"
mv "$LAUNCH_PY.tmp" "$LAUNCH_PY"
python3 "$LAUNCH_PY" check "$SPEC"

spec_get() { python3 "$LAUNCH_PY" get "$SPEC" "$1"; }
ARCHIVE_URI="$(spec_get archive_uri)"
ARCHIVE_SHA="$(spec_get archive_sha256)"
PY_VERSION="$(spec_get python_version)"
LOGS_URI="$(spec_get logs_uri)"
ENVS_URI="$(spec_get envs_uri)"
LOCK_FILE="$(spec_get lock_file)"
INIT_TIMEOUT_S="$(spec_get init_timeout_s)"
MAX_RESTARTS="$(spec_get max_restarts)"
HOST_ID="$(hostname -s)"
TRAIN_LOG="$LOG_DIR/train.log"

# 2. experiment code, by content hash
CODE_DIR="$STATE_DIR/code/$ARCHIVE_SHA"
if [[ ! -f "$CODE_DIR/.complete" ]]; then
  log "fetching experiment archive $ARCHIVE_SHA"
  tmp_archive="$STATE_DIR/archive.tar.gz"
  rc=0
  gcs_get "$ARCHIVE_URI" "$tmp_archive" || rc=$?
  [[ $rc -ne 1 ]] || die "experiment archive $ARCHIVE_URI does not exist (was the stack's bucket emptied?)"
  [[ $rc -eq 0 ]] || die "cannot fetch experiment archive $ARCHIVE_URI"
  actual="$(sha256sum "$tmp_archive" | cut -d' ' -f1)"
  [[ "$actual" == "$ARCHIVE_SHA" ]] || die "archive hash mismatch: expected $ARCHIVE_SHA, got $actual"
  rm -rf "$CODE_DIR.tmp"
  mkdir -p "$CODE_DIR.tmp"
  tar -xzf "$tmp_archive" -C "$CODE_DIR.tmp" --no-same-owner
  rm -rf "$CODE_DIR" && mv "$CODE_DIR.tmp" "$CODE_DIR"
  rm -f "$tmp_archive"
  touch "$CODE_DIR/.complete"
fi

# 3. the locked environment, built once per lock and shared through the bucket
LOCK="$CODE_DIR/$LOCK_FILE"
[[ -f "$LOCK" ]] || die "the experiment archive has no $LOCK_FILE; run multislice lock and pulumi up"
if command -v zstd >/dev/null; then
  ENV_EXT="tar.zst"; COMPRESS=(-I "zstd -q -T0 -3")
else
  ENV_EXT="tar.gz"; COMPRESS=(-z)
fi
ENV_KEY="$(sha256sum "$LOCK" | cut -d' ' -f1)-py$PY_VERSION-$(uname -m)"
VENV="$STATE_DIR/venvs/$ENV_KEY"
ENV_URI="$ENVS_URI/$ENV_KEY.$ENV_EXT"

find_uv() {
  if command -v uv >/dev/null; then
    command -v uv
  else
    python3 -m pip install --quiet --target "$STATE_DIR/tools" "uv==$UV_VERSION" >&2
    echo "$STATE_DIR/tools/bin/uv"
  fi
}

build_env() {
  local uv
  uv="$(find_uv)"
  log "building environment $ENV_KEY from $LOCK_FILE (uv pip sync --require-hashes)"
  rm -rf "$VENV.tmp"
  "$uv" venv --quiet --relocatable --python "$PY_VERSION" "$VENV.tmp"
  "$uv" pip sync --quiet --require-hashes --python "$VENV.tmp/bin/python" "$LOCK"
  rm -rf "$VENV" && mv "$VENV.tmp" "$VENV"
}

fetch_env() {
  # The .sha256 object is written after the archive, so its presence means the archive is whole.
  local tarball="$STATE_DIR/env.$ENV_EXT" want rc=0
  gcs_get "$ENV_URI.sha256" "$tarball.sha256" || rc=$?
  [[ $rc -eq 0 ]] || return 1
  want="$(cut -d' ' -f1 <"$tarball.sha256")"
  gcs_get "$ENV_URI" "$tarball" || return 1
  if [[ "$(sha256sum "$tarball" | cut -d' ' -f1)" != "$want" ]]; then
    log "environment archive $ENV_URI does not match its sha256; ignoring it"
    rm -f "$tarball" "$tarball.sha256"
    return 1
  fi
  rm -rf "$VENV.tmp" && mkdir -p "$VENV.tmp"
  tar -C "$VENV.tmp" "${COMPRESS[@]}" -xf "$tarball"
  rm -f "$tarball" "$tarball.sha256"
  rm -rf "$VENV" && mv "$VENV.tmp" "$VENV"
}

publish_env() {
  local tarball="$STATE_DIR/env.$ENV_EXT"
  tar -C "$VENV" "${COMPRESS[@]}" -cf "$tarball" .
  sha256sum "$tarball" | cut -d' ' -f1 >"$tarball.sha256"
  gcs_put "$tarball" "$ENV_URI" && gcs_put "$tarball.sha256" "$ENV_URI.sha256"
  local rc=$?
  rm -f "$tarball" "$tarball.sha256"
  return $rc
}

if [[ ! -f "$VENV/.complete" ]]; then
  env_start="$(date +%s)"
  mkdir -p "$STATE_DIR/venvs"
  if fetch_env; then
    log "installed environment $ENV_KEY from $ENV_URI in $(( $(date +%s) - env_start ))s"
  else
    rc=0
    gcs_create "$HOST_ID $(date -u +%FT%TZ)" "$ENV_URI.claim" || rc=$?
    if [[ $rc -eq 0 ]]; then
      build_env
      log "built environment $ENV_KEY in $(( $(date +%s) - env_start ))s; publishing it to $ENV_URI"
      touch "$VENV/.complete"
      # In the background: this host's trainer starts meanwhile (it waits for the others anyway).
      (
        if publish_env; then
          log "published $ENV_URI"
        else
          log "publishing $ENV_URI failed; the other hosts will build their own"
        fi
      ) &
      PUBLISH_PID=$!
    else
      log "another host is building environment $ENV_KEY; waiting up to ${ENV_WAIT_S}s for $ENV_URI"
      deadline=$(( $(date +%s) + ENV_WAIT_S ))
      until fetch_env; do
        if (( $(date +%s) > deadline )); then
          log "environment $ENV_KEY did not appear within ${ENV_WAIT_S}s; building it here"
          build_env
          break
        fi
        sleep 5
      done
      log "environment $ENV_KEY ready in $(( $(date +%s) - env_start ))s"
    fi
  fi
  touch "$VENV/.complete"
fi
"$VENV/bin/python" -c 'import jax' || die "environment $VENV cannot import jax; remove it and reboot"

# 4. unprivileged user
if [[ "$RUN_AS" != "$(id -un)" ]]; then
  id -u "$RUN_AS" >/dev/null 2>&1 || useradd --system --create-home --shell /usr/sbin/nologin "$RUN_AS"
  chown -R "$RUN_AS" "$LOG_DIR"
  RUN=(runuser -u "$RUN_AS" --)
else
  RUN=()
fi
mapfile -d '' TRAINER_ARGS < <(python3 "$LAUNCH_PY" argv "$SPEC")

# 5. train under supervision, shipping the log to the bucket every minute and at each exit
ship_logs() { gcs_put "$TRAIN_LOG" "$LOGS_URI/$HOST_ID.log" || log "log upload failed (will retry)"; }
log "environment ready $(since_boot)s after boot; starting trainer (log: $TRAIN_LOG, bucket: $LOGS_URI/$HOST_ID.log)"
printf '=== boot %s ===\n' "$(date -u +%FT%TZ)" >>"$TRAIN_LOG"
restarts=0
while :; do
  (
    cd "$CODE_DIR"
    exec "${RUN[@]}" env PYTHONUNBUFFERED=1 MULTISLICE_INIT_TIMEOUT_S="$INIT_TIMEOUT_S" \
      "$VENV/bin/python" -m trainer.main "${TRAINER_ARGS[@]}"
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
  printf '%s exit=%s restarts=%s\n' "$(date -u +%FT%TZ)" "$status" "$restarts" >"$STATE_DIR/exit-status"
  ship_logs
  gcs_put "$STATE_DIR/exit-status" "$LOGS_URI/$HOST_ID.exit" || log "exit status upload failed"
  case "$status" in
    0) log "trainer finished (exit 0)"; break ;;
    2) log "trainer rejected its config, topology, data or storage (exit 2): not restarting; see $TRAIN_LOG"; break ;;
    3) log "trainer stopped on a non-finite loss (exit 3): not restarting"; break ;;
  esac
  if (( restarts >= MAX_RESTARTS )); then
    log "trainer exited with status $status; giving up after $restarts restart(s) (max_restarts)"
    break
  fi
  restarts=$(( restarts + 1 ))
  delay=$(( 5 * 2 ** (restarts - 1) ))
  (( delay <= 300 )) || delay=300
  log "trainer exited with status $status (restartable); restart $restarts of $MAX_RESTARTS in ${delay}s"
  sleep "$delay"
  printf '=== restart %s %s ===\n' "$restarts" "$(date -u +%FT%TZ)" >>"$TRAIN_LOG"
done
[[ -z "${PUBLISH_PID:-}" ]] || wait "$PUBLISH_PID" || true
log "trainer exited with status $status"
exit "$status"

#!/bin/bash
# TPU VM startup script for a multislice experiment. Fixed content (no templating): the VM's
# metadata holds only this script, launch.py and `launch-spec-uri`, the stack's launch spec object
# in the bucket (gs://BUCKET/launch/STACK.json), which says what to train. Runs on every boot and
# after every repair, as root (the guest agent), so every step is idempotent:
#   1. read launch.py and launch-spec-uri from the metadata server, then the launch spec object
#      (its generation, then that generation's content); a spec missing or invalid at first boot
#      is polled for (5 s doubling to 60 s, a line each, the log shipped beside the spec)
#   2. fetch the experiment archive by content hash (verified) and unpack it once
#   3. the environment of the experiment's lock (requirements-tpu.lock) under
#      /opt/multislice/envs/KEY, the same world-readable path on every host: the CPython build the
#      lock's header names and a venv of exactly the lock. The deployer publishes it to
#      gs://BUCKET/envs/KEY.tar.gz before the boot (`pulumi up` on Linux x86_64, or `multislice
#      env-publish`) and the launch spec pins its sha256 (env_sha256): a host installs it only when
#      its bytes match that digest, never one a host wrote or a digest that sits beside it. When
#      the spec pins none, each host builds its own (a managed download of the pinned uv,
#      hash-checked; `uv pip sync --require-hashes`) and publishes nothing: no host installs what
#      another host built (the image's python3 is 3.10, and has no uv). A pod of a stack's own
#      pools links the one its init container installed on the node (read-only to it)
#   4. the trainer's user: root by default (trainer.run_as); another user gets the groups of the
#      TPU device files, an unlimited memlock limit and CAP_IPC_LOCK, and is checked to open every
#      device and to be able to lock memory
#   5. run the trainer on the gs:// run directory; it resumes from the latest complete checkpoint
#      there. Exits a restart can fix (a peer not up yet, exit 42 after a preemption notice while
#      the VM keeps running, a crash) are retried with backoff, up to the spec's max_restarts;
#      exit 2 (config, topology, data) and 3 (diverged) are not. Exit 5 (the hosts disagree on the
#      spec generation: an update is landing) is retried until they agree.
#   6. watch the launch spec: every spec_poll_s (jittered), and after every trainer exit, read its
#      generation. A new one (`pulumi up` changed the code or the trainer settings) stops the
#      trainer as a maintenance notice does (SIGTERM: it saves at the next step boundary), then
#      steps 1-5 run again for the new spec, without a reboot. A finished or stopped job keeps
#      watching, so the next change trains again. A new spec that cannot be applied is logged and
#      the host waits for the next one.
#   7. log to local files and to the bucket: the trainer's log, the exit status, and the spec this
#      host runs (RUN_DIR/logs/HOST.spec: generation and code hash, read by `multislice status`)
# On a GKE pod (orchestration gke, infra/gke/manifest.py) the same script is the container's
# command: the pod's environment names the spec (MULTISLICE_LAUNCH_SPEC_URI) and launch.py
# (MULTISLICE_LAUNCH_PY, from the boot ConfigMap) instead of metadata, the token comes from GKE's
# metadata server (Workload Identity), and restarts are JobSet's: a trainer that exits with any
# status but 5 (or a stop for a new spec) ends the pod with that status, so the JobSet's failure
# policy fails the job on 2 and 3 and recreates every pod on anything else, and a finished run
# (0) completes the Job and the JobSet and frees the nodes. A new spec while the pods run is
# applied in place as on a VM (step 6: the JobSet and its admission stay); once the run has
# ended, a later spec is a new JobSet (infra/gke/live_run.py). SIGTERM (the pod being deleted)
# is passed to the trainer, which saves at its next step boundary.
# Storage goes through the GCS JSON API with the VM service account's token from the metadata
# server (no Cloud SDK needed). The endpoints honour the variables Google's own clients read:
# GCE_METADATA_HOST (host:port of the metadata server) and STORAGE_EMULATOR_HOST (GCS API URL).
# Bucket calls answered 401/403/5xx (a service account and grant seconds old: IAM propagates in
# minutes) are retried with backoff for storage_retry_s. Every failure is one line, "ERROR: step
# N (...): what, which object or file, the status, what to do", also shipped to the bucket.
set -euo pipefail
if [[ -n "${MULTISLICE_LAUNCH_SPEC_URI:-}" && -z "${MULTISLICE_POD_INIT:-}" ]]; then
  # A pod: this process is the container's PID 1, to which the kernel delivers only the signals
  # it has a handler for, and bash runs a trap only once its foreground command ends. So PID 1
  # does nothing but pass the pod's SIGTERM on to the script proper, its child, from the first
  # line: set-up (the spec wait, a fetch, another host's build) ends at once, and a running
  # trainer saves first (run_trainer's trap), never a grace period of 900 s ignored.
  MULTISLICE_POD_INIT=1 /bin/bash "$0" "$@" &
  child=$!
  trap 'printf "%s multislice-startup: SIGTERM (the pod is being deleted): passed on to the start-up script\n" "$(date -u +%FT%TZ)" >&2; kill -TERM "$child" 2>/dev/null || true' TERM
  while kill -0 "$child" 2>/dev/null; do wait "$child" || true; done
  status=0
  wait "$child" || status=$?
  exit "$status"
fi
unset MULTISLICE_POD_INIT
umask 022
shopt -s nullglob

METADATA_URL="http://${GCE_METADATA_HOST:-metadata.google.internal}/computeMetadata/v1"
GCS_URL="${STORAGE_EMULATOR_HOST:-https://storage.googleapis.com}"
STATE_DIR=/var/lib/multislice
LOG_DIR=/var/log/multislice
OPT_DIR=/opt/multislice
SPEC="$STATE_DIR/launch-spec.json"  # the spec being applied or run; generation in GENERATION
LAUNCH_PY="$STATE_DIR/launch.py"
STARTUP_LOG="$LOG_DIR/startup.log"
SPEC_WAIT_S=600  # how long a running host waits for a new spec object to exist (pulumi up writes it)
STOP_WAIT_S=900  # how long a trainer told to stop for a new spec may take to save and exit
STUCK_MIN_S=3  # a pod's trainer that finishes no step this long (or 3 step times) after SIGTERM is stuck
UV_VERSION="0.13.9"  # installed from PyPI with the image's python3; installs the interpreter
# sha256 of the Linux wheels PyPI publishes for that version (x86_64 manylinux_2_17; aarch64
# manylinux_2_17 and manylinux_2_28): pip installs it in hash-checking mode, so the tool that
# installs every other package is itself pinned by content, as the lock pins those.
UV_WHEEL_SHA256=(
  d7f459fe4fd247d830351c75686d3996ace3c6f3f728eb0e85a30b7ada0cef19
  5435c5ce14a56431208ca0996416d310f1598e8c2c8ba707688985a16bb82dbe
  ecb6028d79dc96fbeafffe5c8af62a7099487ebc05a701e76714eebcffd06375
)
STORAGE_RETRY_S=600  # until the launch spec's storage_retry_s is read
HOST_ID="$(hostname -s)"
LOGS_URI=""
POD_MODE=0
[[ -z "${MULTISLICE_LAUNCH_SPEC_URI:-}" ]] || POD_MODE=1
# A pod's $OPT_DIR is its own filesystem, new with every pod. On a stack's own node pools its
# node keeps two directories of the stack's (hostPath volumes, infra/gke/manifest.py):
# NODE_ENVS, the environments the pods' init container installed there from the archive the
# spec pins (MULTISLICE_POD_STAGE=environment: that container runs steps 1-3 into it and
# nothing else), mounted read-only in the trainer's container, so no trainer can change what
# later pods run; and NODE_DIR, the compile cache and the local checkpoint tier.
NODE_DIR="${MULTISLICE_NODE_CACHE:-}"
NODE_ENVS="${MULTISLICE_NODE_ENVS:-}"
ENV_STAGE=0
[[ "${MULTISLICE_POD_STAGE:-}" != environment ]] || ENV_STAGE=1

log() {
  local line
  line="$(date -u +%FT%TZ) multislice-startup: $*"
  printf '%s\n' "$line" >&2
  printf '%s\n' "$line" >>"$STARTUP_LOG" 2>/dev/null || true
}
die() {
  # Before a spec is read this ends the script; applying a spec runs in a subshell
  # (apply_spec), so there it ends only that attempt and the host waits for the next spec.
  log "ERROR: $*"
  if [[ -n "$LOGS_URI" ]] && (( ! ENV_STAGE )); then  # the trainer's container reports it
    STORAGE_RETRY_S=0
    gcs_put "$STARTUP_LOG" "$LOGS_URI/$HOST_ID.startup.log" || true
  fi
  exit 1
}

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
gcs_call() {
  # $1: what is asked (for the log: "GET gs://B/O"), then curl's arguments. Prints the final HTTP
  # status (000: no connection, "token": no access token, "disk": curl could not write the
  # response to this host's disk, exit 23, not retried). What IAM propagation or a GCS hiccup
  # explains (no token yet, 401, 403, 408, 429, 5xx, no connection: Cloud Storage's retry
  # strategy) is retried with backoff for up to STORAGE_RETRY_S seconds, one log line per retry;
  # anything else (2xx, 404, 412, and 400 or 410, which no retry fixes) is the answer.
  local what="$1" deadline delay=2 attempt=0 token code why rc start
  shift
  start="$(date +%s)"
  deadline=$(( start + STORAGE_RETRY_S ))
  while :; do
    attempt=$(( attempt + 1 ))
    code=token
    if token="$(metadata instance/service-accounts/default/token 2>/dev/null \
                | python3 "$LAUNCH_PY" json-field access_token 2>/dev/null)"; then
      rc=0
      # The token on curl's stdin, never in its argv (/proc/PID/cmdline is every user's to read)
      code="$(curl -sS --connect-timeout 20 --max-time 900 -w '%{http_code}' -H @- "$@" \
        2>/dev/null <<<"Authorization: Bearer $token")" || rc=$?
      case "$rc" in
        0) ;;
        23) code=disk ;;  # curl could not write what it received: this host's disk, not GCS
        *) code=000 ;;
      esac
    fi
    case "$code" in
      2??|404|412|disk) echo "$code"; return 0 ;;
      token) why="the metadata server has no access token for the VM's service account yet" ;;
      401) why="the access token was refused (a new service account takes a while to be usable)" ;;
      403) why="the VM's service account has no access (yet: a new IAM grant takes minutes to propagate)" ;;
      000) why="no connection to $GCS_URL" ;;
      408|429|5??) why="GCS is unavailable or throttling" ;;
      *) echo "$code"; return 0 ;;  # 400, 410...: the request is wrong; a retry cannot help
    esac
    if (( $(date +%s) + delay > deadline )); then
      (( attempt == 1 )) || log "$what: still HTTP $code after $attempt attempts in ${STORAGE_RETRY_S}s (storage_retry_s): $why"
      echo "$code"
      return 0
    fi
    log "$what: HTTP $code, $why; retry $attempt in ${delay}s (for up to ${STORAGE_RETRY_S}s)"
    sleep "$delay"
    # 2 s doubling, at most 15 s apart for the first two minutes (a new grant usually lands
    # within them: a 60 s cap would notice a 90 s propagation half a minute late), then 60 s.
    delay=$(( delay * 2 ))
    if (( $(date +%s) - start < 120 )); then
      (( delay <= 15 )) || delay=15
    else
      (( delay <= 60 )) || delay=60
    fi
  done
}

free_kib() { df -Pk "$1" 2>/dev/null | awk 'NR == 2 {print $4}'; }

write_error() {
  # $1: a path, $2: what a command printed. The line that says why it failed (a full disk named
  # as one), then what to do.
  # GNU tar reports ENOSPC as a short write ("Wrote only N of M bytes").
  local line full="no space left|wrote only [0-9]+ of [0-9]+ bytes"
  line="$(grep -m1 -iE "$full" <<<"$2")" || line="${2##*$'\n'}"
  if grep -qiE "$full" <<<"$2"; then
    echo "$line (the disk holding $1 is full: $(free_kib "$1") KiB free once the partial files are removed; free space or give the VM a larger boot disk, then reboot: multislice reset)"
  else
    echo "$line"
  fi
}

gcs_failure() {
  # $1: the local file a download was written to. What GCS_CODE means, for an error line.
  if [[ "$GCS_CODE" == disk ]]; then
    echo "this host could not write it to $1 (curl exit 23: its disk is full or read-only; $(free_kib "$(dirname "$1")") KiB free once the partial download is removed): free space or give the VM a larger boot disk, then reboot (multislice reset)"
  else
    echo "HTTP $GCS_CODE after ${STORAGE_RETRY_S}s of retries; check that the VM's service account has roles/storage.objectViewer on the bucket (and roles/storage.objectUser under the run directory it writes)"
  fi
}

gcs_get() {
  # $1: gs:// URI, $2: local file, $3: optional generation. 0 fetched, 1 no such object (or not
  # that generation any more), 2 any other failure; the status is left in GCS_CODE.
  local bucket key
  read -r bucket key < <(python3 "$LAUNCH_PY" gcs-object "$1")
  GCS_CODE="$(gcs_call "GET $1" -o "$2.part" \
    "$GCS_URL/storage/v1/b/$bucket/o/$key?alt=media${3:+&generation=$3}")"
  case "$GCS_CODE" in
    200) mv "$2.part" "$2"; return 0 ;;
    404) rm -f "$2.part"; return 1 ;;
    *) rm -f "$2.part"; return 2 ;;
  esac
}

gcs_generation() {
  # $1: gs:// URI. Prints the object's generation: 0 found, 1 no such object, 2 any other failure.
  # The response file is per process: the pod's stop watch and the trainer loop both poll.
  local bucket key meta="$STATE_DIR/object.$BASHPID.json" rc=0
  read -r bucket key < <(python3 "$LAUNCH_PY" gcs-object "$1")
  GCS_CODE="$(gcs_call "GET $1 (metadata)" -o "$meta" \
    "$GCS_URL/storage/v1/b/$bucket/o/$key?fields=generation")"
  case "$GCS_CODE" in
    200) python3 "$LAUNCH_PY" json-field generation <"$meta" || rc=2 ;;
    404) rc=1 ;;
    *) rc=2 ;;
  esac
  rm -f "$meta"
  return $rc
}

gcs_put() {
  # $1: local file, $2: gs:// URI (streamed, any size)
  local bucket key
  read -r bucket key < <(python3 "$LAUNCH_PY" gcs-object "$2")
  GCS_CODE="$(gcs_call "upload $2" -o /dev/null -X POST -T "$1" \
    -H "Content-Type: application/octet-stream" \
    "$GCS_URL/upload/storage/v1/b/$bucket/o?uploadType=media&name=$key")"
  [[ "$GCS_CODE" == 200 ]]
}

mkdir -p "$STATE_DIR" "$LOG_DIR" "$OPT_DIR"
# One instance at a time: a re-run of the startup script while training runs is a no-op.
exec 9>"$STATE_DIR/lock"
if ! flock -n 9; then
  log "another startup run holds $STATE_DIR/lock; nothing to do"
  exit 0
fi
BOOT_START="$(date +%s.%N)"
since_boot() { python3 -c 'import sys, time; print(f"{time.time() - float(sys.argv[1]):.1f}")' "$BOOT_START"; }
printf '=== boot %s ===\n' "$(date -u +%FT%TZ)" >>"$STARTUP_LOG"
TRAIN_LOG="$LOG_DIR/train.log"
printf '=== boot %s ===\n' "$(date -u +%FT%TZ)" >>"$TRAIN_LOG"
# A pod's attempt is its JobSet's restart attempt (the pod's label, through the downward API); a
# VM's restarts of its trainer are counted in its log ("=== restart N").
ATTEMPT="${MULTISLICE_ATTEMPT:-0}"
[[ "$ATTEMPT" =~ ^[0-9]+$ ]] || ATTEMPT=0
# A pod's JobSet object (its UID): a replaced or recreated JobSet counts its attempts from 0
# again, so its kept logs are named apart, HOST.run-UID.attempt-N.log.
RUN_TAG=""
[[ ! "${MULTISLICE_JOBSET_UID:-}" =~ ^[0-9a-f-]{8,}$ ]] || RUN_TAG=".run-${MULTISLICE_JOBSET_UID:0:8}"
# The trainer's output (steps, losses, warnings, tracebacks) on this script's console too, where
# operators look: a pod's stdout and stderr are `kubectl logs` and Cloud Logging; a VM's
# startup-script output is its serial console and Cloud Logging. Each line prefixed with the
# host and attempt; the launcher's step markers are left to the file.
# (A read loop, not awk: mawk, Debian's awk, reads a pipe in blocks and would hold lines back.)
follow_train_log() {
  local line attempt=0
  while IFS= read -r line; do
    case "$line" in
      "=== restart "*) attempt="${line#=== restart }"; attempt="${attempt%% *}"
                       [[ "$attempt" =~ ^[0-9]+$ ]] || attempt=0 ;;
      "=== spec generation "*) attempt=0 ;;
      "MULTISLICE_STEP "*) continue ;;
    esac
    printf '[%s attempt %d] %s\n' "$HOST_ID" "$(( ATTEMPT + attempt ))" "$line" >&2
  done < <(tail -n0 -F "$TRAIN_LOG" 2>/dev/null)
}
follow_train_log &

# 1. where the launch spec is (metadata, or a pod's environment), then the spec (contents never
# logged: the user's config)
if (( POD_MODE )); then
  cp "${MULTISLICE_LAUNCH_PY:-}" "$LAUNCH_PY.tmp" 2>/dev/null \
    || die "step 1 (launch spec): cannot read launch.py at MULTISLICE_LAUNCH_PY=${MULTISLICE_LAUNCH_PY:-(unset)}; the pod lacks the boot ConfigMap this toolkit's pulumi up mounts"
  SPEC_URI="$MULTISLICE_LAUNCH_SPEC_URI"
else
  metadata instance/attributes/multislice-launch-py >"$LAUNCH_PY.tmp" \
    || die "step 1 (launch spec): cannot read metadata attribute multislice-launch-py; the queued resource was not made by this toolkit's pulumi up"
  SPEC_URI="$(metadata instance/attributes/launch-spec-uri)" \
    || die "step 1 (launch spec): cannot read metadata attribute launch-spec-uri; the queued resource was not made by this toolkit's pulumi up"
fi
mv "$LAUNCH_PY.tmp" "$LAUNCH_PY"
# This host's slice, for `multislice logs --slice` (a pod's from JobSet's label, a VM's from the
# TPU runtime's tpu-env; "" when neither says: a single slice).
if (( POD_MODE )); then
  SLICE_ID="${MEGASCALE_SLICE_ID:-}"
else
  SLICE_ID="$(metadata instance/attributes/tpu-env 2>/dev/null | sed -n "s/^MEGASCALE_SLICE_ID: '\([0-9]*\)'$/\1/p")" || SLICE_ID=""
fi
# An elastic job (the trainer's elastic.min_slices) on a VM's queued resource of several slices:
# each host says it is up by rewriting a heartbeat object, RUN_DIR/logs/alive/sSLICE-wWORKER@IP,
# every ELASTIC_HEARTBEAT_S while it trains or waits to. When its trainer fails, it waits until a
# lost host's heartbeat is certainly old (3 beats), lists them, and, when the slices whose every
# host beat recently are fewer than the job's but at least the floor, starts the trainer again at
# once as a job of those slices (MEGASCALE_NUM_SLICES, MEGASCALE_SLICE_ID and the coordinator
# among them, as JAX and libtpu read them from the environment before tpu-env). Every survivor
# reads the same listing and finds the same slices. While the job is smaller, a listing that shows
# every slice again stops the trainer at its next step boundary (it saves to the local tier) and
# starts it at full size with the slices that came back. Pods: JobSet recreates every pod of a
# failed job (its failure policy), so a GKE job waits for the lost slice as before.
NUM_SLICES=1 WORKER=0 WORKERS=1 OWN_ADDRESS="" MEGASCALE_PORT_VALUE=""
ELASTIC_HEARTBEAT_S="${MULTISLICE_ELASTIC_HEARTBEAT_S:-10}"
[[ "$ELASTIC_HEARTBEAT_S" =~ ^[1-9][0-9]{0,3}$ ]] || ELASTIC_HEARTBEAT_S=10
if (( ! POD_MODE )) && [[ -n "$SLICE_ID" ]]; then
  tpu_env="$(metadata instance/attributes/tpu-env 2>/dev/null)" || tpu_env=""
  NUM_SLICES="$(sed -n "s/^MEGASCALE_NUM_SLICES: '\([0-9]*\)'$/\1/p" <<<"$tpu_env")"
  MEGASCALE_PORT_VALUE="$(sed -n "s/^MEGASCALE_COORDINATOR_ADDRESS: '[^']*:\([0-9]*\)'$/\1/p" <<<"$tpu_env")"
  WORKER="$(metadata instance/attributes/agent-worker-number 2>/dev/null)" || WORKER=0
  endpoints="$(metadata instance/attributes/worker-network-endpoints 2>/dev/null)" || endpoints=""
  IFS=, read -r -a endpoint_list <<<"$endpoints"
  WORKERS="${#endpoint_list[@]}"
  if [[ "$NUM_SLICES" =~ ^[0-9]+$ && "$WORKER" =~ ^[0-9]+$ ]] && (( WORKER < WORKERS )); then
    OWN_ADDRESS="${endpoint_list[$WORKER]##*:}"
  fi
  [[ "$OWN_ADDRESS" =~ ^[0-9A-Za-z.-]+$ ]] || { NUM_SLICES=1 WORKER=0 WORKERS=1; }
fi

fetch_spec() {
  # $1: how long to wait for the object to exist. Writes $SPEC.new and sets NEW_GENERATION.
  # 0 fetched and valid, 1 absent for $1 s, 2 storage failure (GCS_CODE), 3 invalid (SPEC_PROBLEM)
  local deadline=$(( $(date +%s) + $1 )) rc
  while :; do
    rc=0
    NEW_GENERATION="$(gcs_generation "$SPEC_URI")" || rc=$?
    if [[ $rc -eq 0 ]]; then
      gcs_get "$SPEC_URI" "$SPEC.new" "$NEW_GENERATION" || rc=$?
      if [[ $rc -eq 0 ]]; then
        SPEC_PROBLEM="$(python3 "$LAUNCH_PY" check "$SPEC.new" "$SPEC_URI" 2>&1)" || return 3
        return 0
      fi
    fi
    [[ $rc -eq 1 ]] || return 2
    # 404: not written yet, or replaced between the two calls (`pulumi up` deletes, then writes)
    (( $(date +%s) < deadline )) || return 1
    sleep 5
  done
}

spec_problem_line() {
  # $1: fetch_spec's status, $2: how long it waited for the object. The one line that says what
  # is wrong with the spec and what to do.
  case "$1" in
    1) echo "$SPEC_URI does not exist${2:+ after ${2}s of waiting}; run pulumi up (it writes the launch spec before the queued resource)" ;;
    2) echo "cannot read $SPEC_URI: $(gcs_failure "$SPEC.new")" ;;
    3) echo "$SPEC_URI generation $NEW_GENERATION is not a launch spec this launcher reads: $SPEC_PROBLEM; run pulumi up with this toolkit" ;;
  esac
}

# Until a spec names the run's log directory, this host's startup log goes to a fixed object
# beside the spec: gs://B/launch/STACK.json -> gs://B/launch/STACK.boot/HOST.startup.log.
BOOT_LOG_URI="${SPEC_URI%.json}.boot/$HOST_ID.startup.log"
first_spec() {
  # A spec that is missing, unreadable or invalid at first boot is waited for, never fatal: the
  # `pulumi up` that writes or fixes it must find this host polling. Backoff 5 s doubling to 60 s
  # (the supervisor's default spec_poll_s), one line per attempt.
  local rc delay=5 attempt=0 waited=0
  while :; do
    rc=0
    fetch_spec 0 || rc=$?
    [[ $rc -ne 0 ]] || return 0
    attempt=$(( attempt + 1 ))
    if [[ $rc -eq 1 ]]; then
      log "waiting for the launch spec: $(spec_problem_line 1 "$waited"); attempt $attempt, next in ${delay}s"
    else
      log "ERROR: step 1 (launch spec): $(spec_problem_line "$rc"); attempt $attempt, reading it again in ${delay}s"
    fi
    (STORAGE_RETRY_S=0; gcs_put "$STARTUP_LOG" "$BOOT_LOG_URI") || true
    sleep "$delay"
    waited=$(( waited + delay ))
    delay=$(( delay * 2 ))
    (( delay <= 60 )) || delay=60
  done
}
first_spec
mv "$SPEC.new" "$SPEC"
GENERATION="$NEW_GENERATION"
log "launch spec $SPEC_URI generation $GENERATION"

spec_get() { python3 "$LAUNCH_PY" get "$SPEC" "$1"; }

# Steps 2-4 for the spec in $SPEC. Runs in a subshell (errexit on, die ends only the attempt);
# what the trainer needs is handed back through $APPLIED, sourced by the caller.
APPLIED="$STATE_DIR/applied.env"
apply_spec() {
local fields=(archive_uri archive_sha256 logs_uri envs_uri lock_file init_timeout_s max_restarts
              run_as storage_retry_s spec_poll_s egress stack package_index python_mirror
              env_sha256) values
# One interpreter start for them all, each value NUL-terminated, then launch.py's exit status.
mapfile -d '' values < <(python3 "$LAUNCH_PY" fields "$SPEC" "${fields[@]}" 2>"$SPEC.err"
                         printf '%s\0' "$?")
[[ ${#values[@]} -eq $(( ${#fields[@]} + 1 )) && "${values[-1]}" == 0 ]] \
  || die "step 1 (launch spec): cannot read ${fields[*]} from $SPEC: $(cat "$SPEC.err")"
ARCHIVE_URI="${values[0]}" ARCHIVE_SHA="${values[1]}" LOGS_URI="${values[2]}"
ENVS_URI="${values[3]}" LOCK_FILE="${values[4]}" INIT_TIMEOUT_S="${values[5]}"
MAX_RESTARTS="${values[6]}" RUN_AS="${values[7]}" STORAGE_RETRY_S="${values[8]}"
SPEC_POLL_S="${values[9]}" EGRESS="${values[10]}" STACK="${values[11]}"
PACKAGE_INDEX="${values[12]}" PYTHON_MIRROR="${values[13]}" ENV_SHA="${values[14]}"
(( ENV_STAGE )) || report_spec applying

# 2. experiment code, by content hash
CODE_DIR="$STATE_DIR/code/$ARCHIVE_SHA"
NODE_CODE="${NODE_ENVS:+$NODE_ENVS/code/$ARCHIVE_SHA}"
if (( ENV_STAGE )) && [[ -n "$NODE_CODE" ]]; then
  CODE_DIR="$NODE_CODE"  # the init container unpacks it onto the node, once per node and archive
elif [[ ! -f "$CODE_DIR/.complete" && -n "$NODE_CODE" && -f "$NODE_CODE/.digest" ]]; then
  node_code_copied || true
fi
if [[ ! -f "$CODE_DIR/.complete" ]]; then
  log "fetching experiment archive $ARCHIVE_SHA"
  local tmp_archive="$STATE_DIR/archive.tar.gz" rc=0 actual
  gcs_get "$ARCHIVE_URI" "$tmp_archive" || rc=$?
  if [[ $rc -eq 1 ]]; then
    echo "$ARCHIVE_URI" >"$ARCHIVE_MISSING"  # the caller watches for it, as for a new spec
    die "step 2 (code): experiment archive $ARCHIVE_URI does not exist (HTTP 404; deleted from the bucket?): run \`pulumi up --refresh\` to upload it again (a plain \`pulumi up\` does not see an object deleted outside Pulumi); this host fetches it as soon as it exists"
  fi
  [[ $rc -eq 0 ]] || die "step 2 (code): cannot fetch experiment archive $ARCHIVE_URI: $(gcs_failure "$tmp_archive")"
  # The name is the hash of the tar inside (not of the gzip bytes, which depend on the zlib
  # that packed them).
  actual="$(python3 "$LAUNCH_PY" archive-sha256 "$tmp_archive" 2>&1)" || actual="unreadable: $actual"
  [[ "$actual" == "$ARCHIVE_SHA" ]] || die "step 2 (code): archive hash mismatch: expected $ARCHIVE_SHA, got $actual for $ARCHIVE_URI; run pulumi up again to re-upload it"
  rm -rf "$CODE_DIR.tmp"
  local err
  if ! err="$( { mkdir -p "$CODE_DIR.tmp" && tar -xzf "$tmp_archive" -C "$CODE_DIR.tmp" \
                 --no-same-owner && rm -rf "$CODE_DIR" && mv "$CODE_DIR.tmp" "$CODE_DIR" \
                 && touch "$CODE_DIR/.complete"; } 2>&1)"; then
    rm -rf "$CODE_DIR.tmp" "$tmp_archive"
    die "step 2 (code): cannot unpack the experiment archive into $CODE_DIR: $(write_error "$STATE_DIR" "$err")"
  fi
  rm -f "$tmp_archive"
fi

# 3. the locked environment with its interpreter, built once per lock and shared through the bucket
LOCK="$CODE_DIR/$LOCK_FILE"
[[ -f "$LOCK" ]] || die "step 3 (environment): the experiment archive has no $LOCK_FILE; run multislice lock and pulumi up"
INTERPRETER="$(python3 "$LAUNCH_PY" lock-python "$LOCK" 2>&1)" || die "step 3 (environment): $INTERPRETER"
ENV_KEY="$(sha256sum "$LOCK" | cut -d' ' -f1)-cpython$INTERPRETER-$(uname -m)"
ENV_DIR="$OPT_DIR/envs/$ENV_KEY"
ENV_URI="$ENVS_URI/$ENV_KEY.tar.gz"
# An image built with the environment (infra/boot/Dockerfile: multislice:gke.image) keeps it
# under IMAGE_ENVS, outside $OPT_DIR: used as is (the image is pinned by digest), verified.
IMAGE_ENVS=/usr/local/share/multislice/envs
if [[ -f "$IMAGE_ENVS/$ENV_KEY/.complete" ]]; then
  ENV_DIR="$IMAGE_ENVS/$ENV_KEY"
  if env_verified; then
    log "environment $ENV_KEY from the image ($ENV_DIR): nothing to fetch or build"
  else
    ENV_DIR="$OPT_DIR/envs/$ENV_KEY"
  fi
fi
VENV="$ENV_DIR/venv"
UV="$OPT_DIR/tools/uv-$UV_VERSION/bin/uv"
if (( ENV_STAGE )); then
  install_node_env
  compile_node_code
  return 0
fi
# On a VM and in a pod alike, $OPT_DIR is the host's own: what this host installed there is
# checked by its marker (a new pod starts with none; a trainer restarted in place finds it). A
# pod of the stack's own pools first takes what its init container installed on the node.
[[ "$ENV_DIR" == "$IMAGE_ENVS/"* ]] || node_env_linked || env_verified || prepare_env

# 4. the trainer's user
prepare_user
local out
# The trainer's user can start the interpreter and read jax's files; importing jax would cost a
# second of CPU on every start, and the trainer imports it next anyway.
out="$("${RUN[@]}" "$VENV/bin/python" -c 'import sys, importlib.util as u; open(u.find_spec("jax").origin, "rb").close(); print("%d.%d.%d" % sys.version_info[:3])' 2>&1)" || true
[[ "${out##*$'\n'}" == "$INTERPRETER" ]] \
  || die "step 3 (environment): $VENV/bin/python is unusable for user $RUN_AS (expected CPython $INTERPRETER with jax): ${out##*$'\n'}; remove $ENV_DIR and reboot to rebuild or re-fetch it"
mapfile -d '' TRAINER_ARGS < <(python3 "$LAUNCH_PY" argv "$SPEC")
# The trainer's compile cache on this host's own disk (a GKE node's, for pods), in front of the
# run's in the bucket (trainer/runtime/compilation_cache.py): the trainer's user writes it.
# And the file where it writes the last step it finished (trainer/runtime/progress.py).
# The trainer's local checkpoint tier (checkpoint.local_every) on the same disk: it outlives a
# trainer's restart and a pod's (kind all: the node's per-stack directory), not a new VM or node.
# The seconds SIGTERM leaves before the kill: a TPU VM's preemption notice, a spot node's pods.
COMPILE_CACHE_DIR="${NODE_DIR:-$OPT_DIR}/compile-cache"
LOCAL_CHECKPOINT_DIR="${NODE_DIR:-$OPT_DIR}/local-checkpoints"
TERM_GRACE_S=$(( POD_MODE ? 15 : 30 ))
PROGRESS_FILE="$STATE_DIR/progress/last-step"
{ mkdir -p "$COMPILE_CACHE_DIR" "$LOCAL_CHECKPOINT_DIR" "${PROGRESS_FILE%/*}" \
  && chown -R "$RUN_AS:" "$COMPILE_CACHE_DIR" "$LOCAL_CHECKPOINT_DIR" "${PROGRESS_FILE%/*}"; } \
  || die "step 4 (trainer user): cannot make $COMPILE_CACHE_DIR, $LOCAL_CHECKPOINT_DIR and ${PROGRESS_FILE%/*}, owned by $RUN_AS"
declare -p CODE_DIR VENV RUN TRAINER_ARGS INIT_TIMEOUT_S MAX_RESTARTS LOGS_URI STORAGE_RETRY_S \
  SPEC_POLL_S ARCHIVE_SHA COMPILE_CACHE_DIR LOCAL_CHECKPOINT_DIR TERM_GRACE_S PROGRESS_FILE >"$APPLIED"
}

index_env() {
  # The organisation's package index (multislice:package_index) for pip and uv, as environment
  # variables, never argv: INDEX_ENV, for `env`. Artifact Registry (*.pkg.dev) takes the host's
  # service-account token as the password of user oauth2accesstoken (its pip docs); any other
  # index is asked without credentials. With an index, pip uses exactly it.
  INDEX_ENV=()
  [[ -n "${PACKAGE_INDEX:-}" ]] || return 0
  local url="$PACKAGE_INDEX" token
  if [[ "$url" =~ ^https://[^/]+\.pkg\.dev/ ]]; then
    token="$(metadata instance/service-accounts/default/token 2>/dev/null \
             | python3 "$LAUNCH_PY" json-field access_token 2>/dev/null)" \
      || die "step 3 (environment): the metadata server has no access token for the package index $PACKAGE_INDEX"
    url="https://oauth2accesstoken:${token}@${url#https://}"
  fi
  exact_index "$url"
}

exact_index() {
  # $1: the index URL, its credentials in it. pip and uv use it alone (no configuration file,
  # find-links or extra index of the machine's), and uv the stack's CPython mirror.
  INDEX_URL="$1"
  INDEX_ENV=(-u PIP_NO_INDEX -u PIP_FIND_LINKS -u PIP_EXTRA_INDEX_URL -u UV_INDEX
             -u UV_EXTRA_INDEX_URL -u UV_FIND_LINKS  # env takes its options before assignments
             PIP_CONFIG_FILE=/dev/null PIP_INDEX_URL="$1" UV_NO_CONFIG=1 UV_DEFAULT_INDEX="$1")
  [[ -z "${PYTHON_MIRROR:-}" ]] || INDEX_ENV+=(UV_PYTHON_INSTALL_MIRROR="$PYTHON_MIRROR")
}

index_answer() {
  # The HTTP status the package index gives this host's request for uv's page, with the
  # credentials index_env put in its URL (handed to curl on stdin, never argv); 000: no answer.
  local url="${INDEX_URL:-$PACKAGE_INDEX}"
  printf 'url = "%s"\n' "${url%/}/uv/" \
    | curl -s -o /dev/null --max-time 20 -w '%{http_code}' -K - 2>/dev/null || true
}

index_refused() {
  # 0 when the stack's index refuses this host's credentials (401, 403): what IAM's propagation
  # of a new grant ends by itself, so a retry after a wait fixes it, not a new spec. Keeps the
  # answer in INDEX_CODE for reach_hint, so a failure asks the index once.
  INDEX_CODE=""
  [[ -n "${PACKAGE_INDEX:-}" ]] || return 1
  INDEX_CODE="$(index_answer)"
  [[ "$INDEX_CODE" == 401 || "$INDEX_CODE" == 403 ]]
}

reach_hint() {
  # $1: what a failed download needed (index | mirror). What to check, in words: the
  # organisation's index or mirror when the stack names one (a refusal from Artifact Registry
  # names the role and the command that grants it), else the VM's way out.
  local code repo member
  if [[ "$1" == mirror && -z "${PYTHON_MIRROR:-}" ]]; then
    echo "check that ${WHERE:-the VM} reaches GitHub (egress, Cloud NAT), or set package_index.python_mirror"
    return
  fi
  if [[ -z "${PACKAGE_INDEX:-}" ]]; then
    echo "check ${WHERE:-the VM}'s egress (Cloud NAT) to PyPI"
    return
  fi
  if [[ "$1" == mirror ]]; then
    echo "check that ${WHERE:-the VM} reaches the CPython mirror $PYTHON_MIRROR (README: what a mirror must be)"
    return
  fi
  code="${INDEX_CODE:-$(index_answer)}"
  if [[ ( "$code" == 401 || "$code" == 403 ) && "$PACKAGE_INDEX" =~ ^https://([a-z0-9-]+)-python\.pkg\.dev/([^/]+)/([^/]+) ]]; then
    repo="${BASH_REMATCH[3]} --project=${BASH_REMATCH[2]} --location=${BASH_REMATCH[1]}"
    member="${MEMBER:-}"
    [[ -n "$member" ]] || member="serviceAccount:$(metadata instance/service-accounts/default/email 2>/dev/null || echo HOSTS_ACCOUNT)"
    echo "$PACKAGE_INDEX answered $code: ${WHO:-the service account of the hosts} needs roles/artifactregistry.reader on the repository (\`gcloud artifacts repositories add-iam-policy-binding $repo --member=$member --role=roles/artifactregistry.reader\`; pulumi up declares it for a repository in the project of the stack)"
  elif [[ "$code" == 401 || "$code" == 403 ]]; then
    echo "$PACKAGE_INDEX answered $code to the credentials of ${WHO:-the service account of the hosts}"
  elif [[ "$code" == 000 ]]; then
    echo "${WHERE:-the VM} gets no answer from $PACKAGE_INDEX (its network, DNS or proxy)"
  else
    echo "check that ${WHERE:-the VM} reaches $PACKAGE_INDEX (it answered $code)"
  fi
}

install_uv() {
  [[ ! -x "$UV" ]] || return 0
  local target="$OPT_DIR/tools/uv-$UV_VERSION"
  local requirement="$OPT_DIR/tools/uv-$UV_VERSION.requirements.txt"
  rm -rf "$target.tmp"
  mkdir -p "$OPT_DIR/tools"
  { printf 'uv==%s' "$UV_VERSION"; printf ' --hash=sha256:%s' "${UV_WHEEL_SHA256[@]}"; echo; } \
    >"$requirement"
  local out="$OPT_DIR/tools/uv-$UV_VERSION.pip.log" rc=0
  env "${INDEX_ENV[@]}" python3 -m pip install --quiet --disable-pip-version-check --require-hashes \
    --no-deps --only-binary=:all: --target "$target.tmp" -r "$requirement" >"$out" 2>&1 || rc=$?
  cat "$out" >>"$STARTUP_LOG"
  if [[ $rc -ne 0 ]]; then
    grep -q "DO NOT MATCH THE HASHES" "$out" \
      && die "step 3 (environment): the uv $UV_VERSION wheel pip downloaded is not one the toolkit pins (sha256 not in UV_WHEEL_SHA256; see $STARTUP_LOG); check the VM's package index or proxy"
    ! index_refused || : >"$INDEX_REFUSED"
    die "step 3 (environment): the image's $(python3 --version 2>&1) could not pip install uv==$UV_VERSION (see $STARTUP_LOG); $(reach_hint index)"
  fi
  rm -rf "$target" && mv "$target.tmp" "$target"
}

last_line() {
  # $1: an installer's output: its last line that says what went wrong (uv: "error: ..."), with
  # a URL's password masked, at most 300 characters.
  local line
  line="$(grep -E '^(error|ERROR|  Caused by)' <<<"$1" | tail -n 1)"
  [[ -n "$line" ]] || line="$(grep -v '^[[:space:]]*$' <<<"$1" | tail -n 1)"
  line="$(sed -E 's#(://[^/:@ ]+:)[^@ ]+@#\1***@#g' <<<"$line")"
  printf '%s' "${line:0:300}"
}

build_env() {
  # In place: the venv's interpreter path is absolute, and must be the same on every host.
  index_env
  install_uv
  log "building environment $ENV_KEY: CPython $INTERPRETER (uv python install), then $LOCK_FILE (uv pip sync --require-hashes)"
  { rm -rf "$ENV_DIR" && mkdir -p "$ENV_DIR"; } \
    || die "step 3 (environment): cannot make $ENV_DIR ($(free_kib "$OPT_DIR") KiB free on its disk)"
  local said
  said="$(env "${INDEX_ENV[@]}" "$UV" python install --no-progress --no-bin --install-dir "$ENV_DIR/python" "$INTERPRETER" 2>&1)" \
    || { printf '%s\n' "$said" >>"$STARTUP_LOG"
         die "step 3 (environment): uv $UV_VERSION could not install CPython $INTERPRETER into $ENV_DIR/python: $(last_line "$said"); $(reach_hint mirror)"; }
  printf '%s\n' "$said" >>"$STARTUP_LOG"
  local pythons=("$ENV_DIR"/python/cpython-"$INTERPRETER"-linux-*/bin/python3)
  [[ ${#pythons[@]} -eq 1 && -x "${pythons[0]}" ]] \
    || die "step 3 (environment): no single CPython $INTERPRETER under $ENV_DIR/python after uv python install (found ${#pythons[@]})"
  "$UV" venv --quiet --no-python-downloads --python "${pythons[0]}" "$VENV" >>"$STARTUP_LOG" 2>&1 \
    || die "step 3 (environment): uv venv with ${pythons[0]} failed (see $STARTUP_LOG)"
  # Bytecode now, so the trainer never writes into the environment (it is packed and published
  # while the trainer starts: tar fails on a directory that changes under it) and every host,
  # an unprivileged trainer's included, imports from .pyc from its first start. Install-only
  # CPython archives ship their standard library without bytecode; its tests and GUI parts
  # (some not Python 3 at all) are never imported by a trainer.
  "${pythons[0]}" -m compileall -q -j 0 -x '/(test|tests|idlelib|tkinter|turtledemo|lib2to3)/' \
      "$("${pythons[0]}" -c 'import sysconfig; print(sysconfig.get_path("stdlib"))')" \
      >>"$STARTUP_LOG" 2>&1 \
    || log "warning: some of CPython $INTERPRETER's standard library did not compile (see $STARTUP_LOG); a trainer that imports it compiles it at each start"
  # Wheels only (--no-build: no package's build code runs here), and no bytecode by uv, which
  # compiles with the new interpreter's site enabled: a locked wheel's .pth file would run in the
  # build, as whoever builds (a deployer, CI). compile_env_bytecode compiles with site off.
  said="$(env "${INDEX_ENV[@]}" "$UV" pip sync --no-progress --require-hashes --no-build --python "$VENV/bin/python" "$LOCK" 2>&1)" \
    || { printf '%s\n' "$said" >>"$STARTUP_LOG"; ! index_refused || : >"$INDEX_REFUSED"
         die "step 3 (environment): uv pip sync --require-hashes $LOCK_FILE failed: $(last_line "$said"); $(reach_hint index), or run multislice lock and pulumi up if the lock is broken"; }
  printf '%s\n' "$said" >>"$STARTUP_LOG"
  compile_env_bytecode "$VENV/bin/python" \
    || log "warning: some of the environment's packages did not compile (see $STARTUP_LOG); a trainer that imports them compiles them at each start"
  chmod -R a+rX "$ENV_DIR" || die "step 3 (environment): chmod -R a+rX $ENV_DIR failed"
}

compile_env_bytecode() {
  # $1: a venv's interpreter. Its site-packages to bytecode, run isolated (-I) and without the
  # site module (-S), so no .pth file of an installed package is read, let alone run.
  # Without site the interpreter does not know it is a venv's: the venv's own paths are asked.
  local site venv
  venv="$(dirname "$(dirname "$1")")"
  site="$("$1" -I -S -c 'import sys, sysconfig; v = sys.argv[1]
print(sysconfig.get_path("purelib", vars={"base": v, "platbase": v}))' "$venv")" || return 1
  [[ -d "$site" ]] || return 1
  "$1" -I -S -m compileall -q -j 0 "$site" >>"$STARTUP_LOG" 2>&1
}

fetch_env() {
  # 0: the deployer's environment installed, its bytes matching the spec's env_sha256. 1: the
  # spec pins none, the bucket has none (ENV_ABSENT=1), or what it has is not the deployer's
  # (never installed). Called as a condition (errexit off): every command here is checked.
  ENV_ABSENT=0
  [[ -n "$ENV_SHA" ]] || return 1
  local tarball="$STATE_DIR/env.tar.gz" actual rc=0 err
  rm -f "$tarball"
  gcs_get "$ENV_URI" "$tarball" || rc=$?
  [[ "$GCS_CODE" != disk ]] || die "step 3 (environment): cannot download $ENV_URI: $(gcs_failure "$tarball")"
  if [[ $rc -ne 0 ]]; then
    [[ $rc -ne 1 ]] || ENV_ABSENT=1
    return 1
  fi
  actual="$(sha256sum "$tarball" | cut -d' ' -f1)"
  if [[ "$actual" != "$ENV_SHA" ]]; then
    log "environment archive $ENV_URI is not the deployer's: sha256 $actual, the launch spec pins $ENV_SHA; not installed"
    rm -f "$tarball"
    return 1
  fi
  if ! err="$( { rm -rf "$ENV_DIR" && mkdir -p "$ENV_DIR" \
                 && tar -C "$ENV_DIR" --no-same-owner -xzf "$tarball"; } 2>&1)"; then
    rm -rf "$ENV_DIR" "$tarball"
    die "step 3 (environment): cannot unpack $ENV_URI into $ENV_DIR: $(write_error "$OPT_DIR" "$err")"
  fi
  rm -f "$tarball"
}

env_tree_digest() {
  # What an environment's marker pins: every file (path, size, mtime), link (target) and any
  # other entry but a directory (a FIFO or socket by its type: a FIFO .pth would feed Python
  # code without being a file) of $ENV_DIR, less the bytecode Python writes into __pycache__
  # as it imports. Listing 15k files costs a tenth of a second where hashing their gigabyte
  # would cost seconds on every start; what it catches is what happens to a disk: an unpack cut
  # short, files removed, truncated, replaced or added, another environment in the same place.
  # It is no defence against a writer: only this host's root writes its $OPT_DIR (a VM's disk,
  # a pod's own filesystem), and a pod's node environment is read-only to its trainer.
  (cd "$ENV_DIR" && find . \( -name __pycache__ -o -path ./.complete \) -prune \
     -o -type f -printf '%P %s %T@\n' -o -type l -printf '%P -> %l\n' \
     -o ! -type d -printf '%P type %y\n') \
    | LC_ALL=C sort | sha256sum | cut -d' ' -f1
}

mark_env_complete() {
  printf '%s %s %s\n' "$ENV_KEY" "$(env_tree_digest)" "${ENV_SHA:-built}" >"$ENV_DIR/.complete"
}

env_marker_matches() {
  # 0 when $ENV_DIR holds environment $ENV_KEY (named by the hash of the lock in the spec's
  # archive) exactly as its marker pinned it, and from the archive this spec pins (or built
  # here, when it pins none). Sets MARKER_SAID, what was found, for a log line.
  local key="" tree="" origin="" actual
  [[ -d "$ENV_DIR" ]] || { MARKER_SAID="no $ENV_DIR"; return 1; }
  [[ ! -f "$ENV_DIR/.complete" ]] || read -r key tree origin <"$ENV_DIR/.complete" || true
  actual="$(env_tree_digest)"
  MARKER_SAID="marker: key ${key:-none} tree ${tree:0:12} from ${origin:-?}, found tree ${actual:0:12}, the spec pins ${ENV_SHA:-none}"
  [[ "$key" == "$ENV_KEY" && "$tree" == "$actual" \
     && ( -z "$ENV_SHA" || "$origin" == "$ENV_SHA" || "$ENV_DIR" == "$IMAGE_ENVS/"* ) ]]
}

env_verified() {
  # env_marker_matches, or what is there (no marker, an older toolkit's, another key or archive,
  # a tree that changed) is removed to be made again.
  [[ -d "$ENV_DIR" ]] || return 1
  if env_marker_matches; then
    log "environment $ENV_KEY verified in place ($ENV_DIR)"
    return 0
  fi
  log "environment in $ENV_DIR failed verification ($MARKER_SAID): removing it and installing it again"
  [[ "$ENV_DIR" == "$IMAGE_ENVS/"* ]] || rm -rf "$ENV_DIR"
  return 1
}

install_node_env() {
  # The init container of a pod of the stack's own pools: the environment the spec pins onto
  # the node, once per node and environment, from the deployer's archive (checked by its
  # sha256), unpacked aside and moved into place whole. Nothing the trainer's container can
  # write is read here. A failure leaves the trainer's container to install its own copy.
  local target
  if [[ -z "$NODE_ENVS" || -z "$ENV_SHA" || "$ENV_DIR" == "$IMAGE_ENVS/"* ]]; then
    log "nothing to install on the node (${NODE_ENVS:-no node directory}; the spec pins ${ENV_SHA:-no environment})"
    return 0
  fi
  target="$NODE_ENVS/$ENV_KEY"
  ENV_DIR="$target"
  env_verified && return 0
  ENV_DIR="$NODE_ENVS/.$ENV_KEY.partial"
  if fetch_env && mark_env_complete && rm -rf "$target" && mv "$ENV_DIR" "$target"; then
    log "installed environment $ENV_KEY on the node ($target) from $ENV_URI, sha256 ${ENV_SHA:0:12}"
  else
    rm -rf "$ENV_DIR"
    log "environment $ENV_KEY not installed on the node (above): the trainer's container installs its own"
  fi
}

node_env_linked() {
  # 0 when the init container installed environment $ENV_KEY from the spec's archive on the
  # node (read-only in this container): linked at $ENV_DIR, where its venv's paths point.
  [[ -n "$NODE_ENVS" && -n "$ENV_SHA" ]] || return 1
  local own="$ENV_DIR"
  ENV_DIR="$NODE_ENVS/$ENV_KEY"
  if ! env_marker_matches; then
    log "no environment $ENV_KEY from the spec's archive on the node ($MARKER_SAID): installing it in this pod"
    ENV_DIR="$own"
    return 1
  fi
  ENV_DIR="$own"
  { rm -rf "$ENV_DIR" && mkdir -p "${ENV_DIR%/*}" && ln -s "$NODE_ENVS/$ENV_KEY" "$ENV_DIR"; } \
    || die "step 3 (environment): cannot link $ENV_DIR to $NODE_ENVS/$ENV_KEY"
  log "environment $ENV_KEY from the node ($NODE_ENVS/$ENV_KEY, installed by this pod's init container, read-only here)"
}

code_tree_digest() {
  # $1: a code directory: the content of every file (its bytecode included) and every other
  # entry but a directory, by path, less the node copy's own marker.
  (cd "$1" && { find . -path ./.digest -prune -o -type f -print0 | LC_ALL=C sort -z \
                  | xargs -0 -r sha256sum
                find . -path ./.digest -prune -o -type l -printf '%P -> %l\n' \
                  -o ! -type d ! -type f -printf '%P type %y\n' | LC_ALL=C sort; }) \
    | sha256sum | cut -d' ' -f1
}

node_code_copied() {
  # A pod of the stack's own pools: this pod's init container unpacked the archive $ARCHIVE_SHA
  # (checked by its hash) on the node, byte-compiled it and wrote the digest of the result. The
  # node's copy is read-only here; it is copied into the pod's own filesystem (where the trainer
  # may write beside it) and the copy is checked against that digest.
  local err want="" have
  read -r want <"$NODE_CODE/.digest" 2>/dev/null || true
  if err="$( { rm -rf "$CODE_DIR.tmp" && mkdir -p "${CODE_DIR%/*}" \
               && cp -a "$NODE_CODE" "$CODE_DIR.tmp"; } 2>&1)"; then
    have="$(code_tree_digest "$CODE_DIR.tmp")"
    if [[ "$have" == "$want" ]] && rm -rf "$CODE_DIR" && mv "$CODE_DIR.tmp" "$CODE_DIR"; then
      log "experiment code $ARCHIVE_SHA from the node ($NODE_CODE, unpacked and compiled by this pod's init container; digest checked)"
      return 0
    fi
    err="its digest ${have:0:12} is not the ${want:0:12} its init container wrote"
  fi
  rm -rf "$CODE_DIR.tmp"
  log "not taking the experiment code from the node ($err): fetching it"
  return 1
}

compile_node_code() {
  # The init container, once the environment is on the node: the code's bytecode, compiled by
  # the trainer's interpreter so that no pod compiles it at each start, then the digest of the
  # whole (node_code_copied checks it); the node keeps only the archive this spec runs (a trainer
  # restarted on a newer spec in a running pod fetches its own).
  local old digest
  [[ "$CODE_DIR" == "$NODE_ENVS/code/"* && -f "$CODE_DIR/.complete" ]] || return 0
  for old in "$NODE_ENVS"/code/*; do
    [[ ! -e "$old" || "$old" == "$CODE_DIR" ]] || rm -rf "$old"
  done
  [[ ! -f "$CODE_DIR/.digest" ]] || return 0
  if [[ "$ENV_DIR" != "$IMAGE_ENVS/"* ]]; then
    # install_node_env just verified or installed it; linked where its venv's paths point
    [[ -f "$NODE_ENVS/$ENV_KEY/.complete" ]] || return 0
    ENV_DIR="$OPT_DIR/envs/$ENV_KEY"
    { rm -rf "$ENV_DIR" && mkdir -p "${ENV_DIR%/*}" && ln -s "$NODE_ENVS/$ENV_KEY" "$ENV_DIR"; } || return 0
  fi
  if "$VENV/bin/python" -m compileall -q -j 0 "$CODE_DIR" >>"$STARTUP_LOG" 2>&1; then
    digest="$(code_tree_digest "$CODE_DIR")" && printf '%s\n' "$digest" >"$CODE_DIR/.digest.tmp" \
      && mv "$CODE_DIR/.digest.tmp" "$CODE_DIR/.digest"
  else
    log "warning: the experiment code on the node did not byte-compile (above): each trainer fetches and compiles its own"
  fi
}

cannot_build() {
  # $1: why this host builds no environment, $2: who waits. Ends the attempt with the command
  # that publishes the one the spec needs.
  local publish="multislice env-publish --stack-config stacks/Pulumi.$STACK.yaml"
  if [[ -z "$ENV_SHA" ]]; then
    die "step 3 (environment): the launch spec pins no environment $ENV_KEY for this lock, and $1: run \`$publish\` on a Linux x86_64 machine that reaches the package index, then pulumi up (it pins what was published); $2 applies the new spec as soon as it exists"
  elif (( ENV_ABSENT )); then
    echo "$ENV_URI" >"$ARCHIVE_MISSING"  # watched, as a missing archive
    die "step 3 (environment): $ENV_URI, the environment the launch spec pins, does not exist, and $1: run \`$publish --force\` and pulumi up; $2 installs it as soon as it exists"
  fi
  die "step 3 (environment): $ENV_URI is not the environment the launch spec pins (sha256 ${ENV_SHA:0:12}), and $1: run \`$publish --force\` and pulumi up"
}

prepare_env() {
  local env_start
  env_start="$(date +%s)"
  if fetch_env; then
    log "installed environment $ENV_KEY from $ENV_URI (the deployer's, sha256 ${ENV_SHA:0:12}) in $(( $(date +%s) - env_start ))s"
  elif (( POD_MODE )) && [[ -z "$NODE_ENVS" ]]; then
    # Shared capacity (a GKE workload stack): a build would hold other teams' chips for minutes
    # at every pod start; the workload's `pulumi up` publishes the environment and pins it.
    cannot_build "a pod on shared capacity never builds one" "this pod"
  elif [[ "$EGRESS" == none && -z "$PACKAGE_INDEX" ]]; then
    cannot_build "this stack's hosts have no internet to build one (egress: none)" "this host"
  else
    if [[ -z "$ENV_SHA" ]]; then
      log "the launch spec pins no environment (the deployer publishes one at pulumi up on Linux x86_64, or with multislice env-publish): this host builds its own"
    else
      log "the environment the launch spec pins cannot be installed (above): this host builds its own"
    fi
    build_env
    log "built environment $ENV_KEY in $(( $(date +%s) - env_start ))s"
  fi
  mark_env_complete
}

prepare_user() {
  if [[ "$RUN_AS" == root ]]; then
    # A systemd service (the guest agent's startup script) has no HOME: libraries the trainer
    # loads (TensorStore, jaxlib) then warn "Could not read $HOME" on every start.
    RUN=(env "HOME=${HOME:-$(getent passwd root | cut -d: -f6)}")
    return 0
  fi
  id -u "$RUN_AS" >/dev/null 2>&1 || useradd --system --create-home --shell /usr/sbin/nologin "$RUN_AS" \
    || die "step 4 (trainer user): useradd $RUN_AS failed"
  local devices=(/dev/accel* /dev/vfio/*) groups memlock capeff dev
  groups="$(for dev in "${devices[@]}"; do stat -c %G "$dev"; done | sort -u | grep -vx root | paste -sd, -)" || true
  [[ -z "$groups" ]] || usermod -a -G "$groups" "$RUN_AS" \
    || die "step 4 (trainer user): usermod -a -G $groups $RUN_AS failed"
  # Locking host memory (the TPU runtime pins its DMA buffers): an unlimited RLIMIT_MEMLOCK
  # where root may raise it, and CAP_IPC_LOCK (ambient), which lifts the limit, where this
  # process may grant it (a TPU VM; a GKE pod keeps no such capability, its runtime's limit holds).
  ulimit -l unlimited 2>/dev/null || log "cannot raise RLIMIT_MEMLOCK to unlimited here ($(ulimit -l)); $RUN_AS relies on CAP_IPC_LOCK"
  local ipc_lock=()
  (( 16#$(awk '/^CapBnd/ {print $2}' /proc/self/status) & (1 << 14) )) \
    && ipc_lock=(--inh-caps=+ipc_lock --ambient-caps=+ipc_lock)
  RUN=(setpriv "--reuid=$RUN_AS" "--regid=$(id -g "$RUN_AS")" --init-groups "${ipc_lock[@]}" --
       env "HOME=$(getent passwd "$RUN_AS" | cut -d: -f6)" "USER=$RUN_AS")
  # shellcheck disable=SC2016  # expanded by the user's shell, not this one
  read -r memlock capeff < <("${RUN[@]}" bash -c 'echo "$(ulimit -l) $(awk "/^CapEff/ {print \$2}" /proc/self/status)"')
  [[ "$memlock" == unlimited ]] || (( 16#$capeff & (1 << 14) )) \
    || die "step 4 (trainer user): $RUN_AS can lock only ${memlock} KiB of memory and lacks CAP_IPC_LOCK (the TPU runtime pins host memory); set trainer.run_as: root"
  for dev in "${devices[@]}"; do
    [[ "$dev" != /dev/vfio/vfio ]] || continue
    "${RUN[@]}" test -r "$dev" -a -w "$dev" \
      || die "step 4 (trainer user): user $RUN_AS (groups $(id -Gn "$RUN_AS" | tr ' ' ,)) cannot open $dev ($(stat -c '%U:%G %a' "$dev")); set trainer.run_as: root"
  done
  log "trainer runs as $RUN_AS (groups $(id -Gn "$RUN_AS" | tr ' ' ,), memlock $memlock, CapEff $capeff, ${#devices[@]} device file(s) checked)"
}

# 5.-7. train under supervision, watching the launch spec
report_spec() {
  # $1: applying | running | finished | stopped | failed. What `multislice status` shows per host.
  local STORAGE_RETRY_S=0  # best effort: the next report is the retry
  printf '{"host": "%s", "slice": "%s", "attempt": %s, "generation": "%s", "archive_sha256": "%s", "state": "%s", "time": "%s"}\n' \
    "$HOST_ID" "$SLICE_ID" "$ATTEMPT" "$GENERATION" "${ARCHIVE_SHA:-}" "$1" "$(date -u +%FT%TZ)" >"$STATE_DIR/spec-report"
  [[ -z "$LOGS_URI" ]] || gcs_put "$STATE_DIR/spec-report" "$LOGS_URI/$HOST_ID.spec" \
    || log "spec report upload failed (HTTP $GCS_CODE)"
}

ship_logs() {
  # $1: final (the pod ends): a pod's log is also kept as HOST.run-UID.attempt-N.log, since the
  # next attempt's pod starts a new file that replaces HOST.log (a VM's one file holds every
  # restart).
  local STORAGE_RETRY_S=0  # the next minute's upload is the retry
  gcs_put "$TRAIN_LOG" "$LOGS_URI/$HOST_ID.log" || log "log upload failed (HTTP $GCS_CODE; will retry)"
  if (( POD_MODE )) && [[ "${1:-}" == final ]]; then
    gcs_put "$TRAIN_LOG" "$LOGS_URI/$HOST_ID$RUN_TAG.attempt-$ATTEMPT.log" || log "log upload failed (HTTP $GCS_CODE)"
  fi
}

pod_term_uploads() {
  # A deleted pod's last words, side by side: its logs, its trainer's exit status, its state.
  ship_logs final &
  { gcs_put "$STATE_DIR/exit-status" "$LOGS_URI/$HOST_ID.exit" || log "exit status upload failed (HTTP $GCS_CODE)"; } &
  report_spec stopped &
  wait
}

interruptible() {
  # Runs "$@" in the background and waits for it, so a pod's SIGTERM trap runs at once (bash
  # defers a trap until its foreground command ends). Its status, or the trap's.
  "$@" &
  wait "$!"
}

poll_interval() { echo $(( SPEC_POLL_S * (75 + RANDOM % 51) / 100 )); }  # +-25%

spec_changed() {
  # 0 when the spec object has a generation other than the one this host runs (sets
  # NEW_GENERATION). One call: the next poll is the retry.
  local STORAGE_RETRY_S=0 generation rc=0
  generation="$(gcs_generation "$SPEC_URI")" || rc=$?
  [[ $rc -eq 0 && "$generation" != "$GENERATION" ]] || return 1
  NEW_GENERATION="$generation"
}

heartbeat() {
  # This host is up (best effort: the next beat is the retry).
  local STORAGE_RETRY_S=0
  : >"$STATE_DIR/alive"
  gcs_put "$STATE_DIR/alive" "$LOGS_URI/alive/s$SLICE_ID-w$WORKER@$OWN_ADDRESS" || true
}

live_slices() {
  # Sets LIVE (the live slices, comma-separated) and LIVE_COORDINATOR (the first one's worker 0)
  # from one listing of the heartbeats; 1 when the listing cannot be read.
  local STORAGE_RETRY_S=0 bucket key listing="$STATE_DIR/alive-listing.json" out
  read -r bucket key < <(python3 "$LAUNCH_PY" gcs-object "$LOGS_URI/alive/")
  GCS_CODE="$(gcs_call "list $LOGS_URI/alive/" -o "$listing" \
    "$GCS_URL/storage/v1/b/$bucket/o?prefix=$key")"
  [[ "$GCS_CODE" == 200 ]] || return 1
  out="$(python3 "$LAUNCH_PY" elastic-live "$listing" "$SLICE_ID" "$NUM_SLICES" "$WORKERS" \
    "$(( 3 * ELASTIC_HEARTBEAT_S ))" 2>&1)" || { log "elastic: $out"; return 1; }
  LIVE="${out%% *}"
  LIVE_COORDINATOR="${out#* }"
}

elastic_floor() {
  # The elastic.min_slices the trainer started since byte $1 of its log said (0: not elastic).
  local line
  line="$(tail -c "+$(( $1 + 1 ))" "$TRAIN_LOG" | grep -a '^MULTISLICE_ELASTIC ' | tail -n1)" || true
  if [[ "$line" =~ min_slices=([0-9]+) ]]; then echo "${BASH_REMATCH[1]}"; else echo 0; fi
}

elastic_reform() {
  # After a trainer failure of an elastic job ($1: its floor): wait until a lost host's beat is
  # old, then sets ELASTIC_ENV for the slices that are up. 0: re-form on them; 1: the job runs
  # whole (every slice is up, or too few are: a restart waits for the others as before).
  local floor="$1" waited=0 count index
  local -a live
  while (( waited < 3 * ELASTIC_HEARTBEAT_S )); do
    heartbeat
    sleep "$ELASTIC_HEARTBEAT_S"
    waited=$(( waited + ELASTIC_HEARTBEAT_S ))
  done
  heartbeat
  ELASTIC_ENV=()
  live_slices || return 1
  IFS=, read -r -a live <<<"$LIVE"
  count="${#live[@]}"
  if (( count == NUM_SLICES )); then
    log "elastic: every slice's hosts are up: restarting the whole job"
    return 1
  fi
  if (( count < floor )); then
    log "elastic: only slice(s) ${LIVE:-none} of $NUM_SLICES are up, fewer than elastic.min_slices = $floor: waiting for the others as a restart does"
    return 1
  fi
  for index in "${!live[@]}"; do [[ "${live[$index]}" != "$SLICE_ID" ]] || break; done
  [[ "${live[$index]}" == "$SLICE_ID" ]] || return 1
  ELASTIC_ENV=(MEGASCALE_NUM_SLICES="$count" MEGASCALE_SLICE_ID="$index"
    MEGASCALE_COORDINATOR_ADDRESS="$LIVE_COORDINATOR${MEGASCALE_PORT_VALUE:+:$MEGASCALE_PORT_VALUE}"
    MULTISLICE_FULL_SLICES="$NUM_SLICES")
  log "elastic: slices $LIVE of $NUM_SLICES are up (a host of the others has not beaten for $(( 3 * ELASTIC_HEARTBEAT_S ))s): re-forming at once as a job of $count slices (this host's slice is $index of them, coordinator $LIVE_COORDINATOR)"
}

millis() {
  # $1: seconds as the trainer writes them (1.234): the whole milliseconds, 0 for anything else.
  local whole frac
  [[ "$1" =~ ^([0-9]{1,9})(\.([0-9]*))?$ ]] || { echo 0; return; }
  whole="${BASH_REMATCH[1]}" frac="${BASH_REMATCH[3]}000"
  echo $(( 10#$whole * 1000 + 10#${frac:0:3} ))
}

pod_stop_watch() {
  # $1: now. Once a pod deletion's SIGTERM reached the trainer (run_trainer's term_at, term_step,
  # pid): a trainer that finishes a step after it goes on to save at its next boundary; one that
  # finishes none in max(STUCK_MIN_S, 3 step times, twice its longest pause between steps: an
  # evaluation, a blocking save) is blocked in a collective on a peer that is gone. JobSet
  # deletes every pod when one of them fails, so no checkpoint can be saved then: end the trainer
  # now rather than at JAX's heartbeat timeout (100 s) while the JobSet waits for every pod to
  # end before it creates them again. (A SIGTERM during a first evaluation longer than that, of a
  # healthy job, looks the same: that run resumes from its last checkpoint.)
  local step="" step_time="" pause="" limit
  read -r step _ step_time pause <"$PROGRESS_FILE" 2>/dev/null || true
  if (( term_at == 0 )); then
    term_at=$1 term_step="$step"
    return 0
  fi
  [[ "$step" == "$term_step" ]] || return 0  # a step finished: it reaches its save
  step_time="$(millis "$step_time")" pause="$(millis "$pause")"
  (( step_time * 3 >= pause * 2 )) && limit=$(( step_time * 3 )) || limit=$(( pause * 2 ))
  limit=$(( (limit + 999) / 1000 ))
  (( limit >= STUCK_MIN_S )) || limit=$STUCK_MIN_S
  if (( $1 - term_at >= limit )) && kill -0 "$pid" 2>/dev/null; then
    log "no step finished in ${limit}s after SIGTERM (last finished: ${term_step:-none}): a peer is gone and no checkpoint can be saved; ending the trainer now instead of at JAX's heartbeat timeout"
    kill -KILL "$pid" 2>/dev/null || true
  fi
}

run_trainer() {
  # Runs the applied spec's trainer until it is done for this spec. Sets STATUS (its last exit
  # status) and OUTCOME: respec (a new spec generation exists) or final.
  local restarts=0 agree=0 pid stop_by=0 next_poll delay now tick=0 term_at=0 term_step=""
  local grow=0 log_start floor args
  ELASTIC_ENV=()
  POD_TERM=0
  # shellcheck disable=SC2317  # invoked by the trap
  on_pod_term() {  # a running trainer saves first; an idle pod just ends
    POD_TERM=1
    if [[ -n "${pid:-}" ]] && kill -0 "$pid" 2>/dev/null; then kill -TERM "$pid"; else exit 143; fi
  }
  (( ! POD_MODE )) || trap on_pod_term TERM
  printf '=== spec generation %s, code %s %s ===\n' "$GENERATION" "$ARCHIVE_SHA" "$(date -u +%FT%TZ)" >>"$TRAIN_LOG"
  while :; do
    rm -f "$PROGRESS_FILE"
    log_start="$(stat -c %s "$TRAIN_LOG")"
    args=("${TRAINER_ARGS[@]}")
    if (( ${#ELASTIC_ENV[@]} )); then  # a smaller job: the slices it has
      for i in "${!args[@]}"; do
        [[ "${args[$i]}" != --expect-slices ]] || args[i + 1]="${ELASTIC_ENV[0]#*=}"
      done
    fi
    (( NUM_SLICES < 2 )) || heartbeat
    (
      cd "$CODE_DIR"
      exec "${RUN[@]}" env PYTHONUNBUFFERED=1 MULTISLICE_INIT_TIMEOUT_S="$INIT_TIMEOUT_S" MULTISLICE_STEP_MARKERS=1 \
        MULTISLICE_SPEC_GENERATION="$GENERATION" MULTISLICE_STORAGE_RETRY_S="$STORAGE_RETRY_S" \
        MULTISLICE_LOCAL_COMPILE_CACHE="$COMPILE_CACHE_DIR" MULTISLICE_PROGRESS_FILE="$PROGRESS_FILE" \
        MULTISLICE_LOCAL_CHECKPOINT_DIR="$LOCAL_CHECKPOINT_DIR" MULTISLICE_TERM_GRACE_S="$TERM_GRACE_S" "${LAUNCH_TIMES[@]}" \
        "${ELASTIC_ENV[@]}" MULTISLICE_LAUNCHED_AT="$(date +%s.%N)" "$VENV/bin/python" -m trainer.main "${args[@]}"
    ) >>"$TRAIN_LOG" 2>&1 &
    pid=$!
    LAUNCH_TIMES=()  # a restart is timed from its own launch
    report_spec running
    next_poll=$(( $(date +%s) + $(poll_interval) ))
    while kill -0 "$pid" 2>/dev/null; do
      sleep 1
      now="$(date +%s)"
      tick=$(( tick + 1 ))
      (( tick % 60 )) || ship_logs
      if (( NUM_SLICES > 1 && tick % ELASTIC_HEARTBEAT_S == 0 )); then
        heartbeat
        if (( ${#ELASTIC_ENV[@]} && stop_by == 0 && ! grow )) && live_slices \
            && [[ "$LIVE" == "$(seq -s, 0 $(( NUM_SLICES - 1 )))" ]]; then
          log "elastic: every slice's hosts are up again: stopping the trainer at its next step boundary (it saves to the local tier) to grow back to $NUM_SLICES slices"
          kill -TERM "$pid" 2>/dev/null || true
          grow=1
          stop_by=$(( now + STOP_WAIT_S ))
        fi
      fi
      if (( stop_by == 0 && now >= next_poll )); then
        if spec_changed; then
          log "launch spec generation $GENERATION -> $NEW_GENERATION: stopping the trainer at its next step boundary (SIGTERM, as for a maintenance notice; it saves first)"
          kill -TERM "$pid" 2>/dev/null || true
          stop_by=$(( now + STOP_WAIT_S ))
        fi
        next_poll=$(( now + $(poll_interval) ))
      fi
      (( ! POD_TERM )) || pod_stop_watch "$now"
      if (( stop_by > 0 && now > stop_by )); then
        log "the trainer did not exit within ${STOP_WAIT_S}s of SIGTERM; killing it (its last complete checkpoint stands)"
        kill -KILL "$pid" 2>/dev/null || true
      fi
    done
    STATUS=0
    wait "$pid" || STATUS=$?
    printf '%s exit=%s restarts=%s generation=%s\n' "$(date -u +%FT%TZ)" "$STATUS" "$restarts" "$GENERATION" >"$STATE_DIR/exit-status"
    if (( POD_TERM )); then
      log "the pod is being deleted (SIGTERM): the trainer exited with status $STATUS"
      # The grace period runs (JobSet creates the next pods once these have ended): every upload
      # at once, one try each, and a SIGTERM that comes during them ends the pod (in the
      # background: bash runs a trap only once its foreground ends).
      STORAGE_RETRY_S=0 interruptible pod_term_uploads
      exit "$STATUS"
    fi
    if (( POD_MODE )) && [[ "$STATUS" != 5 ]]; then ship_logs final; else ship_logs; fi
    if (( POD_MODE )); then
      interruptible gcs_put "$STATE_DIR/exit-status" "$LOGS_URI/$HOST_ID.exit" || log "exit status upload failed"
    else
      gcs_put "$STATE_DIR/exit-status" "$LOGS_URI/$HOST_ID.exit" || log "exit status upload failed (HTTP $GCS_CODE)"
    fi
    if (( grow )); then
      log "elastic: growing back: the trainer (exit $STATUS) starts again on all $NUM_SLICES slices"
      grow=0 stop_by=0
      ELASTIC_ENV=()
      printf '=== restart %s (grow-back) %s ===\n' "$restarts" "$(date -u +%FT%TZ)" >>"$TRAIN_LOG"
      continue
    fi
    # After any exit, a new spec wins: it is why a peer stopped, or what fixes this failure.
    if (( stop_by > 0 )) || spec_changed; then
      if (( stop_by == 0 && STATUS == 5 )); then
        log "the hosts run different launch spec generations (exit 5): this host's $GENERATION is the old one; reading $NEW_GENERATION"
      elif (( stop_by == 0 )); then
        log "trainer exited with status $STATUS; launch spec generation $GENERATION -> $NEW_GENERATION"
      fi
      OUTCOME=respec
      return 0
    fi
    OUTCOME=final
    if (( POD_MODE )) && [[ "$STATUS" != 5 ]]; then
      if [[ "$STATUS" == 0 ]]; then
        log "trainer finished (exit 0): the pod ends with it, and the Job and the JobSet complete once every pod has; a new launch spec is a new JobSet (pulumi up replaces it)"
        report_spec finished
            else
        log "trainer exited with status $STATUS: the pod ends with it (JobSet: 2 and 3 fail the job, any other status recreates every pod)"
        report_spec stopped
      fi
      local STORAGE_RETRY_S=0
      gcs_put "$STARTUP_LOG" "$LOGS_URI/$HOST_ID.startup.log" || true
      exit "$STATUS"
    fi
    case "$STATUS" in
      0) log "trainer finished (exit 0)"; report_spec finished; return 0 ;;
      2) log "trainer rejected its config, topology, data or storage (exit 2): not restarting; see $TRAIN_LOG"; report_spec failed; return 0 ;;
      3) log "trainer stopped on a non-finite loss (exit 3): not restarting"; report_spec failed; return 0 ;;
      5)
        agree=$(( agree + 1 ))
        delay=$(( 5 * agree ))
        (( delay <= 60 )) || delay=60
        log "the hosts run different launch spec generations (exit 5; this host runs $GENERATION): reading the spec again and restarting in ${delay}s, until they agree"
        interruptible sleep "$delay"
        if spec_changed; then OUTCOME=respec; return 0; fi
        continue ;;
    esac
    if (( restarts >= MAX_RESTARTS )); then
      log "trainer exited with status $STATUS; giving up after $restarts restart(s) (max_restarts)"
      report_spec stopped
      return 0
    fi
    floor=0
    (( NUM_SLICES < 2 )) || floor="$(elastic_floor "$log_start")"
    if (( floor > 0 )) && elastic_reform "$floor"; then
      restarts=$(( restarts + 1 ))
      log "trainer exited with status $STATUS (restartable); restart $restarts of $MAX_RESTARTS now, on the slices that are up"
      printf '=== restart %s %s ===\n' "$restarts" "$(date -u +%FT%TZ)" >>"$TRAIN_LOG"
      continue
    fi
    ELASTIC_ENV=()
    restarts=$(( restarts + 1 ))
    delay=$(( 5 * 2 ** (restarts - 1) ))
    (( delay <= 300 )) || delay=300
    log "trainer exited with status $STATUS (restartable); restart $restarts of $MAX_RESTARTS in ${delay}s"
    sleep "$delay"
    printf '=== restart %s %s ===\n' "$restarts" "$(date -u +%FT%TZ)" >>"$TRAIN_LOG"
  done
}

wait_for_new_spec() {
  # The job is done (or cannot run) on this spec: the next `pulumi up` that changes it trains.
  local STORAGE_RETRY_S=0
  [[ -z "$LOGS_URI" ]] || gcs_put "$STARTUP_LOG" "$LOGS_URI/$HOST_ID.startup.log" || true
  log "watching $SPEC_URI for a new generation (every ~${SPEC_POLL_S}s): this host runs generation $GENERATION"
  until spec_changed; do sleep "$(poll_interval)"; done
  log "launch spec generation $GENERATION -> $NEW_GENERATION"
}

next_spec() {
  # Read the new spec (NEW_GENERATION or later) until one can be read; logs what changed.
  local rc
  while :; do
    rc=0
    fetch_spec "$SPEC_WAIT_S" || rc=$?
    [[ $rc -ne 0 ]] || break
    log "ERROR: step 1 (launch spec): $(spec_problem_line "$rc" "$SPEC_WAIT_S"); this host keeps generation $GENERATION stopped and reads the spec again in ~${SPEC_POLL_S}s"
    sleep "$(poll_interval)"
  done
  log "launch spec generation $GENERATION -> $NEW_GENERATION: $(python3 "$LAUNCH_PY" changes "$SPEC" "$SPEC.new" 2>&1)"
  mv "$SPEC.new" "$SPEC"
  GENERATION="$NEW_GENERATION"
}

ARCHIVE_MISSING="$STATE_DIR/archive-missing"
wait_for_archive_or_spec() {
  # The spec's archive was missing: 0 once it exists (apply the same spec again), 1 when a new
  # spec generation comes first (NEW_GENERATION set).
  local STORAGE_RETRY_S=0 uri rc
  uri="$(cat "$ARCHIVE_MISSING")"
  [[ -z "$LOGS_URI" ]] || gcs_put "$STARTUP_LOG" "$LOGS_URI/$HOST_ID.startup.log" || true
  log "watching $uri and $SPEC_URI (every ~${SPEC_POLL_S}s): this host runs generation $GENERATION"
  while :; do
    sleep "$(poll_interval)"
    if spec_changed; then
      log "launch spec generation $GENERATION -> $NEW_GENERATION"
      return 1
    fi
    rc=0
    gcs_generation "$uri" >/dev/null || rc=$?
    if [[ $rc -eq 0 ]]; then
      log "$uri exists now: applying generation $GENERATION again"
      return 0
    fi
  done
}

INDEX_REFUSED="$STATE_DIR/index-refused"
INDEX_RETRY_S=60  # the first wait after the index refused this host; doubled to INDEX_RETRY_MAX_S
INDEX_RETRY_MAX_S=900
index_retries=0
wait_for_index_retry_or_spec() {
  # The package index refused this host's credentials (a grant IAM has not propagated yet, or
  # one still to be made): 0 once the wait is over (build again with the same spec), 1 when a
  # new spec generation comes first (NEW_GENERATION set).
  local STORAGE_RETRY_S=0 wait until left
  wait=$(( INDEX_RETRY_S * 2 ** index_retries ))
  (( wait <= INDEX_RETRY_MAX_S )) || wait=$INDEX_RETRY_MAX_S
  index_retries=$(( index_retries + 1 ))
  until=$(( $(date +%s) + wait ))
  [[ -z "$LOGS_URI" ]] || gcs_put "$STARTUP_LOG" "$LOGS_URI/$HOST_ID.startup.log" || true
  log "the package index refused this host (the ERROR above): building again in ${wait}s (try $(( index_retries + 1 ))), or on a new spec"
  while (( (left = until - $(date +%s)) > 0 )); do
    sleep "$(( SPEC_POLL_S < left ? SPEC_POLL_S : left ))"
    if spec_changed; then
      log "launch spec generation $GENERATION -> $NEW_GENERATION"
      return 1
    fi
  done
  return 0
}

SPEC_POLL_S="$(spec_get spec_poll_s)"
FIRST=1  # only the first spec's start is timed from boot
while :; do
  rm -f "$APPLIED" "$ARCHIVE_MISSING" "$INDEX_REFUSED"
  SETUP_AT="$(date +%s.%N)"
  set +e
  (set -e; apply_spec)
  rc=$?
  set -e
  if (( ENV_STAGE )); then  # a pod's init container: done (a failure is the trainer's to report)
    log "init container done (status $rc): the trainer's container starts next"
    exit 0
  fi
  # When the first launch for this spec (and this boot) began its work: the trainer writes
  # them into its process_start row, and `multislice report` splits its start-up by them.
  LAUNCH_TIMES=(MULTISLICE_SETUP_AT="$SETUP_AT" MULTISLICE_SETUP_DONE_AT="$(date +%s.%N)")
  (( ! FIRST )) || LAUNCH_TIMES+=(MULTISLICE_BOOT_AT="$BOOT_START")
  if [[ $rc -eq 0 && -f "$APPLIED" ]]; then
    # shellcheck source=/dev/null
    source "$APPLIED"
    # A limit raised in apply_spec's subshell is gone here; the trainer inherits this shell's.
    (( ${#RUN[@]} == 0 )) || ulimit -l unlimited 2>/dev/null || true
    (( ! FIRST )) || log "environment ready $(since_boot)s after boot; starting trainer (log: $TRAIN_LOG, bucket: $LOGS_URI/$HOST_ID.log)"
    run_trainer
    (( ! POD_MODE )) || trap - TERM  # set-up again: a deleted pod ends at once
    [[ "$OUTCOME" == respec ]] || wait_for_new_spec
  else
    # The ERROR line is logged and shipped; a fix is a new spec (`pulumi up`), not a reboot.
    LOGS_URI="$(spec_get logs_uri)"
    report_spec failed
    if [[ -f "$ARCHIVE_MISSING" ]]; then
      log "launch spec generation $GENERATION cannot be applied on this host until $(cat "$ARCHIVE_MISSING") exists (the ERROR above)"
      if wait_for_archive_or_spec; then
        continue
      fi
    elif [[ -f "$INDEX_REFUSED" ]]; then
      if wait_for_index_retry_or_spec; then
        continue
      fi
    else
      log "launch spec generation $GENERATION cannot be applied on this host (the ERROR above); waiting for the next one"
      wait_for_new_spec
    fi
  fi
  FIRST=0
  next_spec
done

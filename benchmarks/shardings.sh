#!/usr/bin/env bash
# The Multislice guide's shardings.py runs (v4-8: 4-way FSDP, 4-way tensor; 2 slices: DCN data
# parallel), scaled down to 4 emulated CPU devices, with the template's `python -m trainer.bench`.
# --batch_size is per device, as in the guide (4 devices x 1024 = 4096 per step).
# Prints one summary line per run: TFLOP/s per device and MFU against a matmul measured on this CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$PWD/.venv/bin/python}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
"$PY" -m scripts.cli new bench --output-dir "$WORK" >/dev/null
cd "$WORK/bench"

COMMON=(--dtype float32 --batch_size 1024 --embedding_dimension 512 --num_layers 4 --steps 5)
one_slice() {
  echo "== 1 slice x 4 devices: $*"
  JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=4 \
    "$PY" -m trainer.bench "${COMMON[@]}" "$@" | grep '^mesh'
}
one_slice --ici_fsdp_parallelism 4
one_slice --ici_fsdp_parallelism 1 --ici_tensor_parallelism 4
one_slice --ici_fsdp_parallelism 1 --ici_data_parallelism 4
one_slice --ici_fsdp_parallelism 2 --ici_tensor_parallelism 2

echo "== 2 slices x 2 devices (one process per slice): --dcn_data_parallelism 2 --ici_fsdp_parallelism 2"
PORT=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
pids=()
for id in 0 1; do
  JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=2 \
  MULTISLICE_COORDINATOR="127.0.0.1:$PORT" MULTISLICE_NUM_PROCESSES=2 MULTISLICE_PROCESS_ID=$id \
    "$PY" -m trainer.bench "${COMMON[@]}" --dcn_data_parallelism 2 --ici_fsdp_parallelism 2 \
    >"$WORK/slice$id.log" 2>&1 &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done
grep '^mesh' "$WORK/slice0.log"

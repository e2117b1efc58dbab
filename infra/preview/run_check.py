"""Whether a stack's launch spec can resume its run: checked at preview against the bucket.

A new launch spec restarts every trainer, which resumes from the newest checkpoint of the run
directory. When the spec's model has another shape than the one those checkpoints hold, every
host would stop on them (the trainer's exit 2, "written by another model") after `pulumi up`
rewrote the spec. `RunCheck` is a dynamic resource whose provider's `check` runs on every
`pulumi preview` and `up`, before the spec object is written: it reads the model config the
newest complete checkpoint recorded (`checkpoints/STEP/meta/metadata`, the trainer's `model`)
and refuses the preview in one line when a key that shapes the parameters differs. A bucket or
run that does not exist yet, a checkpoint from before checkpoints recorded their model, or a
bucket this deployer cannot read is nothing to refuse (the trainer still checks at restore).
The offline render (`multislice render`) never reaches a bucket: it records the shape and its
diff says the same thing from two renders (scripts/render.py).
"""

from __future__ import annotations

import json
import re
from typing import Any

import pulumi
import pulumi.dynamic
from pulumi.dynamic import CheckFailure, CheckResult

from infra.preview.check_only import CheckOnlyProvider

# Model keys of the template that change no parameter's shape or layout (compute precision,
# kernels, recomputation, sequence length under RoPE, RoPE's frequencies, the norm's epsilon):
# every other model key, a fork's own included, is taken to change the checkpoint's shapes.
RUNTIME_MODEL_KEYS = frozenset({
    "dtype", "attention", "remat", "loss_chunk_size", "seq_len", "rope_theta", "rope_scaling",
    "rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor",
    "rope_original_max_len", "norm_eps"})
STORAGE_TIMEOUT_S = 30.0
COMMIT_MARKER = "commit_success.txt"  # Orbax's, on object stores, in every complete step


# Keys a model config gained later, with the value a config written before them meant: a
# checkpoint that recorded no `kind` was written by the one dense transformer there was.
DEFAULT_MODEL_KEYS = {"kind": "transformer"}


def model_shape(model: dict[str, Any]) -> dict[str, Any]:
    """The keys of a model config that decide its parameters' shapes."""
    return {k: v for k, v in sorted({**DEFAULT_MODEL_KEYS, **model}.items())
            if k not in RUNTIME_MODEL_KEYS}


def shape_changes(before: dict[str, Any], after: dict[str, Any]) -> str:
    """'d_model 768 -> 64, n_layers 12 -> 2' for the keys that differ ('' when none)."""
    return ", ".join(f"{k} {before.get(k, '(none)')} -> {after.get(k, '(none)')}"
                     for k in sorted(before.keys() | after.keys())
                     if before.get(k) != after.get(k))


def newest_checkpoint_model(client: Any, bucket: str, run_prefix: str
                            ) -> tuple[int, dict[str, Any]] | None:
    """(step, model config) of the newest complete checkpoint under gs://bucket/run_prefix that
    recorded its model; None when there is none (or the bucket does not exist)."""
    from google.api_core import exceptions

    prefix = f"{run_prefix.strip('/')}/checkpoints/"
    try:
        blobs = client.list_blobs(bucket, prefix=prefix, delimiter="/",
                                  timeout=STORAGE_TIMEOUT_S)
        list(blobs)  # the prefixes are known once the pages are read
        steps = sorted((int(m[1]) for p in blobs.prefixes
                        if (m := re.fullmatch(re.escape(prefix) + r"(\d+)/", p))), reverse=True)
        for step in steps:
            base = client.bucket(bucket)
            if not base.blob(f"{prefix}{step}/{COMMIT_MARKER}").exists(
                    timeout=STORAGE_TIMEOUT_S):
                continue  # an interrupted save: never restored
            text = base.blob(f"{prefix}{step}/meta/metadata").download_as_bytes(
                timeout=STORAGE_TIMEOUT_S)
            model = json.loads(text).get("model")
            return (step, model) if isinstance(model, dict) else None
    except (exceptions.NotFound, exceptions.Forbidden, ValueError):
        return None
    return None


def mismatch(props: dict[str, Any], client: Any) -> str | None:
    """The one-line refusal for a spec whose model cannot restore the run, else None."""
    wanted = props.get("model_shape")
    if not isinstance(wanted, dict):
        return None
    found = newest_checkpoint_model(client, props["bucket"], props["run_prefix"])
    if found is None:
        return None
    step, model = found
    changed = shape_changes(model_shape(model), wanted)
    if not changed:
        return None
    return (f"multislice:trainer: the model's shape changes ({changed}), but "
            f"gs://{props['bucket']}/{props['run_prefix']} holds the old model's checkpoints "
            f"(newest: step {step}), which the new one cannot restore: every trainer would stop "
            "on them; set a new multislice:run_name (the old run keeps its checkpoints)")


def storage_client(project: str) -> Any:
    """google-cloud-storage with the deployer's credentials, or anonymous against
    STORAGE_EMULATOR_HOST (as every storage client honours it)."""
    import os

    from google.cloud import storage

    if os.environ.get("STORAGE_EMULATOR_HOST"):
        from google.auth.credentials import AnonymousCredentials

        return storage.Client(project=project, credentials=AnonymousCredentials())
    return storage.Client(project=project)


class RunCheckProvider(CheckOnlyProvider):
    """Refuses, at check, a spec whose model cannot restore the run. Holds nothing of its own."""

    def check(self, _olds: dict[str, Any], news: dict[str, Any]) -> CheckResult:
        if not isinstance(news.get("model_shape"), dict):
            return CheckResult(news, [])  # the experiment could not say: no bucket is asked
        try:
            problem = mismatch(news, storage_client(news["project"]))
        except Exception:  # noqa: BLE001 - no credentials, no network: the trainer checks too
            problem = None
        return CheckResult(news, [CheckFailure("model_shape", problem)] if problem else [])

    def resource_id(self, props: dict[str, Any]) -> str:
        return f"{props['bucket']}/{props['run_prefix']}"


class RunCheck(pulumi.dynamic.Resource):
    """The run the stack's spec resumes, as the spec needs it; see the module docstring."""

    def __init__(self, name: str, props: dict[str, Any],
                 opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__(RunCheckProvider(), name, props, opts)

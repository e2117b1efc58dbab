"""Parameters alone, apart from a run: the checkpoint `trainer.convert from-hf` writes, what
`train.init_from` starts a run from, and what `trainer.convert to-hf` and `trainer.sample` read.

A weights directory (local or gs://) holds

    params/        the model's parameter tree (Orbax StandardSave, the same arrays as a train
                   state's `params`), written first
    weights.json   written last, so a conversion that stopped halfway never looks complete:
                   the model section it was made for, where it came from, the source dtype

Parameters are read one array at a time where a caller streams them (`read_param`), or all at
once straight into their target shardings (`restore_params`).
"""

from __future__ import annotations

import json
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from flax import nnx

from .checkpoint import CHECKPOINT_SUBDIR
from .config import Config, ModelConfig
from .model import TransformerLM

PARAMS_ITEM = "params"
MARKER = "weights.json"
MARKER_VERSION = 1


class WeightsError(ValueError):
    """A weights directory or run checkpoint that cannot serve this model; names path and fix."""


def abstract_params(model: ModelConfig) -> Any:
    """The model's params tree of jax.ShapeDtypeStruct (no memory, no devices)."""
    shaped = nnx.eval_shape(lambda: TransformerLM(model, rngs=nnx.Rngs(params=0)))
    return nnx.to_pure_dict(nnx.state(shaped))


def leaves_with_paths(tree: Any) -> list[tuple[tuple[Any, ...], Any]]:
    """[(path of plain keys, leaf)] in tree order: ('blocks', 'attn', 'wq_DxHxK')."""
    def key(entry: Any) -> Any:
        for attr in ("key", "idx", "name"):
            if hasattr(entry, attr):
                return getattr(entry, attr)
        return entry

    return [(tuple(key(k) for k in path), leaf)
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]]


def path_name(path: tuple[Any, ...]) -> str:
    return "/".join(map(str, path))


def set_in(tree: dict, path: tuple[Any, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


# ---- where parameters are -----------------------------------------------------------------

def is_weights_dir(directory: str) -> bool:
    return (epath.Path(directory) / MARKER).exists()


def read_marker(directory: str) -> dict[str, Any]:
    path = epath.Path(directory) / MARKER
    if not path.exists():
        has_params = (epath.Path(directory) / PARAMS_ITEM).exists()
        raise WeightsError(
            f"{directory} has no {MARKER}: "
            + ("its conversion did not finish (params/ is there without the marker written "
               "last); convert again into an empty directory" if has_params else
               "it is not a weights directory (made by `python -m trainer.convert from-hf`)"))
    try:
        marker = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise WeightsError(f"{path} is not readable JSON ({exc})") from None
    if not isinstance(marker, dict) or "model" not in marker:
        raise WeightsError(f"{path} is not a weights marker (no 'model' section)")
    return marker


def run_checkpoint_params(run_dir: str, step: int | None) -> tuple[epath.Path, int]:
    """(directory of the train state's arrays, step) of a run's checkpoint: `step`, or the
    newest finished one."""
    root = epath.Path(run_dir) / CHECKPOINT_SUBDIR
    steps = sorted(int(p.name) for p in root.iterdir() if p.name.isdigit()
                   and (p / "state").exists()) if root.exists() else []
    if not steps:
        raise WeightsError(f"{run_dir} has no finished checkpoint in {root}; train it first, or "
                           "give a weights directory")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise WeightsError(f"--step {step}: {root} has no checkpoint of that step; it has "
                           f"{', '.join(map(str, steps))}")
    return root / str(step) / "state", step


def params_source(source: str, step: int | None) -> tuple[epath.Path, tuple[str, ...], str]:
    """(item directory, the params' key prefix inside it, a description) for a weights
    directory or a run directory."""
    if is_weights_dir(source):
        if step is not None:
            raise WeightsError(f"--step {step}: {source} is a weights directory, which holds one "
                               "set of parameters; --step is for a run directory")
        read_marker(source)
        return epath.Path(source) / PARAMS_ITEM, (), f"weights {source}"
    if not (epath.Path(source) / CHECKPOINT_SUBDIR).exists():
        read_marker(source)  # raises: names what is missing (or an unfinished conversion)
    item, found = run_checkpoint_params(source, step)
    return item, (PARAMS_ITEM,), f"run {source} step {found}"


# ---- checking shapes -------------------------------------------------------------------------

def saved_shapes(item: epath.Path, prefix: tuple[str, ...]) -> dict[tuple[Any, ...], tuple]:
    """{path: shape} of the arrays under `prefix` in a StandardSave item, from its metadata."""
    try:
        meta = ocp.StandardCheckpointHandler().metadata(item)
    except Exception as exc:  # noqa: BLE001 - any unreadable metadata: one line, the path
        raise WeightsError(f"{item}: cannot read its checkpoint metadata ({type(exc).__name__}: "
                           f"{str(exc).splitlines()[0] if str(exc) else ''})") from None
    tree = getattr(meta, "tree", meta)
    for key in prefix:
        tree = tree[key]
    return {path: tuple(getattr(leaf, "shape", ()) or ())
            for path, leaf in leaves_with_paths(tree)}


def check_shapes(item: epath.Path, prefix: tuple[str, ...], model: ModelConfig,
                 what: str, fix: str) -> None:
    """WeightsError naming the first parameter whose shape (or presence) differs."""
    have = saved_shapes(item, prefix)
    want = {path: tuple(leaf.shape) for path, leaf in leaves_with_paths(abstract_params(model))}
    for path in sorted(have.keys() | want.keys(), key=path_name):
        if path not in want:
            raise WeightsError(f"{what}: {path_name(path)} is in the checkpoint but not in this "
                               f"model; {fix}")
        if path not in have:
            raise WeightsError(f"{what}: {path_name(path)} of this model is not in the "
                               f"checkpoint; {fix}")
        if have[path] != want[path]:
            raise WeightsError(f"{what}: {path_name(path)} has shape {have[path]} there and "
                               f"{want[path]} in this model; {fix}")


# ---- reading and writing -----------------------------------------------------------------------

def _restore(item: epath.Path, prefix: tuple[str, ...], target: Any, partial: bool) -> Any:
    """`target` (a tree of ShapeDtypeStruct with shardings) read from `item`; `partial`: the
    target holds only some of the arrays under `prefix`."""
    wrapped = target
    for key in reversed(prefix):
        wrapped = {key: wrapped}
    restore_args = ocp.checkpoint_utils.construct_restore_args(wrapped)
    out = ocp.PyTreeCheckpointHandler().restore(
        item, args=ocp.args.PyTreeRestore(item=wrapped, restore_args=restore_args,
                                          partial_restore=partial or bool(prefix)))
    for key in prefix:
        out = out[key]
    return out


def restore_params(item: epath.Path, prefix: tuple[str, ...], abstract: Any) -> Any:
    """Every parameter at once, each straight into its sharding in `abstract`."""
    return _restore(item, prefix, abstract, partial=False)


def read_param(item: epath.Path, prefix: tuple[str, ...], path: tuple[Any, ...],
               leaf: Any) -> np.ndarray:
    """One parameter as a host numpy array (what a streaming export reads at a time)."""
    device = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    target: dict = {}
    set_in(target, path, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=device))
    out = _restore(item, prefix, target, partial=True)
    for key in path:
        out = out[key]
    return np.asarray(out)


def write_params(directory: str, params: Any, marker: dict[str, Any]) -> None:
    """params/ first, then weights.json: the marker says the directory is complete."""
    root = epath.Path(directory)
    handler = ocp.StandardCheckpointHandler()
    handler.save(root / PARAMS_ITEM, args=ocp.args.StandardSave(params))
    handler.finalize(root / PARAMS_ITEM)
    handler.close()
    (root / MARKER).write_text(json.dumps({"version": MARKER_VERSION, **marker}, indent=1))


def with_params(model: ModelConfig, params: Any) -> TransformerLM:
    """A model whose parameters are `params` (a params tree, as saved)."""
    abstract = nnx.eval_shape(lambda: TransformerLM(model, rngs=nnx.Rngs(params=0)))
    graphdef, state = nnx.split(abstract)
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)


def init_from(config: Config, abstract: Any) -> Any:
    """The parameters `train.init_from` names, restored into `abstract`'s shardings; shapes are
    checked first (WeightsError naming the parameter)."""
    source = config.train.init_from
    item, prefix, what = params_source(source, None)
    check_shapes(item, prefix, config.model, f"train.init_from={source}",
                 "convert the checkpoint for this model (python -m trainer.convert from-hf ... "
                 "--name PRESET) or use the preset it was converted for")
    return restore_params(item, prefix, abstract)

"""Parameters alone, apart from a run: what `trainer.convert from-hf` writes, what
`train.init_from` starts a run from, and what `trainer.convert to-hf` and `trainer.sample` read.

A weights directory (local or gs://) holds

    params/PATH/   one Orbax item per parameter (PATH: its path in the params tree with dots,
                   e.g. blocks.attn.wq_DxHxK), written one at a time, so that a conversion holds
                   one parameter in memory, not the model
    weights.json   written last, so a conversion that stopped halfway never looks complete: each
                   parameter's shape, the model section, where it came from, the source dtype

`open_params` gives the same reader for a weights directory and for a run's checkpoint (the
`params` of its train state): each parameter alone (`read`, what streaming export uses), or all of
them straight into their target shardings (`restore`).
"""

from __future__ import annotations

import json
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from flax import nnx

from ..config import Config, ModelConfig
from ..model.registry import build_model
from ..runtime.checkpoint import CHECKPOINT_SUBDIR

PARAMS_ITEM = "params"
MARKER = "weights.json"
MARKER_VERSION = 1


class WeightsError(ValueError):
    """A weights directory or run checkpoint that cannot serve this model; names path and fix."""


def abstract_params(model: ModelConfig) -> Any:
    """The model's params tree of jax.ShapeDtypeStruct (no memory, no devices)."""
    shaped = nnx.eval_shape(lambda: build_model(model, rngs=nnx.Rngs(params=0)))
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
    if not isinstance(marker, dict) or not isinstance(marker.get("shapes"), dict):
        raise WeightsError(f"{path} is not a weights marker (no 'shapes' section)")
    return marker


def _item_name(path: tuple[Any, ...]) -> str:
    return ".".join(map(str, path))


def _restore_tree(item: epath.Path, target: Any, partial: bool) -> Any:
    """WeightsError, in one line naming `item`, when what is saved there cannot be read (a
    truncated or damaged file, a foreign format)."""
    restore_args = ocp.checkpoint_utils.construct_restore_args(target)
    try:
        return ocp.PyTreeCheckpointHandler().restore(
            item, args=ocp.args.PyTreeRestore(item=target, restore_args=restore_args,
                                              partial_restore=partial))
    except Exception as exc:  # noqa: BLE001 - damaged data reaches us as many types: one line
        first = next((line for line in str(exc).splitlines() if line.strip()), "")[:300]
        raise WeightsError(f"{item}: cannot read the saved parameters ({type(exc).__name__}: "
                           f"{first}); they are damaged or incomplete: copy or convert them "
                           "again") from None


class ParamsSource:
    """Where a model's parameters are read from; `what` names it in messages."""

    what: str

    def shapes(self) -> dict[tuple[Any, ...], tuple[int, ...]]:
        raise NotImplementedError

    def read(self, path: tuple[Any, ...], target: jax.ShapeDtypeStruct) -> jax.Array:
        """One parameter, into `target`'s sharding."""
        raise NotImplementedError

    def restore(self, abstract: Any) -> Any:
        """Every parameter of `abstract` (a params tree with shardings)."""
        out: dict = {}
        for path, leaf in leaves_with_paths(abstract):
            set_in(out, path, self.read(path, leaf))
        return out

    def read_host(self, path: tuple[Any, ...], leaf: Any) -> np.ndarray:
        device = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
        return np.asarray(self.read(path, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype,
                                                               sharding=device)))

    def check_shapes(self, model: ModelConfig, fix: str) -> None:
        """WeightsError naming the first parameter whose shape (or presence) differs."""
        have = self.shapes()
        want = {path: tuple(leaf.shape)
                for path, leaf in leaves_with_paths(abstract_params(model))}
        for path in sorted(have.keys() | want.keys(), key=path_name):
            if path not in want:
                raise WeightsError(f"{self.what}: {path_name(path)} is in the checkpoint but "
                                   f"not in this model; {fix}")
            if path not in have:
                raise WeightsError(f"{self.what}: {path_name(path)} of this model is not in the "
                                   f"checkpoint; {fix}")
            if have[path] != want[path]:
                raise WeightsError(f"{self.what}: {path_name(path)} has shape {have[path]} "
                                   f"there and {want[path]} in this model; {fix}")


class WeightsDir(ParamsSource):
    def __init__(self, directory: str) -> None:
        self.root = epath.Path(directory)
        self.marker = read_marker(directory)
        self.what = directory

    def shapes(self) -> dict[tuple[Any, ...], tuple[int, ...]]:
        return {tuple(int(k) if k.isdigit() else k for k in name.split(".")): tuple(shape)
                for name, shape in self.marker["shapes"].items()}

    def read(self, path: tuple[Any, ...], target: jax.ShapeDtypeStruct) -> jax.Array:
        item = self.root / PARAMS_ITEM / _item_name(path)
        return _restore_tree(item, {"value": target}, partial=False)["value"]


class RunCheckpoint(ParamsSource):
    """The `params` of a run's train state at one step."""

    def __init__(self, run_dir: str, step: int | None) -> None:
        root = epath.Path(run_dir) / CHECKPOINT_SUBDIR
        steps = sorted(int(p.name) for p in root.iterdir() if p.name.isdigit()
                       and (p / "state").exists()) if root.exists() else []
        if not steps:
            raise WeightsError(f"{run_dir} has no finished checkpoint in {root}; train it "
                               "first, or give a weights directory")
        if step is None:
            step = steps[-1]
        elif step not in steps:
            raise WeightsError(f"--step {step}: {root} has no checkpoint of that step; it has "
                               f"{', '.join(map(str, steps))}")
        self.item, self.step = root / str(step) / "state", step
        self.what = f"run {run_dir} step {step}"

    def shapes(self) -> dict[tuple[Any, ...], tuple[int, ...]]:
        try:
            meta = ocp.StandardCheckpointHandler().metadata(self.item)
        except Exception as exc:  # noqa: BLE001 - any unreadable metadata: one line, the path
            first = str(exc).splitlines()[0] if str(exc) else ""
            raise WeightsError(f"{self.item}: cannot read its checkpoint metadata "
                               f"({type(exc).__name__}: {first})") from None
        tree = getattr(meta, "tree", meta)[PARAMS_ITEM]
        return {path: tuple(getattr(leaf, "shape", ()) or ())
                for path, leaf in leaves_with_paths(tree)}

    def read(self, path: tuple[Any, ...], target: jax.ShapeDtypeStruct) -> jax.Array:
        wanted: dict = {}
        set_in(wanted, path, target)
        out = _restore_tree(self.item, {PARAMS_ITEM: wanted}, partial=True)[PARAMS_ITEM]
        for key in path:
            out = out[key]
        return out

    def restore(self, abstract: Any) -> Any:  # one call: the train state's params at once
        return _restore_tree(self.item, {PARAMS_ITEM: abstract}, partial=True)[PARAMS_ITEM]


def open_params(source: str, step: int | None = None) -> ParamsSource:
    """A weights directory or a run directory's checkpoint (`step`, default the newest)."""
    if is_weights_dir(source):
        if step is not None:
            raise WeightsError(f"--step {step}: {source} is a weights directory, which holds one "
                               "set of parameters; --step is for a run directory")
        return WeightsDir(source)
    if not (epath.Path(source) / CHECKPOINT_SUBDIR).exists():
        read_marker(source)  # raises: names what is missing (or an unfinished conversion)
    return RunCheckpoint(source, step)


# ---- writing -----------------------------------------------------------------------------------

class WeightsWriter:
    """Writes a weights directory one parameter at a time; `finish` writes the marker last."""

    def __init__(self, directory: str) -> None:
        self.root = epath.Path(directory)
        self.shapes: dict[str, list[int]] = {}
        self._handler = ocp.StandardCheckpointHandler()

    def write(self, path: tuple[Any, ...], value: np.ndarray) -> None:
        item = self.root / PARAMS_ITEM / _item_name(path)
        self._handler.save(item, args=ocp.args.StandardSave({"value": value}))
        self._handler.finalize(item)
        self.shapes[_item_name(path)] = list(value.shape)

    def finish(self, marker: dict[str, Any]) -> None:
        self._handler.close()
        (self.root / MARKER).write_text(json.dumps(
            {"version": MARKER_VERSION, "shapes": self.shapes, **marker}, indent=1))


def with_params(model: ModelConfig, params: Any) -> nnx.Module:
    """A model whose parameters are `params` (a params tree, as saved)."""
    abstract = nnx.eval_shape(lambda: build_model(model, rngs=nnx.Rngs(params=0)))
    graphdef, state = nnx.split(abstract)
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)


def init_from(config: Config, abstract: Any) -> Any:
    """The parameters `train.init_from` names, restored into `abstract`'s shardings; shapes are
    checked first (WeightsError naming the parameter)."""
    source = open_params(config.train.init_from)
    source.what = f"train.init_from={config.train.init_from}"
    source.check_shapes(config.model, "convert the checkpoint for this model (python -m "
                                      "trainer.convert from-hf ... --name PRESET) or use the "
                                      "preset it was converted for")
    return source.restore(abstract)

"""Hugging Face Llama checkpoints in and out.

    python -m trainer.convert from-hf HF_DIR --name NAME --output WEIGHTS_DIR
    python -m trainer.convert to-hf (RUN_DIR [--step N] | WEIGHTS_DIR) --config NAME --output HF_DIR
                                    [--dtype float32|bfloat16|float16] [--max-shard-size 2GB]

from-hf reads HF_DIR/config.json and its safetensors (model.safetensors, or the shards that
model.safetensors.index.json lists) tensor by tensor, writes configs/NAME.toml (a preset over
base.toml with the model section config.json describes; an existing preset is checked instead,
naming every field that differs) and the parameters as a weights directory (trainer/hf/weights.py)
that `--set train.init_from=WEIGHTS_DIR` starts a run from. The tokenizer and generation files of
HF_DIR travel along, so exporting the weights again gives a complete Hugging Face directory.

to-hf writes config.json and model.safetensors (or numbered shards and the index above
--max-shard-size) that `LlamaForCausalLM.from_pretrained` loads, reading one parameter at a time;
a run prepared with `--tokenizer PATH/tokenizer.json` also gets its tokenizer. The files are
written into HF_DIR.partial-PID and renamed to HF_DIR at the end. Import then export gives back the
same tensors, bit for bit (the source's dtype is the export's default).

Every argument, the config, the tensors' names and shapes and the output directory are checked
before anything is written. Exit codes: 0 done, 2 invalid input (one line each).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..runtime.storage import absolute

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Files of a Hugging Face model directory besides config.json and the weights that belong with
# the model: copied from HF_DIR into the weights directory and back out again.
COMPANION_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json")
COMPANION_DIR = "hf"
# Buffers some older checkpoints saved that are recomputed, not parameters.
IGNORED_TENSOR = re.compile(r"\.rotary_emb\.inv_freq$")
EXPORT_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
SIZE_RE = re.compile(r"^(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|KiB|MiB|GiB)?$", re.IGNORECASE)
SIZE_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20,
              "gib": 2**30}


class ConvertError(ValueError):
    """Input that cannot be converted; the message names the path or field, the value and why."""

    def __init__(self, message: str | list[str]) -> None:
        self.lines = [message] if isinstance(message, str) else list(message)
        super().__init__("; ".join(self.lines))


# ---- argument checks (nothing is read or written yet) -----------------------------------------

def _size(text: str) -> int:
    match = SIZE_RE.match(text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"expected a size such as 2GB, 500MB or 1073741824, "
                                         f"got {text!r}")
    value = float(match.group(1)) * SIZE_UNITS[(match.group(2) or "b").lower()]
    if not math.isfinite(value) or value < 2**10:
        raise argparse.ArgumentTypeError(f"{text!r}: a shard must hold at least 1KiB")
    return int(value)


def int_at_least(low: int, what: str):
    """An argparse type: an integer >= low, refused in one line naming `what`."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what} (an integer >= {low}), "
                                             f"got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected {what} >= {low}, got {value}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m trainer.convert", allow_abbrev=False,
                                     description="Hugging Face Llama checkpoints in and out.")
    sub = parser.add_subparsers(dest="command", required=True)
    into = sub.add_parser("from-hf", allow_abbrev=False,
                          help="HF_DIR -> configs/NAME.toml and a weights directory")
    into.add_argument("hf_dir", metavar="HF_DIR",
                      help="config.json and *.safetensors")
    into.add_argument("--name", required=True,
                      help="preset name: configs/NAME.toml is written, or checked if it exists")
    into.add_argument("--output", required=True, metavar="WEIGHTS_DIR",
                      help="new or empty directory (local or gs://) for the parameters")
    out = sub.add_parser("to-hf", allow_abbrev=False,
                         help="a run's checkpoint or a weights directory -> HF_DIR")
    out.add_argument("source", type=absolute, metavar="RUN_DIR|WEIGHTS_DIR")
    out.add_argument("--step", type=int_at_least(0, "a checkpoint step"), default=None,
                     help="with a RUN_DIR: the checkpoint step (default: the newest)")
    out.add_argument("--config", required=True, help="the preset the parameters belong to")
    out.add_argument("--output", type=absolute, required=True, metavar="HF_DIR",
                     help="a new local directory")
    out.add_argument("--dtype", choices=sorted(EXPORT_DTYPES), default=None,
                     help="tensor dtype (default: the source checkpoint's, float32 for a run)")
    out.add_argument("--max-shard-size", type=_size, default=_size("2GB"), metavar="SIZE",
                     help="split model.safetensors into shards of at most SIZE (default 2GB)")
    rand = sub.add_parser("random-hf", allow_abbrev=False,
                          help="a Hugging Face checkpoint of random weights in a preset's shapes, "
                               "to rehearse the weights workflow offline")
    rand.add_argument("--config", required=True,
                      help="the preset whose shapes it has (e.g. llama-tiny)")
    rand.add_argument("--output", type=absolute, required=True, metavar="HF_DIR",
                      help="a new local directory")
    rand.add_argument("--seed", type=int, default=0, help="of the random initialisation")
    rand.add_argument("--dtype", choices=sorted(EXPORT_DTYPES), default="float32",
                      help="tensor dtype (default float32)")
    return parser


def _require_empty_output(output: str, flag: str = "--output") -> None:
    from etils import epath

    from ..runtime.storage import check_reachable

    check_reachable(output)  # a gs:// output: its bucket answers (StorageError in one line)
    path = epath.Path(output)
    if not path.exists():
        if "://" not in output:  # a local path: it can be made only under a directory
            above = next(p for p in Path(output).parents if p.exists())
            if not above.is_dir():
                raise ConvertError(f"{flag} {output}: {above} is a file, so no directory can be "
                                   "made under it; name a new directory elsewhere")
        return
    if not path.is_dir():
        raise ConvertError(f"{flag} {output}: is a file; name a new directory")
    held = sorted(p.name for p in path.iterdir())
    if held:
        shown = ", ".join(held[:5]) + (f" and {len(held) - 5} more" if len(held) > 5 else "")
        raise ConvertError(f"{flag} {output}: is not empty (holds {shown}); name a new or "
                           "empty directory, nothing is overwritten")


# ---- from-hf ----------------------------------------------------------------------------------

MAX_JSON_BYTES = 64 << 20  # a 128k-token tokenizer.json is about 10 MB


def _read_json_object(path: Path) -> dict[str, Any]:
    """A JSON object file of a model directory. A pipe or device (reading would wait forever),
    a file over MAX_JSON_BYTES, text that is not JSON (a truncated download) or JSON that is not
    an object is a ConvertError naming the file; a missing one is FileNotFoundError."""
    import stat

    info = path.stat()
    if not stat.S_ISREG(info.st_mode):
        raise ConvertError(f"{path}: not a regular file (a pipe, device or directory); give the "
                           "file itself")
    if info.st_size > MAX_JSON_BYTES:
        raise ConvertError(f"{path}: {info.st_size:,} bytes, over the {MAX_JSON_BYTES:,} a "
                           "model directory's JSON files have")
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConvertError(f"{path}: not readable JSON ({exc}); a truncated download?") \
            from None
    if not isinstance(value, dict):
        raise ConvertError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def read_hf_config(hf_dir: Path) -> dict[str, Any]:
    """config.json of HF_DIR, after every companion JSON file (tokenizer, generation config) it
    would carry is checked: a bad one fails before any tensor is converted, not after."""
    if not hf_dir.is_dir():
        raise ConvertError(f"HF_DIR {hf_dir}: "
                           + ("is a file" if hf_dir.exists() else "does not exist")
                           + "; give the directory with config.json and model.safetensors")
    path = hf_dir / "config.json"
    try:
        hf = _read_json_object(path)
    except FileNotFoundError:
        raise ConvertError(f"{path}: missing; a Hugging Face model directory has config.json "
                           "next to its safetensors") from None
    for name in COMPANION_FILES:
        if name.endswith(".json") and (hf_dir / name).exists():
            _read_json_object(hf_dir / name)
    return hf


def tensor_files(hf_dir: Path) -> dict[str, Path]:
    """{tensor name: the file holding it} from the index, or the single model.safetensors."""
    index = hf_dir / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConvertError(f"{index}: not an index with a weight_map ({exc})") from None
        files = {name: hf_dir / file for name, file in weight_map.items()}
        missing = sorted({str(f) for f in files.values() if not f.is_file()})
        if missing:
            raise ConvertError(f"{index} lists {', '.join(missing)}, which "
                               f"{'does' if len(missing) == 1 else 'do'} not exist")
        return files
    single = hf_dir / SINGLE_FILE
    if not single.is_file():
        raise ConvertError(f"HF_DIR {hf_dir}: neither {SINGLE_FILE} nor {INDEX_FILE}; only "
                           "safetensors checkpoints are read (not pytorch_model.bin)")
    from safetensors import safe_open

    try:
        with safe_open(single, framework="numpy") as f:
            return dict.fromkeys(f.keys(), single)
    except Exception as exc:  # noqa: BLE001 - a truncated or foreign file: one line
        raise ConvertError(f"{single}: not a readable safetensors file ({exc})") from None


def tensor_headers(files: dict[str, Path]) -> dict[str, tuple[tuple[int, ...], str]]:
    """{name: (shape, safetensors dtype)} read from the headers only."""
    from safetensors import safe_open

    out = {}
    for file in sorted(set(files.values())):
        try:
            with safe_open(file, framework="numpy") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not iterable
                    part = f.get_slice(name)
                    out[name] = (tuple(part.get_shape()), part.get_dtype())
        except Exception as exc:  # noqa: BLE001 - a truncated or foreign file: one line
            raise ConvertError(f"{file}: not a readable safetensors file ({exc})") from None
    return out


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, int):
        return str(value)
    return json.dumps(value)


TRAINING_SECTIONS = ("train", "optim", "metrics", "eval", "data", "checkpoint")


def sized_settings(params: int) -> tuple[str, dict[str, dict[str, Any]]]:
    """(preset, its training sections) of the shipped preset nearest in size to a model of
    `params` parameters: a converted 100k-parameter model trains with llama-tiny's batch and
    warm-up, a 1B one with llama-3.2-1b's, not base.toml's defaults."""
    from ..config import BASE_CONFIG, ConfigError, _read_toml, build_config, config_path, preset_raw
    from ..config import presets as shipped
    from ..model.registry import param_count

    sizes = {}
    for preset in shipped():
        if preset == BASE_CONFIG:
            continue
        try:
            sizes[preset] = param_count(build_config(preset_raw(preset)).model)
        except ConfigError:
            continue
    if not sizes:
        return BASE_CONFIG, {}
    nearest = min(sizes, key=lambda k: (abs(math.log(sizes[k]) - math.log(params)), k))
    own = _read_toml(config_path(nearest))
    return nearest, {k: dict(own[k]) for k in TRAINING_SECTIONS if own.get(k)}


def preset_text(name: str, hf_dir: Path, fields: dict[str, Any], sized_from: str = "",
                sections: dict[str, dict[str, Any]] | None = None) -> str:
    # Meant to be committed: it names the checkpoint by its directory's name, not by a path of
    # the machine it was converted on.
    lines = [f"# {name}: the model section of the Hugging Face config.json in {hf_dir.name}/,",
             f"# written by python -m trainer.convert from-hf .../{hf_dir.name} --name {name} ...",
             "# Over configs/base.toml; train from its weights with --set "
             "train.init_from=WEIGHTS_DIR.",
             "# model.dtype is the checkpoint's own (config.json torch_dtype), so trainer.sample "
             "gives Hugging Face's greedy tokens.", "[model]"]
    lines += [f"{key} = {_toml_value(value)}" for key, value in fields.items()]
    if sections:
        lines += ["", f"# Training settings of configs/{sized_from}.toml, the shipped preset "
                      "nearest in size; change them for your run."]
        for section, values in sections.items():
            lines += ["", f"[{section}]"] + [f"{k} = {_toml_value(v)}" for k, v in values.items()]
    return "\n".join(lines) + "\n"


def model_for(name: str, hf_dir: Path, fields: dict[str, Any]) -> tuple[Any, str | None]:
    """(ModelConfig, the preset text to write or None when configs/NAME.toml exists and agrees).
    A preset that disagrees with config.json is a ConvertError naming every field."""
    from ..config import (
        BASE_CONFIG,
        ConfigError,
        build_config,
        config_path,
        load_config,
        preset_raw,
    )
    from .llama import ARCHITECTURE_FIELDS

    try:
        path = config_path(name)
    except ConfigError:
        path = None
    if path is None:
        raw = preset_raw(BASE_CONFIG)
        raw["model"].update(fields)
        try:
            model = build_config(raw).model
            from ..model.registry import param_count

            sized_from, sections = sized_settings(param_count(model))
            for section, values in sections.items():
                raw.setdefault(section, {}).update(values)
            return build_config(raw).model, preset_text(name, hf_dir, fields, sized_from,
                                                        sections)
        except ConfigError as exc:
            raise ConvertError(f"{hf_dir}/config.json describes a model the trainer refuses: "
                               f"{exc}") from None
    try:
        model = load_config(name).model
    except ConfigError as exc:
        raise ConvertError(f"configs/{name}.toml: {exc}") from None
    wrong = [f"configs/{name}.toml: model.{key} = {_toml_value(getattr(model, key))}, but "
             f"{hf_dir}/config.json describes {_toml_value(fields[key])}"
             for key in ARCHITECTURE_FIELDS if key in fields and getattr(model, key) != fields[key]]
    if wrong:
        raise ConvertError(wrong + [f"fix configs/{name}.toml or convert under a new --name"])
    return model, None


def check_tensors(maps: list[Any], expected: dict[str, tuple[int, ...]],
                  found: dict[str, tuple[tuple[int, ...], str]], hf_dir: Path) -> None:
    problems = []
    for name, shape in expected.items():
        if name not in found:
            problems.append(f"{hf_dir}: tensor {name} is missing (the config needs it)")
        elif found[name][0] != shape:
            problems.append(f"{hf_dir}: tensor {name} has shape {list(found[name][0])}, the "
                            f"config needs {list(shape)}")
        elif found[name][1] not in ("F32", "BF16", "F16"):
            problems.append(f"{hf_dir}: tensor {name} is {found[name][1]}; only float tensors "
                            "(F32, BF16, F16) are read")
    for name in sorted(set(found) - set(expected)):
        if not IGNORED_TENSOR.search(name):
            problems.append(f"{hf_dir}: tensor {name} has no place in the model (biases and "
                            "other extra weights are not supported)")
    if problems:
        raise ConvertError(problems)


def from_hf(hf_dir: Path, name: str, output: str, say: Callable[[str], None] = print,
            typed_output: str | None = None) -> dict[str, Any]:
    import ml_dtypes  # noqa: F401 - registers bfloat16 with numpy (safetensors' numpy reader)
    from etils import epath

    from ..config import CONFIG_DIR
    from ..runtime.storage import check_reachable
    from .llama import UnsupportedConfig, expected_hf_shapes, model_fields, tensor_maps
    from .weights import abstract_params as abstract_of
    from .weights import leaves_with_paths

    start = time.perf_counter()
    if name.endswith(".toml"):
        raise ConvertError(f"--name {name!r}: give the preset name without .toml "
                           f"(--name {name.removesuffix('.toml')} writes "
                           f"configs/{name.removesuffix('.toml')}.toml)")
    if not NAME_RE.match(name):
        raise ConvertError(f"--name {name!r}: use 1-64 lowercase letters, digits, '.', '_' or "
                           "'-', starting with a letter or digit (it names configs/NAME.toml)")
    hf = read_hf_config(hf_dir)
    try:
        fields = model_fields(hf)
    except UnsupportedConfig as exc:
        raise ConvertError([f"{hf_dir}/config.json: {p}" for p in exc.problems]) from None
    model, new_preset = model_for(name, hf_dir, fields)
    files = tensor_files(hf_dir)
    found = tensor_headers(files)
    abstract = abstract_of(model)
    leaves = leaves_with_paths(abstract)
    maps = list(tensor_maps(model, [path for path, _ in leaves]))
    shapes = {path: tuple(leaf.shape) for path, leaf in leaves}
    check_tensors(maps, expected_hf_shapes(model, maps, shapes), found, hf_dir)
    check_reachable(output)
    _require_empty_output(output)
    existed = epath.Path(output).exists()
    try:
        count = _write_weights(hf, hf_dir, name, output, model, files, leaves, maps, say)
        if new_preset is not None:  # last: a preset exists only for complete weights
            preset = CONFIG_DIR / f"{name}.toml"
            staged = preset.with_name(f".{preset.name}.{os.getpid()}")
            staged.write_text(new_preset)
            staged.rename(preset)
            say(f"wrote configs/{name}.toml (the model section of {hf_dir}/config.json)")
        else:
            say(f"configs/{name}.toml matches the architecture in {hf_dir}/config.json")
            if fields.get("dtype") and fields["dtype"] != model.dtype:
                say(f"note: configs/{name}.toml computes in model.dtype = {model.dtype!r}, but "
                    f"{hf_dir}/config.json's torch_dtype makes it {fields['dtype']!r}; the "
                    f"preset's is used (edit configs/{name}.toml to follow the checkpoint)")
    except BaseException:
        _remove_output(epath.Path(output), keep_dir=existed)
        raise
    result = {"command": "from-hf", "output": output, "preset": name, "params": count,
              "tensors": len(maps), "seconds": round(time.perf_counter() - start, 2)}
    say(f"wrote {count:,} parameters to {output} in {result['seconds']}s; train from them with "
        f"--config {name} --set train.init_from={typed_output or output}")
    return result


def _remove_output(path: Any, keep_dir: bool) -> None:
    """Undo a failed conversion: the output as it was before (absent, or the empty directory)."""
    if not path.exists():
        return
    if keep_dir:
        for child in path.iterdir():
            if child.is_dir():
                child.rmtree()
            else:
                child.unlink()
    else:
        path.rmtree()


def _write_weights(hf: dict[str, Any], hf_dir: Path, name: str, output: str, model: Any,
                   files: dict[str, Path], leaves: list[Any], maps: list[Any],
                   say: Callable[[str], None]) -> int:
    """Every parameter into the weights directory `output`, its marker last; returns the count."""
    import numpy as np
    from etils import epath
    from safetensors import safe_open

    from .weights import WeightsWriter

    dtype = np.dtype(model.param_dtype)
    maps_by_param: dict[tuple, list[Any]] = {}
    for m in maps:
        maps_by_param.setdefault(m.path, []).append(m)
    epath.Path(output).mkdir(parents=True, exist_ok=True)
    writer = WeightsWriter(output)
    done, count, last_report = 0, 0, time.monotonic()
    for path, leaf in leaves:  # one parameter in memory at a time (all layers, when stacked)
        value = np.empty(leaf.shape, dtype)
        for m in maps_by_param[path]:
            # Opened per tensor: the file is memory-mapped, and the pages of the tensors
            # already read would otherwise stay resident (a second copy of the checkpoint).
            try:
                with safe_open(files[m.hf_name], framework="numpy") as f:
                    tensor = f.get_tensor(m.hf_name)
            except Exception as exc:  # noqa: BLE001 - truncated or corrupt data: one line
                raise ConvertError(f"{files[m.hf_name]}: tensor {m.hf_name} is not readable "
                                   f"({exc}); the file is truncated or corrupt") from None
            part = m.to_ours(tensor.astype(dtype))
            if m.layer is None:
                value[...] = part
            else:
                value[m.layer] = part
            done += 1
        writer.write(path, value)
        count += value.size
        del value, part
        if time.monotonic() - last_report > 10 or done == len(maps):
            say(f"converted {done}/{len(maps)} tensors")
            last_report = time.monotonic()
    companions = [hf_dir / n for n in COMPANION_FILES if (hf_dir / n).is_file()]
    torch_dtype = str(hf.get("torch_dtype") or hf.get("dtype") or "float32")
    for file in companions:  # before the marker: a complete directory has them all
        (epath.Path(output) / COMPANION_DIR).mkdir(exist_ok=True)
        (epath.Path(output) / COMPANION_DIR / file.name).write_bytes(file.read_bytes())
    writer.finish({
        "model": dataclasses.asdict(model), "preset": name,
        "source": {"kind": "huggingface", "dir": str(hf_dir.resolve()),
                   "torch_dtype": torch_dtype if torch_dtype in EXPORT_DTYPES else "float32",
                   "config": hf, "companions": [f.name for f in companions]}})
    return count


# ---- to-hf ------------------------------------------------------------------------------------

def data_tokenizer(run_dir: str, config: Any) -> Any | None:
    """The tokenizer.json of the data set the run trained on (its metrics record where that
    was), when it was prepared with one."""
    from etils import epath

    from ..dataset.loader import data_dir
    from ..runtime.metrics import read_metrics

    ready = [r for r in read_metrics(run_dir) if r.get("event") == "data_ready" and r.get("path")]
    root = epath.Path(ready[-1]["path"] if ready else data_dir(config, run_dir))
    try:
        meta = json.loads((root / "metadata.json").read_text())
    except (OSError, ValueError):
        return None
    tokenizer = meta.get("tokenizer", {}) if isinstance(meta, dict) else {}
    if tokenizer.get("kind") in (None, "bytes") or not tokenizer.get("file"):
        return None
    path = root / tokenizer["file"]
    return path if path.exists() else None


def run_origin(run_dir: str) -> tuple[str, dict[str, Any]] | None:
    """(the weights directory, its marker's `source`) a run started from (`train.init_from`, as
    its fresh start recorded it), when that directory is still there; else None."""
    from ..runtime.metrics import read_metrics
    from .weights import is_weights_dir, read_marker

    starts = [r for r in read_metrics(run_dir) if r.get("event") == "fresh_start"]
    init_from = str(starts[-1].get("init_from") or "") if starts else ""
    try:
        if not init_from or not is_weights_dir(init_from):
            return None
        return init_from, read_marker(init_from).get("source", {})
    except (OSError, ValueError):
        return None


def _carried(weights_dir: str, origin: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
    """What a weights directory carries back out: config.json fields that are not the model's
    shape (token ids, initializer_range) and its companion files (tokenizer, generation)."""
    from etils import epath

    extra = {k: v for k, v in (origin.get("config") or {}).items()
             if k.endswith("token_id") or k in ("initializer_range",)}
    companions = [epath.Path(weights_dir) / COMPANION_DIR / n
                  for n in origin.get("companions", [])
                  if (epath.Path(weights_dir) / COMPANION_DIR / n).exists()]
    return extra, companions


def to_hf(source: str, step: int | None, config_name: str, output: str, dtype: str | None,
          max_shard_bytes: int, say: Callable[[str], None] = print) -> dict[str, Any]:
    import ml_dtypes  # noqa: F401 - registers bfloat16 with numpy

    from ..config import ConfigError, load_config
    from ..runtime.storage import check_reachable
    from .llama import UnsupportedConfig, hf_config
    from .weights import WeightsDir, open_params

    start = time.perf_counter()
    if output.startswith("gs://"):
        raise ConvertError(f"--output {output}: write the Hugging Face directory locally "
                           "(from_pretrained reads a local directory); copy it afterwards")
    try:
        config = load_config(config_name)
    except ConfigError as exc:
        raise ConvertError(f"--config {config_name}: {exc}") from None
    model = config.model
    extra: dict[str, Any] = {}
    companions: list[Any] = []
    check_reachable(source)
    params = open_params(source, step)
    if isinstance(params, WeightsDir):
        origin = params.marker.get("source", {})
        extra, companions = _carried(source, origin)
        dtype = dtype or origin.get("torch_dtype") or "float32"
    else:
        # A run that started from converted weights (a fine-tune) gives back what they carried:
        # the source's token ids, generation config, tokenizer and dtype.
        started = run_origin(source)
        if started is not None:
            extra, companions = _carried(*started)
            dtype = dtype or started[1].get("torch_dtype") or "float32"
            say(f"{source} started from {started[0]}: carrying its "
                + (", ".join(sorted(extra)) or "config") + " and "
                + (", ".join(c.name for c in companions) or "no companion files"))
        else:
            dtype = dtype or "float32"
        if not any(c.name == "tokenizer.json" for c in companions):
            tokenizer = data_tokenizer(source, config)
            companions += [tokenizer] if tokenizer is not None else []
    try:
        config_json = hf_config(model, dtype, extra)
    except UnsupportedConfig as exc:
        raise ConvertError(f"--config {config_name}: {exc}") from None
    params.check_shapes(model, "give the --config these parameters were trained or converted "
                               "with")
    check_mappable(model)
    _require_empty_output(output)

    target = Path(output)
    partial = target.parent / f"{target.name}.partial-{os.getpid()}"
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    try:
        return _write_hf(params, model, config_json, companions, partial, target, dtype,
                         max_shard_bytes, output, start, say)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


def check_mappable(model: Any) -> None:
    """ConvertError, in one line, when this model's parameters and the Hugging Face Llama layout
    (trainer/hf/llama.py tensor_maps) do not map one onto the other: a parameter the layout needs
    that the model lacks, or parameters of the model the layout has no name for (a fork's own
    layers, which would otherwise be left out of the export)."""
    from .llama import tensor_maps
    from .weights import abstract_params, leaves_with_paths

    paths = [path for path, _ in leaves_with_paths(abstract_params(model))]
    fix = ("to-hf writes the dense Llama layout; give their Hugging Face names in "
           "trainer/hf/llama.py tensor_maps, or export this model another way")
    try:
        mapped = {m.path for m in tensor_maps(model, paths)}
    except KeyError as exc:
        raise ConvertError(f"this model has no parameter {exc.args[0]!r}, which the Hugging Face "
                           f"Llama layout needs; {fix}") from None
    unmapped = ["/".join(map(str, p)) for p in paths if p not in mapped]
    if unmapped:
        shown = ", ".join(unmapped[:4]) + (f" and {len(unmapped) - 4} more"
                                           if len(unmapped) > 4 else "")
        raise ConvertError(f"{len(unmapped)} parameter(s) of this model have no Hugging Face "
                           f"name: {shown}; {fix}")


def _write_hf(params: Any, model: Any, config_json: dict[str, Any], companions: list[Any],
              partial: Path, target: Path, dtype: str, max_shard_bytes: int, output: str,
              start: float, say: Callable[[str], None]) -> dict[str, Any]:
    """The safetensors, index, companions and config.json into `partial`, renamed to `target`."""
    import numpy as np
    from safetensors.numpy import save_file

    from .llama import tensor_maps
    from .weights import abstract_params as abstract_of
    from .weights import leaves_with_paths

    np_dtype = np.dtype(dtype)
    leaves = leaves_with_paths(abstract_of(model))
    maps = list(tensor_maps(model, [path for path, _ in leaves]))
    maps_by_param: dict[tuple, list[Any]] = {}
    for m in maps:
        maps_by_param.setdefault(m.path, []).append(m)
    shard: dict[str, Any] = {}
    shard_bytes, shard_files, weight_map, total_bytes = 0, [], {}, 0

    def flush() -> None:
        nonlocal shard, shard_bytes
        if not shard:
            return
        file = partial / f"shard-{len(shard_files):05d}.safetensors"
        save_file(shard, str(file), metadata={"format": "pt"})
        shard_files.append((file, list(shard)))
        shard, shard_bytes = {}, 0

    done, last_report = 0, time.monotonic()
    for path, leaf in leaves:
        value = params.read_host(path, leaf)  # one parameter in memory at a time
        for m in maps_by_param.get(path, []):
            part = value[m.layer] if m.layer is not None else value
            tensor = np.ascontiguousarray(m.to_hf(part).astype(np_dtype))
            if shard and shard_bytes + tensor.nbytes > max_shard_bytes:
                flush()
            shard[m.hf_name] = tensor
            shard_bytes += tensor.nbytes
            total_bytes += tensor.nbytes
            done += 1
            if time.monotonic() - last_report > 10:
                say(f"wrote {done}/{len(maps)} tensors")
                last_report = time.monotonic()
        del value
    flush()
    count = len(shard_files)
    if count == 1:
        shard_files[0][0].rename(partial / SINGLE_FILE)
    else:
        for index, (file, names) in enumerate(shard_files, start=1):
            final = f"model-{index:05d}-of-{count:05d}.safetensors"
            file.rename(partial / final)
            weight_map.update(dict.fromkeys(names, final))
        (partial / INDEX_FILE).write_text(json.dumps(
            {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}, indent=2))
    for companion in companions:
        (partial / companion.name).write_bytes(companion.read_bytes())
    (partial / "config.json").write_text(json.dumps(config_json, indent=2))
    # safetensors creates its files 0600; every file gets the mode any other output has.
    mode = 0o666 & ~_umask()
    for file in partial.iterdir():
        file.chmod(mode)
    if target.exists():
        target.rmdir()  # checked empty above
    partial.rename(target)  # the directory appears whole
    result = {"command": "to-hf", "output": output, "source": params.what,
              "tensors": len(maps),
              "files": count, "bytes": total_bytes, "dtype": dtype,
              "seconds": round(time.perf_counter() - start, 2)}
    say(f"wrote {len(maps)} tensors ({total_bytes / 2**30:.2f} GiB {dtype}) in {count} file(s) "
        f"to {output} in {result['seconds']}s")
    return result


def _umask() -> int:
    """The process's umask, read without setting it (os.umask sets it, for a moment, for every
    thread: a file another thread creates then would get mode 0666)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def random_hf(config_name: str, output: str, seed: int, dtype: str,
              say: Callable[[str], None] = print) -> dict[str, Any]:
    """The preset's model, freshly initialised from `seed`, written as a Hugging Face checkpoint
    (config.json, model.safetensors) by `to_hf`: what `from-hf` reads, with nothing downloaded."""
    import tempfile

    import numpy as np
    from flax import nnx

    from ..config import ConfigError, load_config
    from ..model.transformer import TransformerLM
    from .weights import WeightsWriter, leaves_with_paths

    try:
        model = load_config(config_name).model
    except ConfigError as exc:
        raise ConvertError(f"--config {config_name}: {exc}") from None
    _require_empty_output(output)
    params = nnx.to_pure_dict(nnx.state(TransformerLM(model, rngs=nnx.Rngs(params=seed))))
    with tempfile.TemporaryDirectory(prefix="random-weights-") as staged:
        writer = WeightsWriter(staged)
        for path, leaf in leaves_with_paths(params):
            writer.write(path, np.asarray(leaf))
        writer.finish({"model": dataclasses.asdict(model), "preset": config_name,
                       "source": {"kind": "random", "seed": seed, "torch_dtype": dtype}})
        result = to_hf(staged, None, config_name, output, dtype, _size("2GB"), say=say)
    return {**result, "command": "random-hf", "source": f"random (seed {seed})"}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from ..config import ConfigError
    from ..runtime.storage import StorageError
    from .weights import WeightsError

    try:
        if args.command == "from-hf":
            # Absolute from here on; the hint echoes the paths as they were typed.
            result = from_hf(Path(absolute(args.hf_dir)), args.name, absolute(args.output),
                             typed_output=args.output)
        elif args.command == "random-hf":
            result = random_hf(args.config, args.output, args.seed, args.dtype)
        else:
            result = to_hf(args.source, args.step, args.config, args.output, args.dtype,
                           args.max_shard_size)
    except ConvertError as exc:
        for line in exc.lines:
            print(f"error: {line}", file=sys.stderr)
        return 2
    except (ConfigError, StorageError, WeightsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result), flush=True)
    return 0


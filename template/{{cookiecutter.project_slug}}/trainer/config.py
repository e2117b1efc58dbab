"""Typed experiment configuration: configs/base.toml, a preset on top, then `--set` overrides.

`configs/base.toml` declares every key with its default and a comment; a preset
(`configs/NAME.toml`, or any path ending in .toml) lists only what it changes, so a new key is
added to base.toml and a dataclass below, never to every preset.

Everything that can be checked without devices is checked in `load_config`; the checks that need
the topology (devices per slice, slice count, processes) live in `resolve`. Both run before any
compilation so a bad config fails in milliseconds with the offending numbers.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import tomllib
import warnings
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from .model.rope import Rope

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
BASE_CONFIG = "base"
DTYPES = ("float32", "bfloat16")
MLP_KINDS = ("gelu", "swiglu")
ATTENTION_KINDS = ("dense", "dot_product", "splash")
ROPE_SCALINGS = ("none", "llama3")
REMAT_POLICIES = ("none", "full", "save_matmuls")
SPLASH_BLOCK = 128  # the splash kernel tiles the sequence in blocks of (a multiple of) this


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the value and what is allowed."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    kind: str  # the registered model variant (trainer/model/registry.py); "transformer"
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int  # 0 = n_heads (multi-head); fewer = grouped-query attention
    head_dim: int  # 0 = d_model // n_heads
    d_ff: int
    mlp: str  # gelu | swiglu
    seq_len: int
    rope_theta: float
    rope_scaling: str  # none | llama3 (Llama 3.x checkpoints: the four fields below)
    rope_scaling_factor: float
    rope_low_freq_factor: float
    rope_high_freq_factor: float
    rope_original_max_len: int
    norm_eps: float
    tie_embeddings: bool
    dtype: str  # compute dtype of activations and matmuls
    param_dtype: str
    attention: str  # dense | dot_product | splash
    remat: str  # none | full | save_matmuls
    scan_layers: bool
    loss_chunk_size: int  # 0 = the whole sequence at once; else tokens per chunk of the loss
    # [model.settings]: the keys of the variant model.kind names, as (key, value) pairs; the
    # variant declares them with their defaults and checks them (model/registry.py settings)
    settings: tuple[tuple[str, Any], ...] = ()

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_size(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    def rope(self) -> Rope:
        return Rope(head_dim=self.head_size, theta=self.rope_theta, scaling=self.rope_scaling,
                    factor=self.rope_scaling_factor, low_freq_factor=self.rope_low_freq_factor,
                    high_freq_factor=self.rope_high_freq_factor,
                    original_max_len=self.rope_original_max_len)


BUILTIN_MESH_AXES = ("pipeline", "data", "fsdp", "tensor")
# The mesh's axes, outermost first (mesh.py builds this order). A fork adds an axis of its own
# here (say "expert" before "tensor", so tensor stays innermost, on the fastest links), with
# `ici_expert = 1` and `dcn_expert = 1` in configs/base.toml and a rule in sharding.py RULES
# that maps a logical axis to it; the toolkit's preview, planner and launchers carry any
# `ici_NAME`/`dcn_NAME` pair of a stack's trainer.mesh to --set mesh.* (README: "A model
# variant of your own").
MESH_AXES: tuple[str, ...] = BUILTIN_MESH_AXES


def mesh_axes() -> tuple[str, ...]:
    return MESH_AXES


def declare_mesh_axis(name: str, *, before: str = "tensor") -> None:
    """Add a mesh axis at run time (what editing MESH_AXES does; tests use it)."""
    global MESH_AXES
    if not name.isidentifier() or not name.islower():
        raise ValueError(f"mesh axis {name!r}: use a lowercase identifier, e.g. 'expert'")
    if name not in MESH_AXES:
        at = MESH_AXES.index(before)
        MESH_AXES = (*MESH_AXES[:at], name, *MESH_AXES[at:])


def forget_mesh_axis(name: str) -> None:
    global MESH_AXES
    if name in BUILTIN_MESH_AXES:
        raise ValueError(f"mesh axis {name!r} is built in")
    MESH_AXES = tuple(axis for axis in MESH_AXES if axis != name)


def ici_keys() -> tuple[str, ...]:
    return tuple(f"ici_{axis}" for axis in mesh_axes())


def dcn_keys() -> tuple[str, ...]:
    return tuple(f"dcn_{axis}" for axis in mesh_axes())


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    ici_data: int
    ici_fsdp: int
    ici_tensor: int
    dcn_data: int
    dcn_fsdp: int
    dcn_tensor: int
    ici_pipeline: int = 1
    dcn_pipeline: int = 1
    # (key, size) of the ici_/dcn_ keys of axes a fork adds (MESH_AXES); read as attributes
    extra: tuple[tuple[str, int], ...] = ()

    def __getattr__(self, key: str) -> int:
        for name, size in self.__dict__.get("extra", ()):
            if name == key:
                return size
        if key.startswith(("ici_", "dcn_")) and key[4:] in mesh_axes():
            return 1  # an axis added after this config was built: not split
        raise AttributeError(key)

    @property
    def ici(self) -> tuple[int, ...]:
        """Sizes inside a slice, in mesh_axes() order."""
        return tuple(getattr(self, key) for key in ici_keys())

    @property
    def dcn(self) -> tuple[int, ...]:
        """Sizes across slices, in mesh_axes() order."""
        return tuple(getattr(self, key) for key in dcn_keys())


# A pipeline stage's block of at most this many layers runs unrolled inside the tick loop (the
# default of train.pipeline_unroll_layers): a layer loop nested in the tick loop made the
# pipelined step 14-19% slower on 4 CPU devices (benchmarks/pipeline.py), and unrolling blocks
# this short keeps compile time within a constant of a scanned block's, flat in depth.
PIPELINE_UNROLL_LAYERS = 4


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    global_batch_size: int
    total_steps: int  # LR schedule horizon; `--steps` only decides where this run stops
    seed: int
    grad_accum_steps: int  # micro-batches per step; the update equals one pass over the batch
    pipeline_microbatches: int = 0  # pipeline micro-batches M per pass; 0 = the number of stages
    pipeline_repeats: int = 1  # R laps of the stage ring (circular schedule); 1 = GPipe
    pipeline_unroll_layers: int = PIPELINE_UNROLL_LAYERS  # longer stage blocks run as a loop
    init_from: str = ""  # weights directory (trainer.convert from-hf) a fresh run starts from


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    learning_rate: float
    warmup_steps: int
    min_lr_ratio: float
    weight_decay: float
    b1: float
    b2: float
    eps: float
    grad_clip_norm: float


@dataclasses.dataclass(frozen=True)
class MetricsConfig:
    log_every: int


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    every_steps: int  # 0 = only at the end of the run
    num_batches: int  # 0 = no evaluation
    batch_size: int  # global eval batch; 0 = train.global_batch_size


@dataclasses.dataclass(frozen=True)
class DataConfig:
    path: str  # prepared dataset (local or gs://); "" means RUN_DIR/data
    prepare_if_missing: bool  # build the built-in synthetic corpus at a `path` that does not exist
    worker_count: int  # Grain decode processes per trainer process; 0 reads in-process
    prefetch: int  # batches buffered per worker (worker_count > 0)
    prepare_wait_s: int  # gs://: how long to wait for the host that prepares the data set


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    save_interval_steps: int
    max_to_keep: int
    async_save: bool
    local_every: int  # every N steps each host also saves its part locally (0 = off)
    local_max_to_keep: int


@dataclasses.dataclass(frozen=True)
class ProfileConfig:
    start_step: int  # first global step traced (steps are counted from 1)
    num_steps: int  # 0 = profiling off


@dataclasses.dataclass(frozen=True)
class ElasticConfig:
    min_slices: int = 0  # 0 = off: a lost slice stops the job until it is back
    canonical_reduction: bool = False  # gradients summed in one fixed order at any slice count


@dataclasses.dataclass(frozen=True)
class Config:
    model: ModelConfig
    mesh: MeshConfig
    train: TrainConfig
    optim: OptimConfig
    metrics: MetricsConfig
    eval: EvalConfig
    data: DataConfig
    checkpoint: CheckpointConfig
    profile: ProfileConfig
    elastic: ElasticConfig = ElasticConfig()

    @property
    def eval_batch_size(self) -> int:
        return self.eval.batch_size or self.train.global_batch_size


# New sections are added here, as a field of Config, and to configs/base.toml.
SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "mesh": MeshConfig,
    "train": TrainConfig,
    "optim": OptimConfig,
    "metrics": MetricsConfig,
    "eval": EvalConfig,
    "data": DataConfig,
    "checkpoint": CheckpointConfig,
    "profile": ProfileConfig,
    "elastic": ElasticConfig,
}


@dataclasses.dataclass(frozen=True)
class Topology:
    """What the running job actually sees."""

    num_slices: int
    devices_per_slice: int
    num_processes: int


@dataclasses.dataclass(frozen=True)
class ResolvedMesh:
    """Mesh sizes with every -1 filled in; `shape` is the mesh, one size per axis of `axes`.

    A 4-tuple is read as (pipeline, data, fsdp, tensor) and a 3-tuple as (data, fsdp, tensor),
    an axis a fork adds being 1, so a mesh without stages can be written as before:
    ResolvedMesh(ici=(1, 4, 1), dcn=(2, 1, 1)).
    """

    ici: tuple[int, ...]
    dcn: tuple[int, ...]
    axes: tuple[str, ...] = dataclasses.field(default_factory=mesh_axes)

    def __post_init__(self) -> None:
        for name in ("ici", "dcn"):
            value = tuple(getattr(self, name))
            short = {3: BUILTIN_MESH_AXES[1:], 4: BUILTIN_MESH_AXES}.get(len(value))
            if len(value) != len(self.axes) and short is not None:
                sizes = dict(zip(short, value, strict=True))
                value = tuple(sizes.get(axis, 1) for axis in self.axes)
            if len(value) != len(self.axes):
                raise ValueError(f"ResolvedMesh.{name} = {value}: expected {len(self.axes)} "
                                 f"sizes ({', '.join(self.axes)}), 4 (pipeline, data, fsdp, "
                                 "tensor) or 3 without pipeline")
            object.__setattr__(self, name, value)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(i * d for i, d in zip(self.ici, self.dcn, strict=True))

    def size(self, axis: str) -> int:
        """The axis's size over the job (ici * dcn); 1 for an axis this mesh does not have."""
        return self.shape[self.axes.index(axis)] if axis in self.axes else 1

    @property
    def pipeline(self) -> int:
        """Pipeline stages S: each holds n_layers / S consecutive layers."""
        return self.size("pipeline")

    @property
    def data(self) -> int:
        return self.size("data")

    @property
    def fsdp(self) -> int:
        return self.size("fsdp")

    @property
    def tensor(self) -> int:
        return self.size("tensor")

    @property
    def stage_batch_shards(self) -> int:
        """Shards of a micro-batch inside one stage (data * fsdp)."""
        return self.data * self.fsdp

    @property
    def batch_shards(self) -> int:
        """Shards of the batch: data * fsdp (every pipeline stage holds the rows of its shard)."""
        return self.data * self.fsdp


# ---------------------------------------------------------------------------------------------
# Loading


def presets() -> list[str]:
    """The preset names in configs/ (base is the defaults every preset starts from)."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.toml"))


def config_path(name_or_path: str) -> Path:
    """`tiny` -> configs/tiny.toml; anything ending in .toml is taken as a path."""
    if name_or_path.endswith(".toml"):
        path = Path(name_or_path)
    else:
        path = CONFIG_DIR / f"{name_or_path}.toml"
    if not path.is_file():
        raise ConfigError(
            f"config {name_or_path!r} not found at {path}; use a preset ({', '.join(presets())}) "
            "or a path to a .toml file"
        )
    return path


MAX_PRESET_BYTES = 1 << 20  # a preset is a few hundred bytes; a megabyte is not one


EXTENDS_KEY = "extends"  # a preset's top-level `extends = "tiny"`: the preset it builds on


def _read_toml(path: Path) -> dict[str, Any]:
    size = path.stat().st_size
    if size > MAX_PRESET_BYTES:
        raise ConfigError(f"{path}: {size:,} bytes; a config is at most {MAX_PRESET_BYTES:,} "
                          "bytes of TOML")
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
    for section, values in raw.items():
        if section == EXTENDS_KEY:
            if not isinstance(values, str) or not values:
                raise ConfigError(f"{path}: {EXTENDS_KEY} = {values!r}: expected the name of "
                                  "a preset in configs/ or a path to a .toml file")
        elif not isinstance(values, dict):
            raise ConfigError(f"{path}: top-level key {section!r} must be a [section] table "
                              f"(or {EXTENDS_KEY} = \"PRESET\"); sections are "
                              f"{', '.join(SECTIONS)}")
    return raw


def _preset_chain(path: Path) -> list[dict[str, Any]]:
    """The preset and the presets it extends, the furthest first."""
    chain: list[dict[str, Any]] = []
    seen: list[Path] = []
    while True:
        if path.resolve() in seen:
            names = " -> ".join(p.stem for p in [*seen, path.resolve()])
            raise ConfigError(f"{seen[0]}: presets extend each other in a loop ({names})")
        seen.append(path.resolve())
        raw = _read_toml(path)
        parent = raw.pop(EXTENDS_KEY, None)
        chain.insert(0, raw)
        if parent is None or path.resolve() == config_path(BASE_CONFIG).resolve():
            return chain
        if parent.endswith(".toml") and not Path(parent).is_absolute():
            parent = str(path.parent / parent)  # relative to the preset that names it
        try:
            path = config_path(parent)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {EXTENDS_KEY} = {parent!r}: {exc}") from None


def preset_raw(name_or_path: str) -> dict[str, dict[str, Any]]:
    """configs/base.toml with the preset's values laid over it, section by section; a preset
    that extends another is laid over that one (and so on), its own values last."""
    merged = {section: dict(values)
              for section, values in _read_toml(config_path(BASE_CONFIG)).items()}
    path = config_path(name_or_path)
    if path.resolve() != config_path(BASE_CONFIG).resolve():
        for layer in _preset_chain(path):
            for section, values in layer.items():
                merged.setdefault(section, {}).update(values)
    return merged


def parse_override(text: str) -> tuple[str, str, Any]:
    """`section.key=value` with the value parsed as a TOML scalar (bare words become strings)."""
    lhs, sep, raw = text.partition("=")
    section, dot, key = lhs.strip().partition(".")
    if not sep or not dot or not section or not key:
        raise ConfigError(f"--set {text!r}: expected section.key=value, e.g. mesh.ici_fsdp=4")
    raw = raw.strip()
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # an unquoted string such as model.dtype=bfloat16
    if isinstance(value, dict | list):
        raise ConfigError(f"--set {text!r}: only scalar values are allowed, got {raw!r}")
    return section, key, value


def _coerce(section: str, field: Any, value: Any, typed: str | None = None) -> Any:
    """`value` as the field's type (a dataclass field: its .name and .type); `typed` is the
    text a --set gave, shown in the error."""
    expected = {"int": int, "float": float, "bool": bool, "str": str}[str(field.type)]
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
        shown = typed if typed is not None else (
            str(value).lower() if isinstance(value, bool) else repr(value))
        raise ConfigError(
            f"{section}.{field.name} = {shown}: expected {expected.__name__}"
        )
    return value


def build_config(raw: dict[str, Any], overrides: Sequence[str] = ()) -> Config:
    """Build a validated Config from a parsed TOML mapping and `section.key=value` overrides."""
    raw = {section: dict(values) for section, values in raw.items()}
    typed: dict[tuple[str, str], str] = {}
    for text in overrides:
        section, key, value = parse_override(text)
        typed[(section, key)] = text.partition("=")[2].strip()
        if section not in SECTIONS:
            raise ConfigError(
                f"--set {text!r}: unknown section {section!r}; sections are {', '.join(SECTIONS)}"
            )
        if section == "model" and key.startswith(f"{SETTINGS}."):  # model.settings.KEY=VALUE
            settings = dict(raw.setdefault("model", {}).get(SETTINGS) or {})
            settings[key.partition(".")[2]] = value
            raw["model"][SETTINGS] = settings
            continue
        raw.setdefault(section, {})[key] = value

    unknown = sorted(set(raw) - set(SECTIONS))
    if unknown:
        raise ConfigError(f"unknown config sections {unknown}; allowed: {', '.join(SECTIONS)}")
    sections: dict[str, Any] = {}
    for name, cls in SECTIONS.items():
        given = dict(raw.get(name, {}))
        fields = {f.name: f for f in dataclasses.fields(cls) if f.name not in ("extra", SETTINGS)}
        settings = _settings_table(given.pop(SETTINGS, {})) if cls is ModelConfig else None
        fork_axes: dict[str, Any] = {}
        if cls is MeshConfig:  # the ici_/dcn_ keys of the axes a fork adds (MESH_AXES): 1
            fork_axes = {key: given.pop(key, 1) for key in (*ici_keys(), *dcn_keys())
                         if key not in fields}
        extra = sorted(set(given) - set(fields))
        if extra:
            allowed = [*fields, *fork_axes]
            raise ConfigError(
                f"unknown key(s) {', '.join(_with_suggestion(name, k, allowed) for k in extra)}; "
                f"allowed keys in [{name}]: {', '.join(allowed)}"
            )
        missing = [k for k in fields if k not in given]
        if missing:
            raise ConfigError(
                f"[{name}] is missing {', '.join(missing)}; every key has its default in "
                f"{CONFIG_DIR / (BASE_CONFIG + '.toml')}"
            )
        values = {k: _coerce(name, f, given[k], typed.get((name, k))) for k, f in fields.items()}
        if fork_axes:
            values["extra"] = tuple(
                (key, _coerce(name, SimpleNamespace(name=key, type="int"), value,
                              typed.get((name, key))))
                for key, value in fork_axes.items())
        if settings:
            values[SETTINGS] = settings
        sections[name] = cls(**values)
    config = Config(**sections)
    validate(config)
    return config


SETTINGS = "settings"  # [model.settings]: the variant's own keys


def _settings_table(table: Any) -> tuple[tuple[str, Any], ...]:
    """[model.settings] as sorted (key, value) pairs of scalars; what the keys mean (and which
    are allowed) is the variant's to say (model/registry.py settings)."""
    if not isinstance(table, dict):
        raise ConfigError(f"model.settings = {table!r}: expected a table ([model.settings] with "
                          "key = value lines, or --set model.settings.KEY=VALUE)")
    for key, value in table.items():
        if isinstance(value, dict | list):
            raise ConfigError(f"model.settings.{key} = {value!r}: only scalar values (numbers, "
                              "booleans, strings) are allowed")
    return tuple(sorted(table.items()))


def _with_suggestion(section: str, key: str, allowed: Any) -> str:
    close = difflib.get_close_matches(key, list(allowed), n=1, cutoff=0.75)
    return f"{section}.{key}" + (f" (did you mean {section}.{close[0]}?)" if close else "")


def load_config(name_or_path: str, overrides: Sequence[str] = ()) -> Config:
    """The preset (over configs/base.toml) with `section.key=value` overrides, validated; the
    local paths it names (data.path, train.init_from) are made absolute here, relative to the
    working directory, so the run reads what the user typed wherever it is used."""
    return with_absolute_paths(build_config(preset_raw(name_or_path), overrides))


def with_absolute_paths(config: Config) -> Config:
    from .runtime.storage import absolute

    return dataclasses.replace(
        config,
        data=dataclasses.replace(config.data, path=absolute(config.data.path)),
        train=dataclasses.replace(config.train, init_from=absolute(config.train.init_from)))


# ---------------------------------------------------------------------------------------------
# Validation without devices


def _check_positive(section: str, values: dict[str, int | float]) -> None:
    for key, value in values.items():
        if not math.isfinite(value) or value <= 0:
            what = "a finite number > 0" if isinstance(value, float) else "> 0"
            raise ConfigError(f"{section}.{key} = {value}: must be {what}")


def _check_range(name: str, value: float, low: float, high: float, *, high_open: bool) -> None:
    inside = math.isfinite(value) and low <= value and (value < high if high_open
                                                        else value <= high)
    if not inside:
        bracket = ")" if high_open else "]"
        raise ConfigError(f"{name} = {value}: must be in [{low}, {high}{bracket}")


def _check_choice(name: str, value: str, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise ConfigError(f"{name} = {value!r}: allowed {', '.join(allowed)}")


def _check_parallelism_group(group: str, values: dict[str, int]) -> None:
    for key, value in values.items():
        if value == 0 or value < -1:
            raise ConfigError(f"mesh.{key} = {value}: must be a positive integer or -1 (fill in)")
    fills = [k for k, v in values.items() if v == -1]
    if len(fills) > 1:
        raise ConfigError(
            f"mesh: at most one {group} axis may be -1 (fill in the rest), got "
            f"{', '.join(f'{k} = -1' for k in fills)}"
        )


def validate_model(m: ModelConfig) -> None:
    _check_positive(
        "model",
        {k: getattr(m, k) for k in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff",
                                    "seq_len", "rope_theta", "norm_eps")},
    )
    for key in ("dtype", "param_dtype"):
        _check_choice(f"model.{key}", getattr(m, key), DTYPES)
    _check_choice("model.mlp", m.mlp, MLP_KINDS)
    _check_choice("model.attention", m.attention, ATTENTION_KINDS)
    _check_choice("model.remat", m.remat, REMAT_POLICIES)
    _check_choice("model.rope_scaling", m.rope_scaling, ROPE_SCALINGS)
    if m.rope_scaling == "llama3":
        _check_positive("model", {k: getattr(m, k) for k in (
            "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_len")})
        if not math.isfinite(m.rope_scaling_factor) or m.rope_scaling_factor < 1:
            raise ConfigError(f"model.rope_scaling_factor = {m.rope_scaling_factor}: must be a "
                              "finite number >= 1 (how much the low frequencies are slowed)")
        if not m.rope_high_freq_factor > m.rope_low_freq_factor:
            raise ConfigError(
                f"model.rope_high_freq_factor = {m.rope_high_freq_factor} must be greater than "
                f"model.rope_low_freq_factor = {m.rope_low_freq_factor}: frequencies between the "
                "two are interpolated (Llama 3 uses 4 and 1)")
    for key in ("n_kv_heads", "head_dim", "loss_chunk_size"):
        if getattr(m, key) < 0:
            raise ConfigError(f"model.{key} = {getattr(m, key)}: must be >= 0 (0 = derived)")
    if not m.head_dim and m.d_model % m.n_heads:
        raise ConfigError(
            f"model.d_model = {m.d_model} is not divisible by model.n_heads = {m.n_heads}; "
            "change one, or set model.head_dim"
        )
    if m.n_heads % m.kv_heads:
        raise ConfigError(
            f"model.n_heads = {m.n_heads} is not a multiple of model.n_kv_heads = "
            f"{m.n_kv_heads} (each key/value head serves n_heads / n_kv_heads query heads)"
        )
    if m.head_size % 2:
        raise ConfigError(f"the head size {m.head_size} (model.head_dim, or d_model / n_heads) "
                          "must be even: RoPE rotates pairs of channels")
    if 0 < m.loss_chunk_size < m.seq_len and m.seq_len % m.loss_chunk_size:
        raise ConfigError(
            f"model.seq_len = {m.seq_len} is not divisible by model.loss_chunk_size = "
            f"{m.loss_chunk_size}; use a divisor of seq_len or 0 (no chunking)"
        )
    if m.attention == "splash" and m.seq_len % SPLASH_BLOCK:
        raise ConfigError(
            f"model.attention = 'splash' needs model.seq_len divisible by {SPLASH_BLOCK}, got "
            f"{m.seq_len}; use dense or dot_product for this length"
        )


def validate_optim(o: OptimConfig, total_steps: int) -> None:
    _check_positive("optim", {"learning_rate": o.learning_rate, "eps": o.eps,
                              "grad_clip_norm": o.grad_clip_norm})
    _check_range("optim.b1", o.b1, 0.0, 1.0, high_open=True)
    _check_range("optim.b2", o.b2, 0.0, 1.0, high_open=True)
    _check_range("optim.min_lr_ratio", o.min_lr_ratio, 0.0, 1.0, high_open=False)
    if not math.isfinite(o.weight_decay) or o.weight_decay < 0:
        raise ConfigError(f"optim.weight_decay = {o.weight_decay}: must be a finite number >= 0")
    if not 0 <= o.warmup_steps < total_steps:
        raise ConfigError(
            f"optim.warmup_steps = {o.warmup_steps} must be in [0, train.total_steps = "
            f"{total_steps})"
        )


def validate(config: Config) -> None:
    """Checks that need no devices: ranges, choices, -1 usage, and model shape arithmetic."""
    t = config.train
    validate_model(config.model)
    _check_positive("train", {"global_batch_size": t.global_batch_size,
                              "total_steps": t.total_steps, "grad_accum_steps": t.grad_accum_steps})
    if t.global_batch_size % t.grad_accum_steps:
        raise ConfigError(
            f"train.global_batch_size = {t.global_batch_size} is not divisible by "
            f"train.grad_accum_steps = {t.grad_accum_steps} (equal micro-batches)"
        )
    if not 0 <= t.seed < 2**32:
        raise ConfigError(f"train.seed = {t.seed}: must be in [0, 2**32)")
    validate_optim(config.optim, t.total_steps)
    if config.metrics.log_every <= 0:
        raise ConfigError(f"metrics.log_every = {config.metrics.log_every}: must be > 0")
    e = config.eval
    for key in ("every_steps", "num_batches", "batch_size"):
        if getattr(e, key) < 0:
            raise ConfigError(f"eval.{key} = {getattr(e, key)}: must be >= 0")
    if config.data.worker_count < 0:
        raise ConfigError(f"data.worker_count = {config.data.worker_count}: must be >= 0 "
                          "(0 reads in the trainer process)")
    if config.data.prefetch < 1:
        raise ConfigError(f"data.prefetch = {config.data.prefetch}: must be >= 1")
    if config.data.prepare_wait_s < 1:
        raise ConfigError(f"data.prepare_wait_s = {config.data.prepare_wait_s}: must be >= 1 "
                          "(seconds)")
    _check_positive("checkpoint", {"save_interval_steps": config.checkpoint.save_interval_steps,
                                   "max_to_keep": config.checkpoint.max_to_keep,
                                   "local_max_to_keep": config.checkpoint.local_max_to_keep})
    if config.checkpoint.local_every < 0:
        raise ConfigError(f"checkpoint.local_every = {config.checkpoint.local_every}: must be "
                          ">= 0 (steps between saves to host-local storage; 0 = off)")
    p = config.profile
    if p.num_steps < 0:
        raise ConfigError(f"profile.num_steps = {p.num_steps}: must be >= 0 (0 = off)")
    if p.num_steps and p.start_step < 1:
        raise ConfigError(f"profile.start_step = {p.start_step}: must be >= 1 (steps count "
                          "from 1) when profile.num_steps > 0")
    mesh = config.mesh
    _check_parallelism_group("ici", dict(zip(ici_keys(), mesh.ici, strict=True)))
    _check_parallelism_group("dcn", dict(zip(dcn_keys(), mesh.dcn, strict=True)))
    if t.pipeline_microbatches < 0:
        raise ConfigError(f"train.pipeline_microbatches = {t.pipeline_microbatches}: must be >= 0 "
                          "(0 = one micro-batch per pipeline stage)")
    if t.pipeline_repeats < 1:
        raise ConfigError(f"train.pipeline_repeats = {t.pipeline_repeats}: must be >= 1 (1 = "
                          "GPipe, R > 1 = a circular schedule of R laps over the stages)")
    if t.pipeline_unroll_layers < 0:
        raise ConfigError(f"train.pipeline_unroll_layers = {t.pipeline_unroll_layers}: must be "
                          ">= 0 (a stage's block of at most this many layers runs unrolled; 0 = "
                          "always a loop)")
    if -1 not in (mesh.ici_pipeline, mesh.dcn_pipeline):
        validate_pipeline(config, mesh.ici_pipeline * mesh.dcn_pipeline)
    validate_elastic(config)


def validate_elastic(config: Config) -> None:
    """What an elastic job needs of its mesh: every slice a whole replica of the state (only
    dcn_data crosses slices), so a survivor's own copy restores it at any slice count."""
    e = config.elastic
    if e.min_slices < 0:
        raise ConfigError(f"elastic.min_slices = {e.min_slices}: must be >= 0 (0 = off; else the "
                          "fewest slices the job keeps training on)")
    if e.canonical_reduction and not e.min_slices:
        raise ConfigError("elastic.canonical_reduction = true needs elastic.min_slices >= 1 "
                          "(it orders the reduction of an elastic job)")
    if not e.min_slices:
        return
    across = [f"{key} = {value}" for key, value in zip(dcn_keys(), config.mesh.dcn, strict=True)
              if key != "dcn_data" and value != 1]
    if across:
        raise ConfigError(
            f"elastic.min_slices = {e.min_slices} needs every slice to hold a whole copy of the "
            f"state, but {', '.join(across)} shards it across slices; set them to 1 (dcn_data "
            "alone crosses slices) or elastic.min_slices = 0")
    if e.canonical_reduction and config.mesh.ici_pipeline != 1:
        raise ConfigError(
            f"elastic.canonical_reduction = true with mesh.ici_pipeline = "
            f"{config.mesh.ici_pipeline}: the canonical order sums whole micro-batch gradients, "
            "which a pipeline splits over stages; use ici_pipeline = 1 or canonical_reduction "
            "= false")


def pipeline_microbatches(config: Config, stages: int) -> int:
    """M, the GPipe micro-batches of one pass (train.pipeline_microbatches, 0 = S)."""
    return config.train.pipeline_microbatches or stages


def validate_pipeline(config: Config, stages: int) -> None:
    """The rules of a pipeline of `stages` stages that need neither another mesh axis nor the
    model variant (how its depth splits into stages: model/checks.py check_depth)."""
    t, m = config.train, config.model
    given = f"mesh.ici_pipeline * mesh.dcn_pipeline = {stages}"
    if stages == 1:
        for key, value, default in (("pipeline_microbatches", t.pipeline_microbatches, 0),
                                    ("pipeline_repeats", t.pipeline_repeats, 1)):
            if value > max(default, 1):
                raise ConfigError(
                    f"train.{key} = {value} needs a pipeline, but {given}; set mesh.ici_pipeline "
                    f"or mesh.dcn_pipeline > 1, or leave train.{key} = {default}")
        return
    if not m.scan_layers:
        raise ConfigError(f"{given} needs model.scan_layers = true: a stage is a block of "
                          "consecutive layers of the stacked (scanned) layer parameters")
    micro = pipeline_microbatches(config, stages)
    if micro % stages:
        raise ConfigError(
            f"train.pipeline_microbatches = {micro} is not a multiple of the {stages} pipeline "
            f"stages ({given}): a micro-batch's next lap (and the next micro-batch) enters stage "
            f"0 only once the stages are full; use {stages}, {2 * stages}, {4 * stages}, ... "
            f"(0 = {stages})")
    rows = t.global_batch_size // t.grad_accum_steps
    if rows % micro:
        raise ConfigError(
            f"train.global_batch_size = {t.global_batch_size} / train.grad_accum_steps = "
            f"{t.grad_accum_steps} = {rows} rows do not split into train.pipeline_microbatches "
            f"= {micro} micro-batches; make the batch a multiple of {t.grad_accum_steps * micro}")


# ---------------------------------------------------------------------------------------------
# Resolution against the topology


def _fill(group: str, names: tuple[str, ...], values: tuple[int, ...], total: int,
          unit: str) -> tuple[int, ...]:
    product_text = "*".join(names)
    known = math.prod(v for v in values if v != -1)
    if -1 in values:
        if total % known:
            fixed = ", ".join(f"{n} = {v}" for n, v in zip(names, values, strict=True) if v != -1)
            raise ConfigError(
                f"cannot fill in the -1 in {product_text}: {total} {unit} are not divisible by "
                f"{known} ({fixed})"
            )
        return tuple(total // known if v == -1 else v for v in values)
    if known != total:
        given = ", ".join(f"{n} = {v}" for n, v in zip(names, values, strict=True))
        raise ConfigError(
            f"{product_text} = {known} but {'each slice has' if group == 'ici' else 'the job has'}"
            f" {total} {unit} ({given}); make the product {total} or set one to -1"
        )
    return values


def _fill_group(group: str, keys: tuple[str, ...], values: tuple[int, ...], total: int,
                unit: str) -> tuple[int, ...]:
    """_fill over every axis; a pipeline (or an axis a fork adds) of 1 is left out of the
    messages, so that those of a mesh without stages read as before."""
    shown = [i for i, (key, value) in enumerate(zip(keys, values, strict=True))
             if value != 1 or key[4:] in ("data", "fsdp", "tensor")]
    filled = _fill(group, tuple(keys[i] for i in shown), tuple(values[i] for i in shown), total,
                   unit)
    out = list(values)
    for i, value in zip(shown, filled, strict=True):
        out[i] = value
    return tuple(out)


def resolve_mesh(mesh: MeshConfig, topology: Topology) -> ResolvedMesh:
    """Fill in the -1s from the topology and check both products, with numbers."""
    ici = _fill_group("ici", ici_keys(), mesh.ici, topology.devices_per_slice, "devices")
    dcn = _fill_group("dcn", dcn_keys(), mesh.dcn, topology.num_slices, "slices")
    resolved = ResolvedMesh(ici=ici, dcn=dcn)
    dcn_tensor = resolved.dcn[resolved.axes.index("tensor")]
    if dcn_tensor > 1:
        warnings.warn(
            f"dcn_tensor = {dcn_tensor}: tensor parallelism all-reduces activations in "
            "every layer, "
            "and DCN between slices (~50 Gbps per host) is far slower than ICI; prefer "
            "dcn_data (or dcn_fsdp) across slices",
            stacklevel=3,
        )
    return resolved


def axis_text(resolved: ResolvedMesh, axis: str) -> str:
    i = resolved.axes.index(axis)
    return (f"{axis} {resolved.shape[i]} = ici_{axis} {resolved.ici[i]} * dcn_{axis} "
            f"{resolved.dcn[i]}")


def resolve(config: Config, topology: Topology) -> ResolvedMesh:
    """Resolve the mesh, then check that the batch divides over it, with numbers. What asks the
    model variant (its depth over the stages, its parameters over the mesh) is
    model/checks.py's resolve, which calls this first: the trainer, --check and the preview's
    model summary run that one."""
    resolved = resolve_mesh(config.mesh, topology)
    validate_pipeline(config, resolved.pipeline)  # the stage count may come from a -1 fill
    batch = config.train.global_batch_size
    shards_text = ", ".join(axis_text(resolved, axis) for axis in ("data", "fsdp"))
    if batch % resolved.batch_shards:
        raise ConfigError(
            f"train.global_batch_size = {batch} is not divisible by the {resolved.batch_shards} "
            f"batch shards ({shards_text})"
        )
    if batch % topology.num_processes:
        raise ConfigError(
            f"train.global_batch_size = {batch} is not divisible by the {topology.num_processes} "
            "processes, so the per-process batch would not be an integer"
        )
    accum = config.train.grad_accum_steps
    if batch % (accum * resolved.batch_shards):
        raise ConfigError(
            f"train.global_batch_size = {batch} does not split into train.grad_accum_steps = "
            f"{accum} micro-batches of whole rows per batch shard ({resolved.batch_shards} "
            f"shards): make it a multiple of {accum * resolved.batch_shards}"
        )
    eval_batch = config.eval_batch_size
    if config.eval.num_batches and (eval_batch % resolved.batch_shards
                                    or eval_batch % topology.num_processes):
        raise ConfigError(
            f"the eval batch {eval_batch} (eval.batch_size, 0 = train.global_batch_size) is not "
            f"divisible by the {resolved.batch_shards} batch shards and the "
            f"{topology.num_processes} processes"
        )
    _check_pipeline_batches(config, resolved)
    return resolved


def _check_pipeline_batches(config: Config, resolved: ResolvedMesh) -> None:
    """Every micro-batch of the schedule splits over the data and fsdp shards of a stage."""
    stages = resolved.pipeline
    if stages == 1:
        return
    micro = pipeline_microbatches(config, stages)
    shards = resolved.stage_batch_shards
    inside = f"{axis_text(resolved, 'data')}, {axis_text(resolved, 'fsdp')}"
    rows = config.train.global_batch_size // config.train.grad_accum_steps
    if rows % (micro * shards):
        raise ConfigError(
            f"a pipeline micro-batch of train.global_batch_size = "
            f"{config.train.global_batch_size} / train.grad_accum_steps = "
            f"{config.train.grad_accum_steps} / train.pipeline_microbatches = {micro} rows does "
            f"not split over the {shards} batch shards of a stage ({inside}); make the batch a "
            f"multiple of {config.train.grad_accum_steps * micro * shards}")
    eval_batch = config.eval_batch_size
    if config.eval.num_batches and eval_batch % (micro * shards):
        raise ConfigError(
            f"the eval batch {eval_batch} (eval.batch_size, 0 = train.global_batch_size) does "
            f"not split into train.pipeline_microbatches = {micro} micro-batches over the "
            f"{shards} batch shards of a stage ({inside}); make it a multiple of "
            f"{micro * shards}")

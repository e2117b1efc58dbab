"""Hugging Face `LlamaForCausalLM` checkpoints <-> this model: config fields and tensor layouts.

Pure numpy; trainer/hf/convert.py does the files. The two models compute the same function for the
same weights: HF's rotary embedding rotates the channel pairs (i, i + K/2) (`rotate_half`), as
attention.apply_rope does, so no query/key permutation is needed, only these reshapes:

    model.embed_tokens.weight                  [V, D]       embed_VxD
    model.layers.N.self_attn.q_proj.weight     [H*K, D]     blocks/attn/wq_DxHxK[N]   (D, H, K)
    model.layers.N.self_attn.k_proj.weight     [G*K, D]     blocks/attn/wk_DxGxK[N]   (D, G, K)
    model.layers.N.self_attn.v_proj.weight     [G*K, D]     blocks/attn/wv_DxGxK[N]   (D, G, K)
    model.layers.N.self_attn.o_proj.weight     [D, H*K]     blocks/attn/wo_HxKxD[N]   (H, K, D)
    model.layers.N.mlp.gate_proj.weight        [F, D]       blocks/mlp/w_gate_DxF[N]  (D, F)
    model.layers.N.mlp.up_proj.weight          [F, D]       blocks/mlp/w_in_DxF[N]    (D, F)
    model.layers.N.mlp.down_proj.weight        [D, F]       blocks/mlp/w_out_FxD[N]   (F, D)
    model.layers.N.input_layernorm.weight      [D]          blocks/attn_norm/scale[N]
    model.layers.N.post_attention_layernorm... [D]          blocks/mlp_norm/scale[N]
    model.norm.weight                          [D]          final_norm/scale
    lm_head.weight                             [V, D]       unembed_DxV (D, V); absent when tied

With model.scan_layers the blocks' parameters are stacked on a leading layer axis ([N] above);
without it they are blocks/N/... .
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ..model.registry import DEFAULT_KIND

ARCHITECTURE = "LlamaForCausalLM"
# What LlamaConfig assumes when config.json leaves a key out (transformers' defaults).
HF_DEFAULTS = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
               "tie_word_embeddings": False, "rope_theta": 10000.0, "rope_scaling": None,
               "rms_norm_eps": 1e-6, "pretraining_tp": 1, "max_position_embeddings": 2048}
REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads")
# The model section's fields that define the architecture (and so the checkpoint's tensors);
# the others (seq_len, dtype, remat, ...) are training choices a preset may change freely.
ARCHITECTURE_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                       "d_ff", "mlp", "rope_theta", "rope_scaling", "rope_scaling_factor",
                       "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_len",
                       "norm_eps", "tie_embeddings")
DEFAULT_SEQ_LEN = 2048


class UnsupportedConfig(ValueError):
    """config.json describes a model this one cannot represent; `problems` has one line each."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("; ".join(problems))


def _get(hf: dict[str, Any], key: str) -> Any:
    return hf.get(key, HF_DEFAULTS.get(key))


def model_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The [model] section that an HF Llama config.json describes; UnsupportedConfig lists every
    field the model cannot represent."""
    problems: list[str] = []
    architectures = hf.get("architectures") or []
    if hf.get("model_type") not in (None, "llama") or (architectures
                                                       and architectures != [ARCHITECTURE]):
        problems.append(f"architectures = {architectures} (model_type {hf.get('model_type')!r})"
                        f": only {ARCHITECTURE} (model_type 'llama') can be converted")
    for key in REQUIRED:
        value = hf.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            problems.append(f"{key} = {value!r}: expected a positive integer")
    if _get(hf, "hidden_act") != "silu":
        problems.append(f"hidden_act = {_get(hf, 'hidden_act')!r}: the model's gated MLP is "
                        "SwiGLU, so only 'silu' is supported")
    for key in ("attention_bias", "mlp_bias"):
        if _get(hf, key):
            problems.append(f"{key} = true: the model has no biases; only false is supported")
    if _get(hf, "pretraining_tp") not in (1, None):
        problems.append(f"pretraining_tp = {_get(hf, 'pretraining_tp')!r}: only 1 is supported")
    scaling = _get(hf, "rope_scaling")
    rope: dict[str, Any] = {"rope_scaling": "none"}
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None
        if kind == "default":
            pass
        elif kind != "llama3":
            problems.append(f"rope_scaling = {scaling!r}: only rope_type 'llama3' (or none) is "
                            "supported")
        else:
            keys = {"factor": ("rope_scaling_factor", float),
                    "low_freq_factor": ("rope_low_freq_factor", float),
                    "high_freq_factor": ("rope_high_freq_factor", float),
                    "original_max_position_embeddings": ("rope_original_max_len", int)}
            missing = [k for k in keys if not isinstance(scaling.get(k), int | float)]
            if missing:
                problems.append(f"rope_scaling is missing {', '.join(missing)} for rope_type "
                                "'llama3'")
            else:
                rope = {"rope_scaling": "llama3",
                        **{ours: kind(scaling[theirs]) for theirs, (ours, kind) in keys.items()}}
    for key in ("rope_theta", "rms_norm_eps"):
        value = _get(hf, key)
        if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
            problems.append(f"{key} = {value!r}: expected a positive number")
    for key in ("max_position_embeddings", "num_key_value_heads", "head_dim"):
        value = hf.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or value <= 0):
            problems.append(f"{key} = {value!r}: expected a positive integer")
    if problems:
        raise UnsupportedConfig(problems)
    d, heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or d // heads
    max_len = int(_get(hf, "max_position_embeddings") or DEFAULT_SEQ_LEN)
    return {
        "vocab_size": hf["vocab_size"],
        "d_model": d,
        "n_layers": hf["num_hidden_layers"],
        "n_heads": heads,
        "n_kv_heads": hf.get("num_key_value_heads") or heads,
        "head_dim": 0 if head_dim * heads == d else head_dim,
        "d_ff": hf["intermediate_size"],
        "mlp": "swiglu",
        "seq_len": min(max_len, DEFAULT_SEQ_LEN),
        "rope_theta": float(_get(hf, "rope_theta")),
        **rope,
        "norm_eps": float(_get(hf, "rms_norm_eps")),
        "tie_embeddings": bool(_get(hf, "tie_word_embeddings")),
        # Compute in the checkpoint's own dtype (float16 in float32, which holds it exactly), so
        # a converted model gives Hugging Face's own outputs, greedy tokens included.
        "dtype": "bfloat16" if str(hf.get("torch_dtype") or hf.get("dtype")) == "bfloat16"
        else "float32",
    }


def hf_config(model: Any, torch_dtype: str, extra: dict[str, Any] | None = None
              ) -> dict[str, Any]:
    """config.json for a ModelConfig (`extra`: token ids and the like, carried over)."""
    kind = getattr(model, "kind", DEFAULT_KIND)
    if kind != DEFAULT_KIND:
        raise UnsupportedConfig([f"model.kind = {kind!r}: only the {DEFAULT_KIND!r} model maps "
                                 f"onto {ARCHITECTURE}; a variant's weights stay in the "
                                 "trainer's checkpoint format"])
    if model.mlp != "swiglu":
        raise UnsupportedConfig([f"model.mlp = {model.mlp!r}: {ARCHITECTURE} has a SwiGLU MLP; "
                                 "only a 'swiglu' model can be exported"])
    out: dict[str, Any] = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "vocab_size": model.vocab_size,
        "hidden_size": model.d_model,
        "intermediate_size": model.d_ff,
        "num_hidden_layers": model.n_layers,
        "num_attention_heads": model.n_heads,
        "num_key_value_heads": model.kv_heads,
        "head_dim": model.head_size,
        "hidden_act": "silu",
        "max_position_embeddings": max(model.seq_len, model.rope_original_max_len
                                       if model.rope_scaling == "llama3" else 0),
        "rms_norm_eps": model.norm_eps,
        "rope_theta": model.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "tie_word_embeddings": model.tie_embeddings,
        "torch_dtype": torch_dtype,
        "use_cache": True,
    }
    if model.rope_scaling == "llama3":
        out["rope_scaling"] = {"rope_type": "llama3", "factor": model.rope_scaling_factor,
                               "low_freq_factor": model.rope_low_freq_factor,
                               "high_freq_factor": model.rope_high_freq_factor,
                               "original_max_position_embeddings": model.rope_original_max_len}
    for key, value in (extra or {}).items():
        out.setdefault(key, value)
    return out


@dataclasses.dataclass(frozen=True)
class TensorMap:
    """One HF tensor <-> one slice of one parameter of ours."""

    hf_name: str
    path: tuple[Any, ...]  # our parameter's path in the params tree
    layer: int | None  # index on the stacked layer axis, None for an unstacked parameter
    to_ours: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]


def _layouts(model: Any) -> dict[str, tuple[str, Callable, Callable]]:
    d, h, g, k = model.d_model, model.n_heads, model.kv_heads, model.head_size

    def heads_in(n: int) -> tuple[Callable, Callable]:  # [n*K, D] <-> (D, n, K)
        return (lambda w: w.reshape(n, k, d).transpose(2, 0, 1),
                lambda p: p.transpose(1, 2, 0).reshape(n * k, d))

    def transpose() -> tuple[Callable, Callable]:
        return (lambda w: w.T, lambda p: p.T)

    same = (lambda w: w, lambda p: p)
    return {
        "attn/wq_DxHxK": ("self_attn.q_proj.weight", *heads_in(h)),
        "attn/wk_DxGxK": ("self_attn.k_proj.weight", *heads_in(g)),
        "attn/wv_DxGxK": ("self_attn.v_proj.weight", *heads_in(g)),
        "attn/wo_HxKxD": ("self_attn.o_proj.weight",
                          lambda w: w.reshape(d, h, k).transpose(1, 2, 0),
                          lambda p: p.transpose(2, 0, 1).reshape(d, h * k)),
        "mlp/w_gate_DxF": ("mlp.gate_proj.weight", *transpose()),
        "mlp/w_in_DxF": ("mlp.up_proj.weight", *transpose()),
        "mlp/w_out_FxD": ("mlp.down_proj.weight", *transpose()),
        "attn_norm/scale": ("input_layernorm.weight", *same),
        "mlp_norm/scale": ("post_attention_layernorm.weight", *same),
    }


def tensor_maps(model: Any, param_paths: list[tuple[Any, ...]]) -> Iterator[TensorMap]:
    """Every HF tensor of this model, in HF's order, with where it lives among `param_paths`
    (the paths of the model's params tree: the layout decides stacked or per-layer blocks)."""
    paths = {"/".join(map(str, p)): p for p in param_paths}
    same = (lambda w: w, lambda p: p)
    yield TensorMap("model.embed_tokens.weight", paths["embed_VxD"], None, *same)
    layouts = _layouts(model)
    stacked = any(key.startswith("blocks/attn/") for key in paths)
    for layer in range(model.n_layers):
        for ours, (theirs, to_ours, to_hf) in layouts.items():
            if ours.startswith("mlp/w_gate") and model.mlp != "swiglu":
                continue
            key = f"blocks/{ours}" if stacked else f"blocks/{layer}/{ours}"
            yield TensorMap(f"model.layers.{layer}.{theirs}", paths[key],
                            layer if stacked else None, to_ours, to_hf)
    yield TensorMap("model.norm.weight", paths["final_norm/scale"], None, *same)
    if not model.tie_embeddings:
        yield TensorMap("lm_head.weight", paths["unembed_DxV"], None,
                        lambda w: w.T, lambda p: p.T)


def expected_hf_shapes(model: Any, maps: list[TensorMap], our_shapes: dict[tuple, tuple]
                       ) -> dict[str, tuple[int, ...]]:
    """The shape each HF tensor must have, derived by mapping our shapes back."""
    out = {}
    for m in maps:
        shape = our_shapes[m.path][1:] if m.layer is not None else our_shapes[m.path]
        # A broadcast int8 zero: no memory for the shape of a 128k-row embedding.
        out[m.hf_name] = m.to_hf(np.broadcast_to(np.int8(0), shape)).shape
    return out

"""Greedy text from trained or converted parameters, as a sanity check after training.

    python -m trainer.sample --config NAME (--init-from WEIGHTS_DIR | --run-dir R [--step N])
                             (--prompt-ids 1,2,3 | --prompt TEXT) --max-new-tokens N
                             [--one-device] [--no-cache] [--set SECTION.KEY=VALUE ...]
 The parameters keep the shardings of the training mesh built from this process's devices (or
sit on one device with --one-device); decoding uses a key/value cache (trainer/model/decode.py),
or the full forward pass for every token with --no-cache. --prompt needs the data set's
tokenizer (a run's, or the tokenizer.json a conversion carried); the byte tokenizer needs none.
Prints the text when it can decode it, a status line with tokens/s on stderr, and last one JSON
line:
{"ids": [the new token ids]}. Exit codes: 0 done, 2 invalid input (one line).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from .hf.convert import int_at_least
from .runtime.storage import absolute


class SampleError(ValueError):
    """An argument or input that cannot be sampled from; names it and what is allowed."""


def _ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids such as 1,2,3, "
                                         f"got {text!r}") from None
    if not ids or any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError(f"expected one or more token ids >= 0, got {text!r}")
    return ids


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m trainer.sample", allow_abbrev=False,
                                     description="Greedy decoding from trained parameters.")
    parser.add_argument("--config", required=True, help="the preset the parameters belong to")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--init-from", type=absolute, metavar="WEIGHTS_DIR",
                        help="a weights directory (python -m trainer.convert from-hf)")
    source.add_argument("--run-dir", type=absolute,
                        help="a run directory: its newest (or --step) checkpoint")
    parser.add_argument("--step", type=int_at_least(0, "a checkpoint step"), default=None,
                        help="with --run-dir: the step")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt-ids", type=_ids, metavar="1,2,3")
    prompt.add_argument("--prompt", metavar="TEXT", help="text, tokenized with the data's "
                                                          "tokenizer")
    parser.add_argument("--max-new-tokens", type=int_at_least(1, "a number of tokens"),
                        required=True, metavar="N")
    parser.add_argument("--one-device", action="store_true",
                        help="gather the parameters onto one device instead of the mesh")
    parser.add_argument("--no-cache", action="store_true",
                        help="recompute the whole prefix for every token (the reference)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="SECTION.KEY=VALUE", help="override a config value (repeatable)")
    return parser


class Tokenizer:
    """The data set's tokenizer: bytes (ids are UTF-8 bytes) or a Hugging Face tokenizer.json."""

    def __init__(self, path: Any | None) -> None:
        self.hf = None
        if path is not None:
            from tokenizers import Tokenizer as HfTokenizer

            self.hf = HfTokenizer.from_str(path.read_text())

    def encode(self, text: str) -> list[int]:
        if self.hf is None:
            return list(text.encode("utf-8"))
        return self.hf.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        if self.hf is None:
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        return self.hf.decode(ids)


def _tokenizer_of(args: argparse.Namespace, config: Any) -> Tokenizer | None:
    """The tokenizer of the source: None when it is not known (a weights directory without
    one, whose model's vocabulary is not bytes)."""
    from etils import epath

    from .hf.convert import COMPANION_DIR, data_tokenizer

    if args.run_dir:
        path = data_tokenizer(args.run_dir, config)
        if path is not None:
            return Tokenizer(path)
        return Tokenizer(None) if config.model.vocab_size >= 256 else None
    path = epath.Path(args.init_from) / COMPANION_DIR / "tokenizer.json"
    if path.exists():
        return Tokenizer(path)
    return Tokenizer(None) if config.model.vocab_size == 256 else None


def load_model(config: Any, source: str, step: int | None, one_device: bool) -> Any:
    """The model with the parameters of `source`, sharded over the training mesh (or not)."""
    import jax
    from flax import nnx

    from .hf.weights import abstract_params, open_params, with_params
    from .mesh import build_mesh, current_topology
    from .model.checks import resolve
    from .model.registry import build_model
    from .sharding import tree_shardings

    params_at = open_params(source, step)
    params_at.check_shapes(config.model, "give the --config these parameters were trained or "
                                         "converted with")
    abstract = abstract_params(config.model)
    if one_device:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: device, abstract)
    else:
        mesh = build_mesh(resolve(config, current_topology()))
        model = nnx.eval_shape(lambda: build_model(config.model, rngs=nnx.Rngs(params=0)))
        specs = nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(model)))
        shardings = tree_shardings(specs, mesh)
    target = jax.tree.map(lambda leaf, sharding: jax.ShapeDtypeStruct(
        leaf.shape, leaf.dtype, sharding=sharding), abstract, shardings)
    params = params_at.restore(target)
    return with_params(config.model, params)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.step is not None and not args.run_dir:
        parser.error("--step goes with --run-dir")
    from .config import ConfigError, load_config
    from .hf.weights import WeightsError
    from .model.decode import greedy_cached, greedy_uncached

    try:
        config = load_config(args.config, args.overrides)
        tokenizer = _tokenizer_of(args, config)
        if args.prompt is not None:
            if tokenizer is None:
                raise SampleError(f"--prompt: no tokenizer is known for {args.init_from} (no "
                                  "hf/tokenizer.json, and the vocabulary is not bytes); give "
                                  "--prompt-ids")
            prompt = tokenizer.encode(args.prompt)
        else:
            prompt = args.prompt_ids
        if not prompt:  # decoding needs one token to start from
            given = f"--prompt {args.prompt!r}" if args.prompt is not None else "--prompt-ids"
            raise SampleError(f"{given}: the prompt is empty (0 tokens); give at least one token")
        too_big = [i for i in prompt if i >= config.model.vocab_size]
        if too_big:
            raise SampleError(f"--prompt-ids: {too_big[0]} is not a token of this model "
                              f"(model.vocab_size = {config.model.vocab_size})")
        length = config.model.seq_len
        if len(prompt) + args.max_new_tokens > length:
            raise SampleError(f"the prompt ({len(prompt)} tokens) + --max-new-tokens "
                              f"({args.max_new_tokens}) exceed model.seq_len = {length}; "
                              "shorten one, or --set model.seq_len=N")
        model = load_model(config, args.init_from or args.run_dir, args.step, args.one_device)
        decode = greedy_uncached if args.no_cache else greedy_cached
        result = decode(model, prompt, args.max_new_tokens, length)
    except (SampleError, ConfigError, WeightsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if tokenizer is not None:
        print(tokenizer.decode(list(prompt) + result.ids), flush=True)
    print(f"{len(result.ids)} tokens, {result.tokens_per_s:.1f} tokens/s after the first "
          f"({'no cache' if args.no_cache else 'KV cache'}; prompt pass {result.prefill_s:.2f}s)",
          file=sys.stderr)
    print(json.dumps({"ids": result.ids}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

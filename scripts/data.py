"""`multislice data prepare`: the experiment's data preparation step from the toolkit's CLI.

A thin front over `python -m trainer.prepare` (the experiment owns the format), run inside the
experiment directory (`--experiment DIR`, or the default template rendered to a temp dir).
Without `--seq-len` the record length comes from the experiment's config (`--config NAME`,
model.seq_len), so the shards match the model that will read them. Relative paths are taken from
the directory you run this in. Arguments after `--` go to `trainer.prepare` unchanged. The trainer
reads the result with `--set data.path='DIR'` (a TOML string).
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

from scripts.argtypes import fraction, non_negative_int, positive_int, report_error

METADATA_FILE = "metadata.json"  # trainer.dataset.input_pipeline: written last, marks a data set complete

EXIT_USAGE = 2
DEFAULT_CONFIG = "default"  # the trainer's own default preset


class DataCommandError(ValueError):
    """A bad argument; the message says what was given and what is allowed."""


def config_path(experiment: Path, config: str) -> Path:
    """The .toml file `--config` names, resolved as the trainer does (preset name or path)."""
    if config.endswith(".toml"):
        path = Path(config).expanduser()
        path = path if path.is_absolute() else Path.cwd() / path
    else:
        path = experiment / "configs" / f"{config}.toml"
    if not path.is_file():
        presets = sorted(p.stem for p in (experiment / "configs").glob("*.toml"))
        raise DataCommandError(
            f"--config {config}: {path} does not exist; use a preset of the experiment "
            f"({', '.join(presets) or 'none found'}) or a path to a .toml file"
        )
    return path


def _model_seq_len(path: Path, config: str) -> object:
    try:
        return tomllib.loads(path.read_text(encoding="utf-8")).get("model", {}).get("seq_len")
    except tomllib.TOMLDecodeError as err:
        raise DataCommandError(f"--config {config}: {path} is not valid TOML ({err})") from None


def config_seq_len(experiment: Path, config: str) -> int:
    """model.seq_len of the preset, or of configs/base.toml that every preset is laid over."""
    path = config_path(experiment, config)
    value = _model_seq_len(path, config)
    base = experiment / "configs" / "base.toml"
    if value is None and base.is_file():
        value = _model_seq_len(base, config)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise DataCommandError(
            f"--config {config}: {path} has model.seq_len = {value!r}; expected an integer >= 1 "
            "(or pass --seq-len)"
        )
    return value


def local_path(text: str, flag: str) -> str:
    if text.startswith(("gs://", "gs:/")):
        raise DataCommandError(
            f"{flag} {text}: this input is read from local disk only; copy it here first"
        )
    return str(Path(text).expanduser().resolve())


def prepare_argv(args: argparse.Namespace, experiment: Path) -> list[str]:
    """The `python -m trainer.prepare` arguments, with every path made absolute."""
    seq_len = args.seq_len if args.seq_len is not None else config_seq_len(experiment, args.config)
    if seq_len < 1:
        raise DataCommandError(f"--seq-len {seq_len}: must be >= 1")
    output = args.output if args.output.startswith("gs://") else local_path(args.output,
                                                                             "--output")
    argv = ["--output", output, "--seq-len", str(seq_len)]
    if args.input:
        argv += ["--input", *(local_path(p, "--input") for p in args.input)]
    if args.tokenizer is not None:  # bytes, bpe, or a tokenizer file (made absolute)
        named = args.tokenizer in ("bytes", "bpe")
        argv += ["--tokenizer", args.tokenizer if named else local_path(args.tokenizer,
                                                                        "--tokenizer")]
    for flag, value in (("--num-shards", args.num_shards), ("--seed", args.seed),
                        ("--num-sentences", args.num_sentences),
                        ("--vocab-size", args.vocab_size),
                        ("--eval-fraction", args.eval_fraction)):
        if value is not None:
            argv += [flag, str(value)]
    if args.overwrite:
        if output.startswith("gs://"):
            raise DataCommandError(
                f"--overwrite {output}: a bucket path cannot be replaced atomically (the "
                "objects are uploaded one by one, and a run may be reading them); prepare into a "
                "new gs:// path and point data.path at it")
        argv.append("--overwrite")
    return argv + list(args.prepare_args)


def _bucket_fs(uri: str) -> tuple[object, str]:
    """(gcsfs filesystem, BUCKET/PATH) for gs://BUCKET/PATH, checked before anything runs."""
    bucket, _, path = uri.removeprefix("gs://").partition("/")
    if not bucket or not path.strip("/"):
        raise DataCommandError(f"--output {uri}: expected gs://BUCKET/PATH (a path in a bucket)")
    from scripts.gcs import StorageUnreachable, check_reachable, filesystem

    try:
        check_reachable(uri)
    except StorageUnreachable as err:
        raise DataCommandError(f"--output {err}") from None
    fs = filesystem()
    target = f"{bucket}/{path.strip('/')}"
    try:
        fs.ls(bucket, detail=False)
        complete = fs.exists(f"{target}/{METADATA_FILE}")
    except FileNotFoundError:
        raise DataCommandError(f"--output {uri}: bucket gs://{bucket} does not exist") from None
    except Exception as exc:  # noqa: BLE001 - auth, DNS, refused: the bucket cannot be used
        raise DataCommandError(f"--output {uri}: bucket gs://{bucket} is not reachable "
                               f"({type(exc).__name__}: {exc})") from None
    if complete:
        raise DataCommandError(f"--output {uri} already holds a prepared data set "
                               f"({METADATA_FILE}); choose another path (nothing was written)")
    return fs, target


def _prepare_into_bucket(argv: list[str], experiment: Path, uri: str) -> int:
    """Prepares into a local staging directory, then uploads it with metadata.json last: the
    trainer treats a data set as complete only once that object exists."""
    fs, target = _bucket_fs(uri)
    with tempfile.TemporaryDirectory(prefix="multislice-data-") as staging:
        local = str(Path(staging) / "data")
        argv = [*argv]
        argv[argv.index("--output") + 1] = local
        print(f"[multislice] in {experiment}: {' '.join(argv[1:])} (then upload to {uri})",
              file=sys.stderr, flush=True)
        code = subprocess.run(argv, cwd=experiment, check=False).returncode
        if code != 0:
            return code
        names = sorted(os.listdir(local), key=lambda name: (name == METADATA_FILE, name))
        for name in names:
            fs.put_file(os.path.join(local, name), f"{target}/{name}")
        print(f"[multislice] uploaded {len(names)} files to {uri}; train on it with: "
              f"--set data.path='{uri}'", file=sys.stderr)
    return 0


def run_prepare(args: argparse.Namespace) -> int:
    from scripts.argtypes import UsageError
    from scripts.new import experiment_dir

    try:
        with experiment_dir(args.experiment) as experiment:
            if not (experiment / "trainer" / "prepare.py").is_file():
                raise DataCommandError(
                    f"--experiment {args.experiment}: {experiment} has no trainer/dataset/prepare.py; "
                    "expected an experiment rendered from this toolkit's template"
                )
            flags = prepare_argv(args, experiment)
            own = flags[:len(flags) - len(args.prepare_args)]
            extra = ["--", *args.prepare_args] if args.prepare_args else []
            # recorded in metadata.json, so that hints name the command the user runs
            command = shlex.join(["multislice", "data", "prepare", "--experiment",
                                  str(experiment), *own, *extra])
            argv = [sys.executable, "-m", "trainer.prepare", *flags, "--command", command]
            output = argv[argv.index("--output") + 1]
            if output.startswith("gs://"):
                return _prepare_into_bucket(argv, experiment, output)
            print(f"[multislice] in {experiment}: {' '.join(argv[1:])}", file=sys.stderr,
                  flush=True)
            code = subprocess.run(argv, cwd=experiment, check=False).returncode
            if code == 0:
                print(f"[multislice] train on it with: --set data.path='{output}'",
                      file=sys.stderr)
            return code
    except (DataCommandError, UsageError) as err:
        report_error("data prepare", err)
        return EXIT_USAGE


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("data", help="prepare training data for an experiment",
                                   description="Prepare training data for an experiment.")
    commands = parser.add_subparsers(dest="data_command", metavar="SUBCOMMAND", required=True)
    prepare = commands.add_parser(
        "prepare",
        help="text files (or the synthetic corpus) -> ArrayRecord shards",
        description="Turn text files (or the built-in synthetic corpus) into the ArrayRecord "
        "shards the trainer reads. The experiment's own preparation code does the work, inside "
        "the experiment directory, so the format is always the one its trainer expects. Without "
        "--seq-len the record length is the config's model.seq_len. Arguments after -- go to the "
        "experiment's preparation step unchanged. Train on the result with --set "
        "data.path='DIR'.",
    )
    prepare.add_argument("--output", required=True, metavar="DIR",
                         help="directory for the shards: a local path, or gs://BUCKET/PATH "
                              "(prepared locally, then uploaded with metadata.json last)")
    prepare.add_argument("--experiment", type=Path, default=None, metavar="DIR",
                         help="rendered experiment directory (default: the template)")
    prepare.add_argument("--config", default=DEFAULT_CONFIG, metavar="NAME",
                         help="config whose model.seq_len sets the record length "
                              f"(default {DEFAULT_CONFIG})")
    prepare.add_argument("--input", nargs="+", default=None, metavar="FILE",
                         help="text files, one document each (default: the synthetic corpus)")
    prepare.add_argument("--seq-len", type=positive_int, default=None,
                         help="overrides the config's")
    prepare.add_argument("--tokenizer", default=None, metavar="bytes|bpe|FILE",
                         help="bytes (default), a BPE trained here on the input, or an existing "
                              "tokenizer.json")
    prepare.add_argument("--vocab-size", type=positive_int, default=None,
                         help="vocabulary of the BPE trained with --tokenizer bpe")
    prepare.add_argument("--eval-fraction", type=fraction(allow_zero=True, allow_one=False),
                         default=None,
                         help="share of records held out for evaluation (default 0.05)")
    prepare.add_argument("--num-shards", type=positive_int, default=None)
    prepare.add_argument("--seed", type=non_negative_int, default=None,
                         help="random seed of the synthetic corpus")
    prepare.add_argument("--num-sentences", type=positive_int, default=None,
                         help="size of the synthetic corpus")
    prepare.add_argument("--overwrite", action="store_true",
                         help="replace a non-empty local --output (prepared beside it, then "
                              "swapped in); without it a non-empty --output is refused")
    prepare.add_argument("prepare_args", nargs="*", metavar="-- PREPARE_ARGS",
                         help="extra arguments for the experiment's data preparation "
                              "(python -m trainer.prepare)")
    prepare.set_defaults(func=run_prepare, passthrough="prepare_args")


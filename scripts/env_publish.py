"""`multislice env-publish`: the environment of a stack's lock built before any host boots, on a
machine that reaches the package index, and published to the stack's bucket, so that hosts with no
public internet (`multislice:egress: none`) never need PyPI or GitHub. The build and the upload
are infra/packaging/env_build.py's, which `pulumi up` runs too where the deployer's machine qualifies.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from infra.packaging.env_build import (
    Index,
    build_and_publish,
    env_key,
    machine_problem,
    published,
)
from infra.packaging.lock import LOCK_FILE
from scripts.argtypes import UsageError

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "env-publish", help="build the experiment's environment here and publish it to the "
        "stack's bucket (for hosts with no public internet)",
        description="Build the environment of the stack's experiment lock exactly as a TPU "
        "host or GKE pod builds it (the same key, CPython and hash-checked install), on this "
        "Linux x86_64 machine with access to the package index, and publish it to "
        "gs://BUCKET/envs/, where every host looks first. Needed before the first boot of a "
        "stack with multislice:egress: none. Exit 0 (published, or already there), 1 (the "
        "build or upload failed), 2 (bad arguments or stack).")
    parser.add_argument("--stack-config", type=Path, required=True, metavar="Pulumi.<stack>.yaml")
    parser.add_argument("--force", action="store_true",
                        help="build and publish even when the bucket has it already")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from scripts.local.from_stack import load_stack

    say = lambda line: print(f"multislice env-publish: {line}", file=sys.stderr)  # noqa: E731
    try:
        cfg, experiment = load_stack(args.stack_config, check_files=False)
        lock = experiment / LOCK_FILE
        if not lock.is_file():
            raise UsageError(f"{lock}: no lock; run `multislice lock` in the experiment first")
        key = env_key(lock)
        if key is None:
            raise UsageError(f"{lock}: no `multislice lock` header naming its interpreter; "
                             "remake it with `multislice lock`")
        interpreter = key.split("-cpython", 1)[1].rsplit("-", 1)[0]
    except UsageError as exc:
        say(str(exc))
        return EXIT_USAGE
    problem = machine_problem()
    if problem is not None:
        say(problem)
        return EXIT_USAGE
    try:
        from google.cloud import storage

        from infra.preview.env_check import stack_index  # imports pulumi: not at --help
        from scripts.gcs import check_reachable

        check_reachable(f"gs://{cfg.names.bucket}/envs/")
        bucket = storage.Client(project=cfg.project).bucket(cfg.names.bucket)
        there = published(bucket, key)
        if there is not None and not args.force:
            print(f"gs://{cfg.names.bucket}/{there} is published already (environment {key}); "
                  "nothing to do (--force builds it again)")
            return EXIT_OK
        print(f"building environment {key} (CPython {interpreter}, {lock.name} with "
              "--require-hashes) as a host would ...", flush=True)
        index = stack_index(cfg.package_index.url, cfg.package_index.python_mirror) \
            if cfg.package_index else Index()
        done = build_and_publish(bucket, lock, key, interpreter,
                                 Path.cwd() / f"env-publish-{key[:12]}.log", index)
        print(f"built in {done.build_s:.0f}s: {done.size_mib:.0f} MiB; published {done.uri} in "
              f"{done.upload_s:.0f}s; every host of the stack installs it without PyPI or "
              "GitHub", flush=True)
        return EXIT_OK
    except RuntimeError as exc:
        say(f"the build failed: {exc}")
        return EXIT_FAILED
    except Exception as exc:  # no credentials, no bucket, a refused upload: one line
        first = (str(exc).splitlines() or [""])[0][:300]
        say(f"cannot publish to gs://{cfg.names.bucket}/envs/: {type(exc).__name__}: {first}")
        return EXIT_FAILED

"""Every command block of the toolkit's README.md and infra/README.md runs as typed from the
repository root, or says in the block's marker why it cannot run here (the experiment's README
has its own test: tests/template/test_readme_commands.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.template.test_readme_commands import bash_blocks

ROOT = Path(__file__).resolve().parents[1]
READMES = ("README.md", "infra/README.md")


def test_every_toolkit_readme_block_runs_or_says_why_not():
    for name in READMES:
        text = (ROOT / name).read_text()
        blocks = bash_blocks(text)
        assert all(why for _, why in blocks if why is not None), name
        assert text.count("readme-test: skip") == sum(why is not None for _, why in blocks), name
    assert any(why is None for name in READMES
               for _, why in bash_blocks((ROOT / name).read_text()))


@pytest.mark.slow  # 16 s: every README command in a fresh copy (the quick tier stays under 3 min)
def test_the_readme_blocks_run_as_written_from_a_fresh_checkout(tmp_path):
    # The repository's own entries, linked into a scratch directory: the blocks run from "the
    # repository root" as typed, and what they write (seed.json) stays out of the checkout.
    for entry in ROOT.iterdir():
        if entry.name != ".git":
            (tmp_path / entry.name).symlink_to(entry)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MULTISLICE_", "STORAGE_EMULATOR", "TENSORSTORE_", "VIRTUAL_ENV"))}
    ran = 0
    for name in READMES:
        for block, skipped in bash_blocks((ROOT / name).read_text()):
            if skipped:
                continue
            # Its own session: what the block leaves running in the background (the emulators,
            # as in a user's shell) is stopped with it. Output to a file, not a pipe: those
            # background processes hold it open after the block ends.
            log = tmp_path / f"block-{ran}.log"
            with log.open("w") as out_file:
                proc = subprocess.Popen(["bash", "-euo", "pipefail", "-c", block],
                                        cwd=tmp_path, env=env, stdout=out_file,
                                        stderr=subprocess.STDOUT, start_new_session=True)
                try:
                    proc.wait(timeout=300)
                finally:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGTERM)
            out = log.read_text()
            assert proc.returncode == 0, f"{name}:\n{block}\n--- exit {proc.returncode}\n" \
                f"{out[-4000:]}"
            assert "Traceback" not in out, out[-4000:]
            ran += 1
    assert ran >= 1

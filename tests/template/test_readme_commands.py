"""Every command of the experiment README, run exactly as written, from the directory it says
("From this directory"), so a README that drifts from the code fails here. A block preceded by
`<!-- readme-test: skip (why) -->` is not run (installs, TPU-sized runs, the suite itself)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.new import render_template

SKIP = re.compile(r"<!-- readme-test: skip \((.+?)\) -->\s*$")


def bash_blocks(readme: str) -> list[tuple[str, str | None]]:
    """[(the block's text, why it is skipped or None)] of every ```bash block, in order."""
    blocks, lines = [], readme.splitlines()
    for i, line in enumerate(lines):
        if line.strip() != "```bash":
            continue
        end = lines.index("```", i + 1)
        before = next((x for x in reversed(lines[:i]) if x.strip()), "")
        skip = SKIP.search(before)
        blocks.append(("\n".join(lines[i + 1:end]), skip.group(1) if skip else None))
    return blocks


def test_every_block_is_found_and_every_skip_says_why():
    text = (Path(__file__).parents[2] / "template" / "{{cookiecutter.project_slug}}"
            / "README.md").read_text()
    blocks = bash_blocks(text)
    assert len(blocks) >= 8 and all(why for _, why in blocks if why is not None)
    assert text.count("readme-test: skip") == sum(why is not None for _, why in blocks)


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_the_experiment_readme_runs_as_written(tmp_path):
    project = render_template("readme-model", tmp_path)
    bin_dir = tmp_path / "bin"  # `python` is this toolkit's interpreter, with the template's deps
    bin_dir.mkdir()
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (bin_dir / "python").chmod(0o755)
    # XLA_FLAGS stays as tests/conftest.py sets it (one device, optimization level 0, as the
    # rest of the suite compiles); a block that sets XLA_FLAGS itself replaces it, as in a shell.
    env = {k: v for k, v in os.environ.items() if not k.startswith("MULTISLICE_")}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", JAX_PLATFORMS="cpu")
    ran = 0
    for block, skipped in bash_blocks((project / "README.md").read_text()):
        if skipped:
            continue
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=project, env=env,
                              capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, f"{block}\n--- exit {done.returncode}\n" \
            f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        assert "Traceback" not in done.stderr, f"{block}\n{done.stderr[-3000:]}"
        ran += 1
    assert ran >= 6
    # What the blocks promise, where they said (relative to this directory).
    for run in ("tiny", "tp", "two-slices", "ft"):
        summary = json.loads((project / "runs" / run / "summary.json").read_text())
        assert summary["final_step"] in (20, 60), (run, summary)
    assert (project / "configs" / "my-llama.toml").is_file()
    assert json.loads((project / "hf-ft" / "config.json").read_text())["architectures"] == [
        "LlamaForCausalLM"]

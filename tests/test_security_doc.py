"""docs/SECURITY.md holds each claim by a test: every test it names exists where it says."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "SECURITY.md"


def named_tests(text: str) -> list[tuple[str, str]]:
    """(file, test) for each `path::test` in the text; `::test` alone is in the last path."""
    found, last = [], None
    for path, name in re.findall(r"`((?:tests/[\w/]+\.py)?)::(test_\w+)`", text):
        last = path or last
        assert last is not None, f"::{name} names no file before it"
        found.append((last, name))
    return found


def test_every_test_the_threat_model_cites_exists_in_the_file_it_names():
    cited = named_tests(DOC.read_text())
    assert len(cited) >= 25, cited
    missing = [f"{path}::{name}" for path, name in cited
               if not re.search(rf"^def {name}\(", (ROOT / path).read_text(), re.M)]
    assert missing == []

"""The suite's own settings (tests/conftest.py): its workers and its persistent compile cache."""

from __future__ import annotations

import os
from importlib import metadata

from tests.conftest import COMPILE_CACHE, suite_workers
from tests.support.compile_cache import suite_compile_cache


def test_workers_are_one_and_a_half_a_core_bounded_by_memory():
    assert suite_workers(cores=2, memory_gib=24) == 3  # the machines this runs on
    assert suite_workers(cores=1, memory_gib=8) == 2
    assert suite_workers(cores=16, memory_gib=64) == 16  # 4 GiB a worker
    assert suite_workers(cores=4, memory_gib=3) == 1  # never none


def test_the_compile_cache_lives_under_xdg_cache_home_keyed_by_jax_and_jaxlib(tmp_path,
                                                                              monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = suite_compile_cache()
    versions = f"jax-{metadata.version('jax')}-jaxlib-{metadata.version('jaxlib')}"
    assert path == tmp_path / "multislice" / "jax-cache" / versions and path.is_dir()
    monkeypatch.setenv("XDG_CACHE_HOME", "")  # empty is unset (XDG base directory spec)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert suite_compile_cache() == tmp_path / "home" / ".cache" / "multislice" / "jax-cache" \
        / versions


def test_an_unusable_xdg_cache_home_falls_back_instead_of_breaking_the_suite(tmp_path,
                                                                           monkeypatch, capsys):
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "a-file"))  # mkdir under a file fails
    path = suite_compile_cache()
    assert path.is_dir() and "multislice-jax-cache-" in str(path)
    assert "cannot be made" in capsys.readouterr().err
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")  # invalid by the XDG spec: ignored
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert str(suite_compile_cache()).startswith(str(tmp_path / "home" / ".cache"))


def test_every_process_of_the_suite_is_pointed_at_the_persistent_cache():
    import jax

    # A test of RUN_DIR/compile_cache may unset it for itself; none leaks it to the next.
    assert os.environ["JAX_COMPILATION_CACHE_DIR"] == str(COMPILE_CACHE)
    assert os.environ["MULTISLICE_EMULATED_JAX_CACHE"] == str(COMPILE_CACHE)
    assert jax.config.jax_compilation_cache_dir == str(COMPILE_CACHE)
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0
    assert jax.config.jax_persistent_cache_min_entry_size_bytes == -1

"""Test-only hook: hold a trainer process's checkpoint commits, so a test can kill it mid-save
(and, with TRAINER_TEST_HOLD_LOCAL=DIR, its local tier's commits and reads: see hold_local);
with TRAINER_TEST_VARIANTS=toy_moe (or toy_local_global, or both, comma-separated), load the model
variants the tests define (tests/toy_moe.py, tests/toy_local_global.py).

Nothing here is part of the trainer. A test that wants it puts this directory first on the
child's PYTHONPATH (Python imports `sitecustomize` at startup) and sets
TRAINER_TEST_HOLD_COMMIT=DIR. Once `trainer.runtime.checkpoint` is imported, the K-th data-iterator
write of the process (K = 1, 2, ...) creates DIR/commit-waiting-K and waits until
DIR/commit-release-K exists; the write happens inside the background commit, so save K is in
flight while it waits.
"""

import importlib.abc
import importlib.machinery
import itertools
import os
import sys
import time

HOLD_COMMIT_ENV = "TRAINER_TEST_HOLD_COMMIT"
HOOKS_DIR = os.path.dirname(os.path.abspath(__file__))


class _HeldPath:
    """A path whose write_text first waits for the test's release file."""

    def __init__(self, path, wait):
        self._path, self._wait = path, wait

    def __getattr__(self, name):
        return getattr(self._path, name)

    def __fspath__(self):
        return os.fspath(self._path)

    def write_text(self, *args, **kwargs):
        self._wait()
        return self._path.write_text(*args, **kwargs)


def _waiter(hold_dir, waiting, release):
    """A function whose K-th call (K = 1, 2, ...) in this process creates DIR/`waiting` and
    waits until DIR/`release` exists (both formatted with k=K and pid=this process's id)."""
    counter = itertools.count(1)

    def wait():
        k = next(counter)
        with open(os.path.join(hold_dir, waiting.format(k=k, pid=os.getpid())), "w") as out:
            out.write(str(os.getpid()))
        while not os.path.exists(os.path.join(hold_dir, release.format(k=k, pid=os.getpid()))):
            time.sleep(0.01)

    return wait


def hold_commits(module, hold_dir):
    """Patch `module` (trainer.runtime.checkpoint) so each state-file write waits its turn."""
    wait = _waiter(hold_dir, "commit-waiting-{k}", "commit-release-{k}")
    state_file = module._state_file
    module._state_file = lambda *args: _HeldPath(state_file(*args), wait)


HOLD_LOCAL_ENV = "TRAINER_TEST_HOLD_LOCAL"


class _OsThatWaitsToRename:
    def __init__(self, wait):
        self._wait = wait

    def __getattr__(self, name):
        return getattr(os, name)

    def rename(self, src, dst):
        if os.path.basename(os.fspath(src)).startswith("tmp-step_"):
            self._wait()
        return os.rename(src, dst)


def hold_local(module, hold_dir):
    """Patch `module` (trainer.runtime.local_tier): each part's commit (the rename of its
    written directory) and each read of a part wait their turn, so a test can kill a process
    in the middle of a local save or of a restore."""
    module.os = _OsThatWaitsToRename(
        _waiter(hold_dir, "local-write-waiting-{k}-{pid}", "local-write-release-{k}"))
    read = module.LocalTier.read
    wait_read = _waiter(hold_dir, "local-read-waiting-{k}-{pid}", "local-read-release-{k}")

    def held_read(self, step):
        wait_read()
        return read(self, step)

    module.LocalTier.read = held_read


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def __init__(self, patches):
        self.patches = dict(patches)  # module name -> function(module)

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.patches:
            return None
        patch = self.patches.pop(fullname)
        if not self.patches:
            sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


VARIANTS_ENV = "TRAINER_TEST_VARIANTS"


def load_test_variants(names):
    """Import tests/NAME.py for each name (a model variant the tests define: it registers
    itself) once trainer.config exists, and call its declare() (its mesh axis and rules)."""
    import importlib.util

    for name in names.split(","):
        path = os.path.join(HOOKS_DIR, os.pardir, f"{name}.py")
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        module.declare()


_patches = {}
if os.environ.get(VARIANTS_ENV):
    _patches["trainer.config"] = lambda m: load_test_variants(os.environ[VARIANTS_ENV])
if os.environ.get(HOLD_COMMIT_ENV):
    _patches["trainer.runtime.checkpoint"] = lambda m: hold_commits(m, os.environ[HOLD_COMMIT_ENV])
if os.environ.get(HOLD_LOCAL_ENV):
    _patches["trainer.runtime.local_tier"] = lambda m: hold_local(m, os.environ[HOLD_LOCAL_ENV])
if _patches:
    sys.meta_path.insert(0, _PatchOnImport(_patches))

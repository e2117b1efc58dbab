"""The module names dynamic providers had in Pulumi state before they moved.

Pulumi pickles each dynamic resource's provider into the stack's state by module and class name,
and `pulumi destroy` and `refresh` unpickle the one in state, not the program's: a stack whose
resources were created before a move names the old module until they are next updated. Importing
`infra` installs a finder that answers each old name with the module that now holds its classes
(the same class objects, so `isinstance` holds). Nothing in the project imports an old name.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

# old module name in state -> the module that holds its provider now
MOVED_PROVIDERS = {
    "infra.tpu_provider": "infra.tpu_vm.provider",        # before infra/ had packages (60f5df6)
    "infra.run_check": "infra.preview.run_check",          # before infra/ was split by concern
    "infra.env_check": "infra.preview.env_check",
    "infra.network_check": "infra.preview.network_check",
}


class _MovedModuleLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None  # the default: a fresh module named after the old name

    def exec_module(self, module: ModuleType) -> None:
        current = importlib.import_module(MOVED_PROVIDERS[module.__name__])
        module.__dict__.update({k: v for k, v in vars(current).items() if not k.startswith("__")})
        module.__doc__ = f"moved to {current.__name__} (infra/state_names.py)"


class _MovedModuleFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: object = None, target: object = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED_PROVIDERS:
            return None
        return importlib.machinery.ModuleSpec(fullname, _MovedModuleLoader())


def install() -> None:
    """Answer the old names (once per interpreter; after every real module, so none is shadowed)."""
    if not any(isinstance(finder, _MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(_MovedModuleFinder())

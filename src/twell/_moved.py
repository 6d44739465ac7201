"""Old import paths of modules that moved, kept working.

``import twell.dispatch`` (or any path on the left below, and ``twell.train.<module>``) gives the
module at its new path, the very same module object, with a ``DeprecationWarning`` that names
the new path. Pickles and checkpoints that recorded an old path load the same way.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings

# old path -> new path
MOVED = {
    "twell.ops": "twell.inference.ops",
    "twell.dispatch": "twell.inference.dispatch",
    "twell.eager_graphs": "twell.inference.eager_graphs",
    "twell.path_timing": "twell.inference.path_timing",
    "twell.library": "twell.inference.custom_op",
    "twell.train_ops": "twell.training.ops",
    "twell.train_path": "twell.training.path",
    "twell.train": "twell.recipe",
    "twell.data_cli": "twell.recipe.data_cli",
}


def new_path(name: str):
    """The current path of module ``name`` if it moved, else ``None``."""
    if name in MOVED:
        return MOVED[name]
    head, _, tail = name.rpartition(".")
    while head:
        if head in MOVED:
            return f"{MOVED[head]}.{name[len(head) + 1:]}"
        head, _, _ = head.rpartition(".")
    return None


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith("twell.") or new_path(fullname) is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=fullname in ("twell.train",))

    def create_module(self, spec):
        new = new_path(spec.name)
        warnings.warn(f"{spec.name} moved to {new}; import it from there", DeprecationWarning, stacklevel=3)
        return importlib.import_module(new)

    def exec_module(self, module):
        pass  # the module at the new path is already executed


def install() -> None:
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.insert(0, _Alias())  # before the path finder, which would load a second copy

"""twell: sparse feed-forward blocks for transformer language models.

ReLU-gated FFNs trained with an L1 penalty keep a few dozen of thousands of hidden units
active per token; twell stores those activations in sparse formats (TwELL for inference, a
hybrid ELL + dense backup for training) and runs the FFN from them.

The names below load their module (and torch) on first use, so that the ``twell`` command
answers ``--help`` and argument errors without waiting for torch to import.
"""

import importlib
import importlib.util

from . import _moved

__version__ = "0.1.0"
_moved.install()  # old module paths (twell.dispatch, twell.train, ...) keep importing

# public name -> the submodule that defines it
_EXPORTS = {
    "TwELL": "format",
    "Hybrid": "format",
    "pack_twell": "format",
    "unpack_twell": "format",
    "pack_hybrid": "format",
    "unpack_hybrid": "format",
    "SparseGatedMLP": "nn",
    "SparseMLP": "nn",
    "SparsityStats": "nn",
    "l1_loss": "nn",
    "sparse_modules": "nn",
    "use_kernel_layout": "nn",
    "sparsify": "hf",
    "sparse_gated_ffn": "training.ops",
    "sparse_ffn": "training.ops",
    "dense_gated_ffn": "training.ops",
    "dense_ffn": "training.ops",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value  # later lookups skip this function
        return value
    if name.isidentifier() and not name.startswith("_"):
        # a submodule (twell.inference.eager_graphs, twell.inference.dispatch, ...): loaded on first use, as the names above
        try:
            if importlib.util.find_spec(f"{__name__}.{name}") is not None:
                return importlib.import_module(f".{name}", __name__)
        except ImportError as err:  # a dependency missing: hasattr() must still say False
            raise AttributeError(f"module 'twell' has no attribute {name!r} ({err})") from None
    raise AttributeError(f"module 'twell' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)

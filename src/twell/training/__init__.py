"""The sparse training FFN: autograd functions over the hybrid format and the fused dense path
(:mod:`.ops`), and each layer's choice between them (:mod:`.path`).

Submodules load on first use (``twell.training.ops``), as ``twell``'s own names do.
"""

import importlib


def __getattr__(name: str):
    if name in ("ops", "path"):
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""The inference runtime: functional ops over the kernels (:mod:`.ops`), each layer's choice of
path (:mod:`.dispatch`: decode, split, fused, prefill or dense), small eager calls replayed from
CUDA graphs (:mod:`.eager_graphs`), the opt-in timing of prefill against dense
(:mod:`.path_timing`) and the custom op that torch.compile sees (:mod:`.custom_op`).

Submodules load on first use (``twell.inference.dispatch``), as ``twell``'s own names do.
"""

import importlib


def __getattr__(name: str):
    if name in ("ops", "dispatch", "eager_graphs", "path_timing", "custom_op"):
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""The live FP8 inference modules by their gate rows, for the custom op ``twell::ffn_fp8``.

The op (:func:`twell.inference.fp8_ops.ffn_fp8`) is given tensors only; it finds the
:class:`twell.fp8_nn.Fp8SparseGatedMLP` that owns them here, by the address of its ``gate_q``
buffer, and makes that module's per-call choice. Modules register themselves when made, moved,
loaded or unpickled, and whenever their gate rows are replaced; the table holds them weakly.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch

__all__ = ["register", "module_of_gate"]

_BY_GATE: "weakref.WeakValueDictionary[int, torch.nn.Module]" = weakref.WeakValueDictionary()


def register(module: torch.nn.Module) -> None:
    """Note ``module`` (with a ``gate_q`` buffer) as the owner of its gate rows."""
    _BY_GATE[module.gate_q.data_ptr()] = module


def module_of_gate(gate_q: torch.Tensor) -> Optional[torch.nn.Module]:
    """The live module whose ``gate_q`` buffer is ``gate_q`` (the same storage), or None."""
    m = _BY_GATE.get(gate_q.data_ptr())
    return m if m is not None and m.gate_q.data_ptr() == gate_q.data_ptr() and gate_q.data_ptr() != 0 else None

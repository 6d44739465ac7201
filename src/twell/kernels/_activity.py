"""Which gate values fire, and ReLU itself: the one activity test every kernel uses.

A unit is active where ``relu(a)`` is not zero. That is ``a > 0``, and also ``a`` NaN: PyTorch's
ReLU passes a NaN on, so the dense MLP turns a NaN gate into a NaN hidden value and a NaN output
row. A kernel that tested ``a > 0`` would skip the unit and return a finite row instead.

Written as ``not (a <= 0)`` (an unordered "greater than"): one comparison, as cheap as ``a > 0``
in the instruction-bound pack pass. Compared in fp32 because the Triton interpreter compares
bf16 as its raw bits (every negative value would count as positive there).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def fires(a):
    """``[...] bool``: ``relu(a) != 0``, i.e. ``a > 0`` or ``a`` NaN. Zero and -0 do not fire."""
    return ~(a.to(tl.float32) <= 0)


@triton.jit
def relu(a):
    """``relu(a)`` as ``torch.relu`` gives it: ``a`` where it fires (positive, or NaN: a NaN
    stays NaN, where ``max(a, 0)`` would drop it), else 0."""
    return tl.where(fires(a), a, 0.0)

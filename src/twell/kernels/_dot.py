"""The precision of the kernels' ``tl.dot`` calls, and their operands for it.

``"ieee"``: products in fp32 without TF32, the operands cast to fp32 first. fp32 inputs take it
on the GPU (as ``torch.mm`` computes them by default; the cast is then no cast), and every input
under the Triton interpreter, whose ``tl.dot`` reads bf16 operands as their raw bits (Triton 3.9:
a bf16 ``[16, 16]`` product off by 1e10). The product of two bf16 or fp16 values is exact in fp32,
so the result is what the tensor cores give. ``"tf32"``: fp16/bf16 inputs on the GPU, unchanged
(the branch below is resolved at compile time: their machine code is the same as before).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..checks import triton_interpreting


def dot_precision(x: torch.Tensor) -> str:
    """``PREC`` of a launch on ``x``'s dtype: "ieee" for fp32, or under the interpreter; else "tf32"."""
    return "ieee" if x.dtype == torch.float32 or triton_interpreting() else "tf32"


@triton.jit
def dot_operand(a, PREC: tl.constexpr):
    """``a`` as ``tl.dot(..., input_precision=PREC)`` should take it: fp32 for "ieee"."""
    if PREC == "ieee":
        a = a.to(tl.float32)
    return a

"""``u <- relu(g) * u`` in one pass: the gated product of the dense inference branch.

PyTorch runs ``torch.relu(g) * u`` as two passes over ``[M, f]`` (relu writes a new tensor, the
product reads it back): 5 reads and writes of an ``[M, f]`` tensor, against 3 here (read g and
u, write u). At M = 131072, f = 5632, bf16 that is 3 GB less traffic, about 0.7 ms of a 14 ms
dense MLP on the H200. The result is bit-identical: the product of two bf16 (or fp16) numbers
is exact in fp32, and both round it once to the storage type.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..checks import check_tensor, triton_interpreting
from ._activity import relu
from ._launch import on_device_of

__all__ = ["relu_mul_"]


@triton.jit
def _relu_mul_kernel(u_ptr, g_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    h = relu(g) * u  # a NaN gate stays NaN, as torch.relu keeps it
    tl.store(u_ptr + offs, h.to(u_ptr.dtype.element_ty), mask=mask)


def relu_mul_(u: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """In place ``u <- relu(g) * u``; returns ``u``.

    Args:
        u: ``[..., f]`` contiguous (the up projection), overwritten with the hidden.
        g: same shape, dtype and device, contiguous (the gate pre-activation).
    """
    check_tensor(u, "u", dtypes=(torch.float16, torch.bfloat16, torch.float32))
    check_tensor(g, "g", dtypes=(torch.float16, torch.bfloat16, torch.float32))
    if g.shape != u.shape or g.dtype != u.dtype or g.device != u.device:
        raise ValueError(f"g ({list(g.shape)}, {g.dtype}, {g.device}) must match u ({list(u.shape)}, {u.dtype}, {u.device})")
    if not (u.is_contiguous() and g.is_contiguous()):
        raise ValueError("u and g must be contiguous")
    if not (u.is_cuda or triton_interpreting()):
        return u.mul_(torch.relu(g))
    n = u.numel()
    if n:
        BLOCK = 4096
        with on_device_of(u):
            _relu_mul_kernel[(triton.cdiv(n, BLOCK),)](u, g, n, BLOCK=BLOCK, num_warps=8)
    return u

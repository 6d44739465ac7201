"""``h = relu(x w_gate^T) * (x w_up^T)`` in one kernel: the gated hidden of the dense branch.

The dense branch of the gated module runs two cuBLAS products (gate and up, ``[M, f]`` each) and
one pass ``relu(g) * u`` (:mod:`.elementwise`). Here one Triton matmul keeps two accumulators
per tile, one for each weight, and writes only ``h``: one launch instead of three, the tokens'
rows read once for both products, nothing ``[M, f]``-sized but ``h`` written. Between 65 and a
few hundred tokens the products are short and bound by the 46 MB of weights they read, where
the launches' fill and drain cost most.

Rounding follows the dense path: each product is accumulated in fp32 and rounded to the inputs'
dtype, then ``relu(g) * u`` is computed in fp32 and rounded once (a NaN gate stays NaN, as
``torch.relu`` keeps it). Only the order of the fp32 sums differs from cuBLAS's.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from ..checks import check_tensor, triton_interpreting
from ._launch import on_device_of

__all__ = ["gate_up", "GateUpConfig", "GATE_UP_CONFIG"]


class GateUpConfig(NamedTuple):
    """Tiles of ``BM`` tokens x ``BN`` units, steps of ``BK`` columns of d, warps and stages."""

    BM: int
    BN: int
    BK: int
    num_warps: int
    num_stages: int


GATE_UP_CONFIG = GateUpConfig(64, 128, 64, 4, 4)


@triton.jit
def _gate_up_kernel(x_ptr, wg_ptr, wu_ptr, h_ptr, M, f, d, stride_xm, stride_wg, stride_wu, stride_hm,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr):
    # program order: the token tiles of one block of units side by side, so that the block's
    # weight rows come from HBM once and from L2 for the other token tiles
    pid = tl.program_id(0)
    n_m = tl.cdiv(M, BM)
    pid_m = pid % n_m
    pid_n = pid // n_m
    rows = pid_m * BM + tl.arange(0, BM)
    units = pid_n * BN + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    rmask = rows < M
    umask = units < f
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + ks[None, :]
    g_ptrs = wg_ptr + units.to(tl.int64)[None, :] * stride_wg + ks[:, None]  # [BK, BN]: w_gate^T
    u_ptrs = wu_ptr + units.to(tl.int64)[None, :] * stride_wu + ks[:, None]
    acc_g = tl.zeros([BM, BN], dtype=tl.float32)
    acc_u = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, d, BK):
        kmask = (k0 + ks) < d
        xa = tl.load(x_ptrs, mask=rmask[:, None] & kmask[None, :], other=0.0)
        wg = tl.load(g_ptrs, mask=kmask[:, None] & umask[None, :], other=0.0)
        wu = tl.load(u_ptrs, mask=kmask[:, None] & umask[None, :], other=0.0)
        acc_g = tl.dot(xa, wg, acc_g, input_precision=PREC)
        acc_u = tl.dot(xa, wu, acc_u, input_precision=PREC)
        x_ptrs += BK
        g_ptrs += BK
        u_ptrs += BK
    # each product rounded to the storage type, as the two separate products are
    a = acc_g.to(h_ptr.dtype.element_ty).to(tl.float32)
    u = acc_u.to(h_ptr.dtype.element_ty).to(tl.float32)
    h = tl.where(a > 0, a, tl.where(a != a, a, 0.0)) * u
    h_ptrs = h_ptr + rows.to(tl.int64)[:, None] * stride_hm + units[None, :]
    tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=rmask[:, None] & umask[None, :])


def gate_up(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, config: Optional[GateUpConfig] = None) -> torch.Tensor:
    """``relu(x w_gate^T) * (x w_up^T)`` in one launch.

    Args:
        x: ``[M, d]`` (fp16, bf16, or fp32 with full-precision products; unit-stride rows).
        w_gate, w_up: ``[f, d]`` in x's dtype and on its device, unit-stride rows.
        config: a :class:`GateUpConfig`; None: :data:`GATE_UP_CONFIG`.

    Returns:
        ``h [M, f]`` in x's dtype.
    """
    for name, t in (("x", x), ("w_gate", w_gate), ("w_up", w_up)):
        check_tensor(t, name, dtypes=(torch.float16, torch.bfloat16, torch.float32))
        if t.dim() != 2 or (t.shape[1] > 1 and t.stride(1) != 1):
            raise ValueError(f"{name} must be a 2-D tensor with unit-stride rows, got shape {list(t.shape)} strides {t.stride()}")
    M, d = x.shape
    f = w_gate.shape[0]
    if w_gate.shape != (f, d) or w_up.shape != (f, d):
        raise ValueError(f"w_gate and w_up must be [f, d] = [{f}, {d}], got {list(w_gate.shape)} and {list(w_up.shape)}")
    if w_gate.dtype != x.dtype or w_up.dtype != x.dtype or w_gate.device != x.device or w_up.device != x.device:
        raise ValueError("w_gate and w_up must have x's dtype and device")
    if not (x.is_cuda or triton_interpreting()):
        a = x @ w_gate.t()
        return (x @ w_up.t()).mul_(torch.relu(a))
    h = torch.empty(M, f, dtype=x.dtype, device=x.device)
    if M and f:
        if d == 0:
            return h.zero_()
        cfg = config or GATE_UP_CONFIG
        grid = (triton.cdiv(M, cfg.BM) * triton.cdiv(f, cfg.BN),)
        with on_device_of(x):
            _gate_up_kernel[grid](x, w_gate, w_up, h, M, f, d, x.stride(0), w_gate.stride(0), w_up.stride(0), h.stride(0),
                                  BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, PREC="ieee" if x.dtype == torch.float32 else "tf32",
                                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return h

"""The FFN of a small batch in one launch: gate, up and down fused, for up to 16 tokens.

:mod:`twell.kernels.decode` takes three launches (cuBLAS gate, up kernel, down kernel), and on
the H200 each small launch costs a fixed 8 to 14 us after an L2 flush, more than its bytes: at
M = 1, k = 29 the three sum to 26.8 us against a 5.4 us byte floor (benchmarks/NOTES_decode.md).
Here one program per block of ``BU`` units does all of it::

    a[m, u]  = x[m] . w_first[u]                       the block's gate rows, read whole
    active   = units with a > 0 for some token           (the rest are never read again)
    h[m, u]  = relu(a) * (x[m] . w_up[u])  for active u  (non-gated: relu(a))
    acc[m]  += sum over active u of h[m, u] w_down_t[u]  fp32 atomic adds into a scratch row

and the last program to finish (an atomic ticket) writes ``y = acc`` in x's dtype, zeroes the
scratch and resets the ticket, so the next call (same stream) starts clean. The gate and up
values are rounded to x's dtype before use, as the dense path's products are; the down sums run
in fp32 in whatever order the programs finish (exact up to rounding, not bit-reproducible).

Not yet measured on a GPU (issue 9): :func:`ffn_decode_fused` is an opt-in beside
:func:`twell.kernels.ffn_decode`; ``benchmarks/decode_fused_probe.py`` times both in CUDA graphs.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._launch import on_device_of
from .decode import check_decode_args

__all__ = ["ffn_decode_fused", "DecodeScratch", "FUSED_MAX_M"]

FUSED_MAX_M = 16  # tokens per call: one tensor-core tile of rows


@triton.jit
def _decode_fused_kernel(
    x_ptr, stride_xm,
    wf_ptr, stride_wf, wu_ptr, stride_wu, wd_ptr, stride_wd,
    acc_ptr, ticket_ptr, y_ptr, stride_ym,
    M, d, f, NB,
    BM: tl.constexpr, BU: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr,
    GATED: tl.constexpr, PREC: tl.constexpr,
):
    b = tl.program_id(0)
    rows = tl.arange(0, BM)
    rmask = rows < M
    units = b * BU + tl.arange(0, BU)
    umask = units < f
    ks = tl.arange(0, BK)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    # the gate: this block's rows of w_first, read whole
    a = tl.zeros([BM, BU], dtype=tl.float32)
    for k0 in range(0, d, BK):
        kk = k0 + ks
        kmask = kk < d
        xa = tl.load(x_rows + kk[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(wf_ptr + units.to(tl.int64)[None, :] * stride_wf + kk[:, None], mask=umask[None, :] & kmask[:, None], other=0.0)
        a = tl.dot(xa, w, a, input_precision=PREC)
    a = a.to(y_ptr.dtype.element_ty).to(tl.float32)  # the dense path's rounding of the product
    fires = (a > 0) & rmask[:, None] & umask[None, :]
    active = tl.max(fires.to(tl.int32), axis=0) > 0
    if tl.sum(active.to(tl.int32), axis=0) > 0:
        h = tl.where(fires, a, 0.0)
        if GATED:
            u = tl.zeros([BM, BU], dtype=tl.float32)
            for k0 in range(0, d, BK):
                kk = k0 + ks
                kmask = kk < d
                xa = tl.load(x_rows + kk[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
                w = tl.load(wu_ptr + units.to(tl.int64)[None, :] * stride_wu + kk[:, None], mask=active[None, :] & kmask[:, None], other=0.0)
                u = tl.dot(xa, w, u, input_precision=PREC)
            h = h * u.to(y_ptr.dtype.element_ty).to(tl.float32)
        hb = h.to(y_ptr.dtype.element_ty)
        cs = tl.arange(0, BD)
        for d0 in range(0, d, BD):
            cols = d0 + cs
            cmask = cols < d
            w = tl.load(wd_ptr + units.to(tl.int64)[:, None] * stride_wd + cols[None, :], mask=active[:, None] & cmask[None, :], other=0.0)
            part = tl.dot(hb, w, input_precision=PREC)
            # relaxed: the default acq_rel puts a fence around every element's add
            tl.atomic_add(acc_ptr + rows[:, None] * d + cols[None, :], part, mask=rmask[:, None] & cmask[None, :], sem="relaxed")
    # the last program to arrive writes y and leaves the scratch zeroed for the next call
    # every warp's adds before the ticket (thread 0's acq_rel atomic releases them for the block)
    tl.debug_barrier()
    if tl.atomic_add(ticket_ptr, 1) == NB - 1:
        cs = tl.arange(0, BD)
        for d0 in range(0, d, BD):
            cols = d0 + cs
            omask = rmask[:, None] & (cols < d)[None, :]
            offs = rows[:, None] * d + cols[None, :]
            v = tl.load(acc_ptr + offs, mask=omask, other=0.0, cache_modifier=".cg")
            tl.store(y_ptr + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :], v.to(y_ptr.dtype.element_ty), mask=omask)
            tl.store(acc_ptr + offs, tl.zeros([BM, BD], dtype=tl.float32), mask=omask)
        tl.atomic_xchg(ticket_ptr, 0)


class DecodeScratch:
    """The fused decode kernel's state between calls: an fp32 ``[16, d]`` accumulator and a
    ticket, both zero between calls. One per layer (calls on one stream run in order; two
    streams must not share one). Allocate outside a CUDA graph capture, or inside it for that
    graph alone."""

    def __init__(self, d: int, device) -> None:
        self.acc = torch.zeros(FUSED_MAX_M, d, dtype=torch.float32, device=device)
        self.ticket = torch.zeros(1, dtype=torch.int32, device=device)


# BU units per program, BK columns of d per gate/up step, BD columns per down step, warps, stages
FUSED_CONFIG = (32, 256, 256, 4, 3)


def ffn_decode_fused(
    x: torch.Tensor,
    w_first: torch.Tensor,
    w_down_t: torch.Tensor,
    *,
    w_up: Optional[torch.Tensor] = None,
    scratch: Optional[DecodeScratch] = None,
    config: Optional[tuple[int, int, int, int, int]] = None,
) -> torch.Tensor:
    """The whole FFN of at most 16 tokens in one launch (see the module's text).

    Args:
        x: ``[M, d]`` tokens, ``M <= 16`` (fp16, bf16 or fp32; unit-stride rows).
        w_first: ``[f, d]`` gate (gated) or up (non-gated) rows; w_down_t: ``[f, d]``, row ``j`` =
            ``w_down[:, j]``; w_up: ``[f, d]`` for the gated MLP, None for the non-gated one.
        scratch: a :class:`DecodeScratch` for this layer (a fresh one when None: two extra
            allocations per call).
        config: ``(BU, BK, BD, num_warps, num_stages)``.

    Returns:
        ``y [M, d]`` in x's dtype.
    """
    M, d, f = check_decode_args(x, w_first, w_down_t, w_up)
    if M > FUSED_MAX_M:
        raise ValueError(f"the fused decode kernel takes at most {FUSED_MAX_M} tokens per call, got {M}")
    if scratch is None:
        scratch = DecodeScratch(d, x.device)
    elif scratch.acc.shape != (FUSED_MAX_M, d) or scratch.acc.device != x.device:
        raise ValueError(f"scratch must be a DecodeScratch for d = {d} on {x.device}")
    y = torch.empty(M, d, dtype=x.dtype, device=x.device)
    if M == 0 or d == 0:
        return y
    if f == 0:
        return y.zero_()
    BU, BK, BD, nw, ns = config or FUSED_CONFIG
    NB = triton.cdiv(f, BU)
    w_up_ = w_up if w_up is not None else w_first
    with on_device_of(x):
        _decode_fused_kernel[(NB,)](
            x, x.stride(0), w_first, w_first.stride(0), w_up_, w_up_.stride(0), w_down_t, w_down_t.stride(0),
            scratch.acc, scratch.ticket, y, y.stride(0),
            M, d, f, NB,
            BM=FUSED_MAX_M, BU=BU, BK=min(BK, max(16, triton.next_power_of_2(d))), BD=min(BD, max(16, triton.next_power_of_2(d))),
            GATED=w_up is not None, PREC="ieee" if x.dtype == torch.float32 else "tf32",
            num_warps=nw, num_stages=ns,
        )
    return y

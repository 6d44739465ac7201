"""Element-wise passes of the training FFN's rows held dense: every row of the dense training op,
and the backward of the hybrid format's heavy rows (:mod:`twell.training.ops`; their forward is
:mod:`.heavy_rows`).

Between the cuBLAS products, dense autograd walks ``[M, f]`` tensors many times: relu, the
gated product, ``|h|`` for the L1 term, the active mask for the statistics; in the backward the
L1 term's ``c sign(h)`` added in fp32 (it would round away in bf16), the products by g and u,
relu's mask. Written as PyTorch ops those were about 2.5 ms of the 8.1 ms an all-dense call took
at M 16384, f 5632 on the H200 (dense PyTorch: 5.0 ms). Here each direction is one pass::

    forward   a [M, f] (, u [M, f]) --dense_rows_forward--> h, |h| summed per row [M] (fp32),
              active tokens per unit [f] (int64), active units per row [M] (int32)
    backward  dz = dy w_down [M, f], a (, u), c --dense_rows_backward--> gated: du (written over
              dz), da, h; non-gated: dh (written over dz)

Gated: ``g = relu(a)``, ``h = g u``. Non-gated: ``h = relu(a)``, and the backward's ``a`` may be
``h`` itself (relu(h) = h), which is what the training op saves. ``c`` is the L1 term's gradient
per ``|h|``, read on the device as a one-element tensor times a scale (no host sync). Math, with every product in fp32 and one
rounding to the storage dtype per stored value (``relu`` keeps a NaN as torch.relu does)::

    dh = dz + c sign(h)             du = dh g        da = dh u [a fires]   (gated)
    dh = (dz + c) [a fires]                                                (non-gated)

where ``a`` fires when ``a > 0`` or NaN (:mod:`._activity`; relu's gradient passes a NaN on, as
PyTorch's does), and the per-unit and per-row counts count the same units.

One program per ``BM`` rows walks f in ``BF``-column steps; where that makes fewer programs than
``TARGET_PROGRAMS`` (a few thousand tokens), f is split into chunks of whole steps, one program
per row block and chunk. Each program's |h| sums are its own, added over the chunks in a fixed
order afterwards (deterministic); the per-unit counts are integer atomics, skipped where a column
step has none, and so are the per-row counts where f is split (else each row's program stores
its own).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..checks import check_tensor, triton_interpreting
from ._activity import fires, relu
from ._launch import on_device_of

__all__ = ["dense_rows_forward", "dense_rows_backward"]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _forward_kernel(a_ptr, u_ptr, h_ptr, l1_ptr, cnt_ptr, rc_ptr, M, F, CHUNK,
                    GATED: tl.constexpr, SPLIT: tl.constexpr, BM: tl.constexpr, BF: tl.constexpr):
    # program (i, j): rows i*BM.., columns j*CHUNK.. (CHUNK a multiple of BF; one chunk: all of f)
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    row_ok = rows < M
    base = rows.to(tl.int64)[:, None] * F
    start = tl.program_id(1) * CHUNK
    l1 = tl.zeros([BM], dtype=tl.float32)
    per_row = tl.zeros([BM], dtype=tl.int32)
    for f0 in range(start, tl.minimum(start + CHUNK, F), BF):
        cols = f0 + tl.arange(0, BF)
        ok = row_ok[:, None] & (cols < F)[None, :]
        a = tl.load(a_ptr + base + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        h = relu(a)
        if GATED:
            h = h * tl.load(u_ptr + base + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        h = h.to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + base + cols[None, :], h, mask=ok)
        l1 += tl.sum(tl.abs(h.to(tl.float32)), axis=1)
        active = fires(a).to(tl.int32)
        per_row += tl.sum(active, axis=1)
        n = tl.sum(active, axis=0).to(tl.int64)
        tl.atomic_add(cnt_ptr + cols, n, mask=(cols < F) & (n > 0), sem="relaxed")
    # this chunk's |h| sums in its own row of l1 ([chunks, M]; summed in a fixed order after)
    tl.store(l1_ptr + tl.program_id(1) * M + rows, l1, mask=row_ok)
    if SPLIT:
        tl.atomic_add(rc_ptr + rows, per_row, mask=row_ok, sem="relaxed")
    else:
        tl.store(rc_ptr + rows, per_row, mask=row_ok)


@triton.jit
def _backward_kernel(dz_ptr, a_ptr, u_ptr, da_ptr, h_ptr, c_ptr, c_scale, M, F, CHUNK,
                     HAS_C: tl.constexpr, GATED: tl.constexpr, BM: tl.constexpr, BF: tl.constexpr):
    # program (i, j): rows i*BM.., columns j*CHUNK.. (as the forward's)
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    row_ok = rows < M
    base = rows.to(tl.int64)[:, None] * F
    start = tl.program_id(1) * CHUNK
    c = 0.0
    if HAS_C:
        c = tl.load(c_ptr).to(tl.float32) * c_scale
    for f0 in range(start, tl.minimum(start + CHUNK, F), BF):
        cols = f0 + tl.arange(0, BF)
        ok = row_ok[:, None] & (cols < F)[None, :]
        at = base + cols[None, :]
        dz = tl.load(dz_ptr + at, mask=ok, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + at, mask=ok, other=0.0).to(tl.float32)
        if GATED:
            g = relu(a)
            u = tl.load(u_ptr + at, mask=ok, other=0.0).to(tl.float32)
            h = (g * u).to(h_ptr.dtype.element_ty)
            tl.store(h_ptr + at, h, mask=ok)
            hf = h.to(tl.float32)
            # sign of the stored h, as dense autograd's torch.sign(h) sees it
            dh = dz + c * tl.where(hf > 0, 1.0, tl.where(hf < 0, -1.0, 0.0))
            tl.store(dz_ptr + at, (dh * g).to(dz_ptr.dtype.element_ty), mask=ok)
            tl.store(da_ptr + at, tl.where(fires(a), dh * u, 0.0).to(da_ptr.dtype.element_ty), mask=ok)
        else:
            # the L1 term's c sign(h): c where h > 0, nothing at a NaN h (torch.sign(NaN) is 0)
            tl.store(dz_ptr + at, tl.where(fires(a), dz + tl.where(a > 0, c, 0.0), 0.0).to(dz_ptr.dtype.element_ty), mask=ok)


def _check(name: str, t: torch.Tensor, like: torch.Tensor) -> None:
    check_tensor(t, name, dim=2, dtypes=_FLOATS)
    if t.shape != like.shape or t.dtype != like.dtype or t.device != like.device:
        raise ValueError(f"{name} ({list(t.shape)}, {t.dtype}, {t.device}) must match a "
                         f"({list(like.shape)}, {like.dtype}, {like.device})")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _blocks(f: int, widest: int = 256) -> tuple[int, int]:
    # plain integer arithmetic: triton.next_power_of_2 costs host time on every call
    bf = min(widest, 1 << (max(f, 1) - 1).bit_length())
    return 4096 // bf, bf  # about 4K values per step per program


# Programs a pass aims for. Where a call has fewer row blocks, each row block's columns are split
# into chunks, one program each: at 1024 tokens (f 5632) the forward had 32 programs of 32 rows
# for the H100's 132 SMs and took 94.5 us, where PyTorch's relu-and-product pass over the same
# [M, f] took 38.7 us (benchmarks/results/train_call_stage_h100.json). Timed on the H100 with
# and without the chunks (bf16, f 5632, do_bench): the forward 81.7 against 117.1 us at 4096
# tokens and 86.8 against 102.9 us at 1024 (where the host's launch sets the pace), the backward
# 105.2 against 104.5 us at 4096, and 231 and 397 us either way at 16384. From 512 row blocks
# (16384 tokens for the forward's blocks at f 5632, 8192 for the backward's) a pass runs one
# program per row block.
TARGET_PROGRAMS = 512


def _chunks(M: int, f: int, BM: int, BF: int) -> tuple[int, int]:
    """``(chunks, columns per chunk)``: how a pass of ``M`` rows splits f (chunks of whole BF steps)."""
    row_blocks = (M + BM - 1) // BM
    steps = (f + BF - 1) // BF
    chunks = max(1, min(steps, TARGET_PROGRAMS // max(row_blocks, 1)))
    per = max(1, (steps + chunks - 1) // chunks)
    return max(1, (steps + per - 1) // per), per * BF


# The forward pass's block: 32 rows x 128 columns, 4 warps. On the H200 (bf16, f 5632) it took
# 0.207 / 0.754 ms at M 16384 / 65536 against 0.473 / 1.819 for the backward's 16 x 256 with 8
# warps (PyTorch's relu and product alone: 0.221 / 0.853): twice the rows per program halve the
# per-unit atomic adds, and 4 warps keep more programs resident.
FORWARD_WIDEST, FORWARD_WARPS = 128, 4


def dense_rows_forward(a: torch.Tensor, u: Optional[torch.Tensor], check: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward's element-wise pass over rows held dense.

    Args:
        a: ``[M, f]`` contiguous pre-activation (x w_gate^T gated, x w_up^T non-gated).
        u: ``[M, f]`` up projection (gated), same dtype and device; None non-gated.
        check: validate a and u (the training ops, whose own products made them, skip it:
            at a few thousand tokens a call is bound by its host time).

    Returns:
        ``(h [M, f] in a's dtype, l1_rows [M] fp32 = sum_j |h_ij|, unit_counts [f] int64 =
        tokens where a_ij fires (> 0 or NaN), row_counts [M] int32 = units that fire)``.
    """
    if check:
        _check("a", a, a)
        if u is not None:
            _check("u", u, a)
    M, f = a.shape
    if not (a.is_cuda or triton_interpreting()):
        h = torch.relu(a) if u is None else torch.relu(a) * u
        active = ~(a <= 0)  # a > 0 or NaN: what the kernel counts
        return (h, h.abs().sum(1, dtype=torch.float32), active.sum(0, dtype=torch.int64),
                active.sum(1, dtype=torch.int32))
    h = torch.empty_like(a)
    BM, BF = _blocks(f, FORWARD_WIDEST)
    chunks, chunk = _chunks(M, f, BM, BF)
    counts = torch.zeros(f, dtype=torch.int64, device=a.device)
    # the chunks add into the row counts, zeroed first. Two tensors of their own, never views of
    # one buffer: the training op returns both, and a custom op's outputs may not alias each other
    row_counts = torch.empty(M, dtype=torch.int32, device=a.device)
    if chunks > 1:
        row_counts.zero_()
    l1_parts = torch.empty(chunks * M, dtype=torch.float32, device=a.device).view(chunks, M)
    if M and f:
        with on_device_of(a):
            _forward_kernel[((M + BM - 1) // BM, chunks)](
                a, a if u is None else u, h, l1_parts, counts, row_counts, M, f, chunk,
                GATED=u is not None, SPLIT=chunks > 1, BM=BM, BF=BF, num_warps=FORWARD_WARPS)
    else:
        l1_parts.zero_()
        row_counts.zero_()
    # each row's |h| sum in a fixed order whatever the chunks (deterministic)
    l1 = l1_parts[0] if chunks == 1 else l1_parts.sum(0)
    return h, l1, counts, row_counts


def dense_rows_backward(dz: torch.Tensor, a: torch.Tensor, u: Optional[torch.Tensor],
                        c: Optional[torch.Tensor], c_scale: float = 1.0,
                        check: bool = True) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """The backward's element-wise pass over rows held dense; ``dz`` is overwritten.

    Args:
        dz: ``[M, f]`` contiguous, ``dy w_down`` (the gradient reaching h from the down product).
        a: ``[M, f]`` the forward's pre-activation (non-gated: it or h).
        u: ``[M, f]`` the up projection (gated); None non-gated.
        c: one-element float tensor on a's device; ``c * c_scale`` is the L1 term's gradient per
            ``|h|`` (the training ops pass the l1 output's gradient and ``1 / M``: no host sync,
            no launch to scale it). None: no L1 gradient.
        check: validate the arguments (the training ops, which made them, skip it).

    Returns:
        gated ``(du, da, h)``, du being ``dz``'s storage; non-gated ``(dh, None, None)``, dh being
        ``dz``'s storage. All in dz's dtype.
    """
    if check:
        _check("dz", dz, a)
        _check("a", a, a)
        if u is not None:
            _check("u", u, a)
        if c is not None:
            check_tensor(c, "c", dtypes=_FLOATS)
            if c.numel() != 1 or c.device != a.device:
                raise ValueError(f"c must be a one-element tensor on {a.device}, got {list(c.shape)} on {c.device}")
    if not (a.is_cuda or triton_interpreting()):
        return _backward_torch(dz, a, u, c, c_scale)
    M, f = a.shape
    da = h = None
    if u is not None:
        da, h = torch.empty_like(a), torch.empty_like(a)
    if M and f:
        BM, BF = _blocks(f)
        chunks, chunk = _chunks(M, f, BM, BF)
        with on_device_of(a):
            _backward_kernel[((M + BM - 1) // BM, chunks)](
                dz, a, a if u is None else u, dz if da is None else da, dz if h is None else h,
                a if c is None else c, float(c_scale), M, f, chunk, HAS_C=c is not None, GATED=u is not None,
                BM=BM, BF=BF, num_warps=8)
    return dz, da, h


def _backward_torch(dz, a, u, c, c_scale):
    """:func:`dense_rows_backward` in PyTorch ops, for CPU tensors without the Triton interpreter."""
    c = 0.0 if c is None else c.reshape(()).to(torch.float32) * c_scale
    if u is None:
        # relu's gradient passes NaN on; the L1 term's c sign(h) is 0 there (torch.sign(NaN) is 0)
        dz.copy_(torch.where(~(a <= 0), dz.float() + torch.where(a > 0, c, 0.0), 0.0))
        return dz, None, None
    g = torch.relu(a)
    h = g * u
    dh = dz.float() + torch.sign(h).float() * c
    da = torch.where(~(a <= 0), dh * u.float(), 0.0).to(a.dtype)
    dz.copy_(dh * g.float())
    return dz, da, h

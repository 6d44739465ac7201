"""The forward of the hybrid format's heavy rows with no host synchronisation (and, through
:func:`launch_heavy_rows`, the inference up/down's rows computed whole:
:func:`twell.kernels.ffn_from_twell` with ``pre_writable``).

A heavy row has more active units than the ELL width W and is held dense. Which rows are heavy,
and how many, is known only on the GPU (``counts > W`` after the pack); reading that count back
to size cuBLAS products would stall the host until the GPU drained its queue, once per layer per
step. Here the row list and its length stay on the device: the kernels are launched for every
row the call could have and each program walks the listed rows in blocks, ``n`` read from
device memory, so a call with no heavy row costs two launches of programs that exit at once
(and the zero-fill and sum of a ``[f / block_n, M]`` fp32 buffer of |h| partial sums)::

    heavy_up    rows r of the list: h[r] = relu(a[r]) * (x[r] w_up^T)   (gated; non-gated relu(a[r]))
                written over a[r] in place, with |h| summed per (column block, row) and the
                active tokens of each unit (integer atomics)
    heavy_down  y[r] = h[r] w_down^T, written over the rows of y the light-row kernel left zero

Exact as the cuBLAS path it replaces: fp32 accumulation, u rounded to the input dtype before
the product (what ``torch.mm`` returns), h rounded once. What the backward needs of these rows
(a and u) is recomputed there from x (:mod:`twell.training.ops`), where the count is known on the
host without waiting.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..checks import KERNEL_DTYPES, check_launchable, check_tensor, check_weight_rows
from ._activity import fires, relu
from ._dot import dot_operand, dot_precision
from ._launch import on_device_of

__all__ = ["heavy_rows_forward", "weights_addressable"]

# The kernels address weight elements with int32 offsets (units or columns times a stride: the
# tuned inner loops stay as they were measured; int64 there costs instructions in heavy_down's).
_MAX_SPAN = 2**31


def weights_addressable(*weights: Optional[torch.Tensor]) -> bool:
    """Whether every element these weights' views reach lies within 2^31 elements of their first:
    what the heavy-rows kernels' int32 offsets can address. Every real FFN does (d f = 2^31 is d
    16384 with f 131072); callers route larger weights elsewhere."""
    return all(w is None or sum((n - 1) * abs(s) for n, s in zip(w.shape, w.stride()) if n) < _MAX_SPAN for w in weights)


@triton.jit
def _listed(idx_ptr, blk, n, BM: tl.constexpr):
    """Block ``blk`` of the row list: ``(valid [BM], rows [BM] int64)``, entries past ``n`` masked."""
    local = blk * BM + tl.arange(0, BM)
    valid = local < n
    return valid, tl.load(idx_ptr + local, mask=valid, other=0).to(tl.int64)


@triton.jit
def _dot_acc(acc, a, b_t, PREC: tl.constexpr):
    """``acc + a b_t^T`` at the precision twell.kernels._dot chooses for the launch."""
    return tl.dot(dot_operand(a, PREC), tl.trans(dot_operand(b_t, PREC)), acc, input_precision=PREC)


@triton.jit
def _heavy_up_kernel(x_ptr, stride_x, a_ptr, stride_a, wu_ptr, stride_wu, idx_ptr, n_ptr,
                     l1_ptr, cnt_ptr, su_ptr, sd_ptr, M, d, f, P,
                     GATED: tl.constexpr, PREC: tl.constexpr, L1: tl.constexpr, COUNT: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SCALED: tl.constexpr):
    # SCALED: FP8 rows with per-unit scales (twell.fp8): the e4m3 up rows are widened to x's dtype
    # (exact) for the dot, u stays fp32 times its unit's up scale, and h takes the down scale too
    pid_n = tl.program_id(0)
    cols = pid_n * BN + tl.arange(0, BN)
    cmask = cols < f
    n = tl.load(n_ptr)
    for blk in range(tl.program_id(1), tl.cdiv(n, BM), P):
        valid, r = _listed(idx_ptr, blk, n, BM)
        ok = valid[:, None] & cmask[None, :]
        at = a_ptr + r[:, None] * stride_a + cols[None, :]
        a = tl.load(at, mask=ok, other=0.0).to(tl.float32)
        h = relu(a)
        if GATED:
            acc = tl.zeros([BM, BN], dtype=tl.float32)
            for k0 in range(0, d, BK):
                kk = k0 + tl.arange(0, BK)
                km = kk < d
                xt = tl.load(x_ptr + r[:, None] * stride_x + kk[None, :], mask=valid[:, None] & km[None, :], other=0.0)
                wt = tl.load(wu_ptr + cols[:, None] * stride_wu + kk[None, :], mask=cmask[:, None] & km[None, :], other=0.0)
                if SCALED:
                    wt = wt.to(x_ptr.dtype.element_ty)
                acc = _dot_acc(acc, xt, wt, PREC)
            if SCALED:
                u = acc * tl.load(su_ptr + cols, mask=cmask, other=0.0)[None, :]
            else:
                u = acc.to(a_ptr.dtype.element_ty).to(tl.float32)  # what torch.mm would have stored
            h = h * u
        if SCALED:
            h = h * tl.load(sd_ptr + cols, mask=cmask, other=0.0)[None, :]
        h = h.to(a_ptr.dtype.element_ty)
        tl.store(at, h, mask=ok)
        if L1:
            # |h| of this column block, one slot per (block, row): summed over blocks by the caller
            # in a fixed order (no float atomics: the L1 term comes out the same on every run)
            tl.store(l1_ptr + pid_n.to(tl.int64) * M + r, tl.sum(tl.abs(h.to(tl.float32)), axis=1), mask=valid)
        if COUNT:
            active = (fires(a) & ok).to(tl.int32)
            per_col = tl.sum(active, axis=0)
            tl.atomic_add(cnt_ptr + cols, per_col.to(cnt_ptr.dtype.element_ty), mask=cmask & (per_col > 0), sem="relaxed")


@triton.jit
def _heavy_down_kernel(h_ptr, stride_h, wd_ptr, stride_wd, stride_wf, y_ptr, stride_y, idx_ptr, n_ptr,
                       d, f, P,
                       PREC: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr, BK: tl.constexpr, SCALED: tl.constexpr):
    dd = tl.program_id(0) * BD + tl.arange(0, BD)
    dmask = dd < d
    n = tl.load(n_ptr)
    for blk in range(tl.program_id(1), tl.cdiv(n, BM), P):
        valid, r = _listed(idx_ptr, blk, n, BM)
        acc = tl.zeros([BM, BD], dtype=tl.float32)
        for k0 in range(0, f, BK):
            kk = k0 + tl.arange(0, BK)
            km = kk < f
            ht = tl.load(h_ptr + r[:, None] * stride_h + kk[None, :], mask=valid[:, None] & km[None, :], other=0.0)
            wt = tl.load(wd_ptr + dd[:, None] * stride_wd + kk[None, :] * stride_wf, mask=dmask[:, None] & km[None, :], other=0.0)
            if SCALED:  # e4m3 down rows widened (exact); their scales are in h
                wt = wt.to(h_ptr.dtype.element_ty)
            acc = _dot_acc(acc, ht, wt, PREC)
        tl.store(y_ptr + r[:, None] * stride_y + dd[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=valid[:, None] & dmask[None, :])


_SMS: dict = {}


def _row_programs(t: torch.Tensor, M: int, block_m: int, col_blocks: int) -> int:
    """Programs along the row list: about four waves of the device's SMs in all, at most one
    per block of rows the call could have."""
    if not t.is_cuda:
        return max(1, min(triton.cdiv(M, block_m), 2))  # the interpreter: still loop more than once
    idx = t.device.index if t.device.index is not None else torch.cuda.current_device()
    sms = _SMS.get(idx)
    if sms is None:
        sms = _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return max(1, min(triton.cdiv(M, block_m), (4 * sms) // max(col_blocks, 1)))


def heavy_rows_forward(
    x: torch.Tensor,
    a: torch.Tensor,
    rows: torch.Tensor,
    n_rows: torch.Tensor,
    y: torch.Tensor,
    w_down: torch.Tensor,
    w_up: Optional[torch.Tensor] = None,
    *,
    block_m: int = 64,
    block_n: int = 128,
    block_k: int = 64,
    num_warps: int = 4,
    num_stages: int = 3,
    unit_counts: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward of the listed rows held dense, with no host synchronisation.

    Args:
        x: ``[M, d]`` contiguous tokens (fp32, fp16 or bf16).
        a: ``[M, f]`` pre-activation (x w_gate^T gated, x w_up^T non-gated), unit-stride rows;
            the listed rows are overwritten with h.
        rows: ``[>= n]`` int32/int64 on the device, the rows to compute first (any order, each
            at most once); entries past ``n_rows`` are ignored.
        n_rows: one-element int32/int64 tensor on the device, how many of ``rows`` are listed.
        y: ``[M, d]`` the FFN output; the listed rows are overwritten (others untouched).
        w_down: ``[d, f]`` (any strides: in eval mode the modules keep it as a transpose);
            w_up: ``[f, d]`` (gated) or None (non-gated: h = relu(a)).
        block_*, num_warps, num_stages: tuning knobs.
        unit_counts: optional ``[f]`` int32/int64 tensor on x's device to add the listed rows'
            counts to (in place; the light rows' counts, so that no second buffer is made and
            added), returned as the second result.

    Returns:
        ``(l1_rows [M] fp32, unit_counts [f])``: the listed rows' sum of ``|h|`` (zero for
        the other rows) and how many listed rows each unit is active in (``a > 0`` or NaN),
        int32 in a new tensor, or added to ``unit_counts``.
    """
    check_tensor(x, "x", dim=2, dtypes=KERNEL_DTYPES)
    check_tensor(a, "a", dim=2, dtypes=KERNEL_DTYPES)
    M, d = x.shape
    f = a.shape[1]
    if not x.is_contiguous() or a.shape[0] != M or a.stride(1) != 1 or a.dtype != x.dtype or a.device != x.device:
        raise ValueError(f"x must be contiguous [M, d] and a [M, f] of its dtype and device with unit-stride rows, "
                         f"got x {list(x.shape)} {x.dtype}, a {list(a.shape)} {a.dtype} strides {a.stride()}")
    check_tensor(y, "y", dim=2, dtypes=KERNEL_DTYPES)
    if y.shape != (M, d) or y.dtype != x.dtype or y.device != x.device or y.stride(1) != 1:
        raise ValueError(f"y must be [M, d] = {[M, d]} of x's dtype and device, got {list(y.shape)} {y.dtype}")
    for t, name in ((rows, "rows"), (n_rows, "n_rows")):
        if t.dtype not in (torch.int32, torch.int64) or t.device != x.device:
            raise ValueError(f"{name} must be int32 or int64 on {x.device}, got {t.dtype} on {t.device}")
    if n_rows.numel() != 1 or rows.dim() != 1 or not rows.is_contiguous():
        raise ValueError(f"rows must be a contiguous 1-D list and n_rows one element, got {list(rows.shape)}, {list(n_rows.shape)}")
    check_tensor(w_down, "w_down", dim=2, dtypes=KERNEL_DTYPES)
    if w_down.shape != (d, f) or w_down.dtype != x.dtype or w_down.device != x.device:
        raise ValueError(f"w_down must be [d, f] = {[d, f]} of x's dtype and device, got {list(w_down.shape)} {w_down.dtype}")
    check_weight_rows(w_up, "w_up", f, d, x)
    if not weights_addressable(w_down, w_up):
        raise ValueError(f"w_down / w_up reach 2^31 elements or more (d {d}, f {f}, strides {w_down.stride()}): "
                         "the heavy-rows kernels address weights with 32-bit offsets")
    check_launchable(x, "x")
    if unit_counts is None:
        unit_counts = torch.zeros(f, dtype=torch.int32, device=x.device)
    elif unit_counts.shape != (f,) or unit_counts.dtype not in (torch.int32, torch.int64) or unit_counts.device != x.device \
            or not unit_counts.is_contiguous():
        raise ValueError(f"unit_counts must be a contiguous [f] = [{f}] int32/int64 tensor on {x.device}, got "
                         f"{list(unit_counts.shape)} {unit_counts.dtype} on {unit_counts.device}")
    partial = torch.zeros(triton.cdiv(f, block_n), M, dtype=torch.float32, device=x.device)
    launch_heavy_rows(x, a, rows, n_rows, y, w_down, w_up, partial, unit_counts, block_m=block_m, block_n=block_n,
                      block_k=block_k, num_warps=num_warps, num_stages=num_stages)
    return partial.sum(0), unit_counts


def launch_heavy_rows(x, a, rows, n_rows, y, w_down, w_up, l1_partial, unit_counts, *, block_m, block_n, block_k,
                      num_warps, num_stages, w_scales=None) -> None:
    """The two launches of :func:`heavy_rows_forward`, arguments as it checks them except that
    x's rows may have any stride (unit-stride columns) (``l1_partial``: its ``[cdiv(f, block_n),
    M]`` fp32 zeros, or None for no sums of ``|h|``; ``unit_counts`` None for no counts); for
    callers that checked them already (:func:`twell.kernels.ffn_from_twell`), whose host time
    per call it saves. ``w_scales``: ``(up_scale, down_scale)`` ``[f]`` float32 when ``w_up`` and
    ``w_down`` are e4m3 rows scaled per unit (:mod:`twell.fp8`; gated only)."""
    M, d = x.shape
    f = a.shape[1]
    if M == 0 or f == 0 or rows.numel() == 0:
        return
    prec = dot_precision(x)
    n_ptr = n_rows.reshape(1)
    with on_device_of(x):
        col_blocks = triton.cdiv(f, block_n)
        P = _row_programs(x, M, block_m, col_blocks)
        _heavy_up_kernel[(col_blocks, P)](
            x, x.stride(0), a, a.stride(0), a if w_up is None else w_up, d if w_up is None else w_up.stride(0),
            rows, n_ptr, x if l1_partial is None else l1_partial, x if unit_counts is None else unit_counts,
            *(w_scales if w_scales is not None else (x, x)), M, d, f, P,
            GATED=w_up is not None, PREC=prec, L1=l1_partial is not None, COUNT=unit_counts is not None,
            BM=block_m, BN=block_n, BK=block_k, SCALED=w_scales is not None,
            num_warps=num_warps, num_stages=num_stages,
        )
        d_blocks = triton.cdiv(d, block_n)
        P = _row_programs(x, M, block_m, d_blocks)
        _heavy_down_kernel[(d_blocks, P)](
            a, a.stride(0), w_down, w_down.stride(0), w_down.stride(1), y, y.stride(0), rows, n_ptr, d, f, P,
            PREC=prec, BM=block_m, BD=block_n, BK=block_k, SCALED=w_scales is not None, num_warps=num_warps,
            num_stages=num_stages,
        )

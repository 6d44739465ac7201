"""The FFN straight from the dense pre-activation: each token's program finds its own active
units, with no separate pack pass.

For each token ``m`` (one program), with ``a = x w_first^T`` the pre-activation cuBLAS wrote::

    scan:    the columns j where relu(a[m, j]) != 0, in ascending order, into a small
             per-token list (a cumulative count gives each active column its slot)
    gated:   h = a[m, j] * (x[m] . w_up[j]);   y[m] += h * w_down[:, j]
    non-gated:  h = a[m, j];                   y[m] += h * w_down[:, j]

This is :func:`twell.kernels.ffn_from_twell` with the pack folded in: the pack pass read the
``[M, f]`` pre-activation once and wrote a TwELL, which the up/down kernel then read. Here the
same read happens inside the up/down program, so the scan of one token overlaps the weight
gathers (bound by L2 latency) of the other programs on its SM, one launch disappears, and no
gate values are written: they are read back from ``a`` by column (one 32-byte sector each).

Exact for every input: a row with more active units than its list holds (``cap``) keeps no
entries and is recomputed from ``a`` over all its units by a second, wider launch (the exact
path of :func:`twell.kernels.ffn_from_twell`, counted in its :class:`OverflowCounters`).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..checks import KERNEL_DTYPES, check_launchable, check_tensor, check_weight_rows
from ._activity import fires
from ._launch import on_device_of
from .updown import EXACT_CONFIG, OverflowCounters, _ffn_from_twell_kernel

__all__ = ["ffn_from_pre", "SCAN_CONFIG", "default_cap"]


@triton.jit
def _ffn_scan_kernel(
    x_ptr, stride_xm,
    pre_ptr, stride_pm,
    list_ptr, nnz_ptr,
    wu_ptr, stride_wu,
    wd_ptr, stride_wd,
    y_ptr, stride_ym,
    uc_ptr,
    d, f, CAP,
    D: tl.constexpr, CH: tl.constexpr, BE: tl.constexpr,
    GATED: tl.constexpr, TRACK: tl.constexpr,
):
    m = tl.program_id(0).to(tl.int64)
    a_row = pre_ptr + m * stride_pm
    l_row = list_ptr + m * CAP
    # 1. scan: active columns in ascending order; slot = how many active columns precede it.
    #    The row is read once and not again except at its active columns: evict it first.
    run = tl.sum(tl.zeros([CH], dtype=tl.int32), axis=0)
    for c0 in range(0, f, CH):
        cols = c0 + tl.arange(0, CH)
        inside = cols < f
        a = tl.load(a_row + cols, mask=inside, other=0.0, eviction_policy="evict_first")
        act = (fires(a) & inside).to(tl.int32)
        slot = run + tl.cumsum(act, axis=0) - 1
        tl.store(l_row + slot, cols.to(list_ptr.dtype.element_ty), mask=(act != 0) & (slot < CAP))
        run += tl.sum(act, axis=0)
    tl.store(nnz_ptr + m, run)
    # a row past the list keeps no entries here: the exact launch recomputes all of it
    n = tl.where(run > CAP, 0, run)
    tl.debug_barrier()  # the gathers read list slots that other threads of this program wrote

    # 2. up and down over the listed units, BE at a time, in fp32
    offs_d = tl.arange(0, D)
    dmask = offs_d < d
    x = tl.load(x_ptr + m * stride_xm + offs_d, mask=dmask & ((offs_d * 0 + n) > 0), other=0.0).to(tl.float32)
    acc = tl.zeros([D], dtype=tl.float32)
    ones = tl.full([BE], 1, dtype=tl.int32)
    for e0 in range(0, n, BE):
        e = e0 + tl.arange(0, BE)
        valid = e < n
        unit = tl.load(l_row + e, mask=valid, other=0).to(tl.int64)
        v = tl.load(a_row + unit, mask=valid, other=0.0).to(tl.float32)
        wmask = valid[:, None] & dmask[None, :]
        if GATED:
            wu = tl.load(wu_ptr + unit[:, None] * stride_wu + offs_d[None, :], mask=wmask, other=0.0)
            h = v * tl.sum(wu.to(tl.float32) * x[None, :], axis=1)
        else:
            h = v
        wd = tl.load(wd_ptr + unit[:, None] * stride_wd + offs_d[None, :], mask=wmask, other=0.0)
        acc += tl.sum(h[:, None] * wd.to(tl.float32), axis=0)
        if TRACK:
            tl.atomic_add(uc_ptr + unit, ones, mask=valid)
    tl.store(y_ptr + m * stride_ym + offs_d, acc.to(y_ptr.dtype.element_ty), mask=dmask)


# (columns per scan step, units per gather step, warps) at d 2048 on the H200
# (benchmarks/NOTES_inference.md); other d keep a [BE, D] block near 8K elements.
SCAN_CONFIG: dict[int, tuple[int, int, int]] = {2048: (1024, 4, 4)}


def default_cap(f: int) -> int:
    """List slots per token: the one-tile TwELL's (``tile / 8 - 1``, tile the power of two at or
    above ``f``), so a row takes the exact launch only past about an eighth of its units."""
    from ..ops import DEFAULT_COMPRESSION, default_tile

    return max(1, min(f, default_tile(f) // DEFAULT_COMPRESSION - 1))


def _config(d: int) -> tuple[int, int, int]:
    D = triton.next_power_of_2(max(d, 1))
    if D in SCAN_CONFIG:
        return SCAN_CONFIG[D]
    return 1024, max(1, min(16, 8192 // D)), (4 if D <= 2048 else 8)


def ffn_from_pre(
    x: torch.Tensor,
    pre: torch.Tensor,
    w_down_t: torch.Tensor,
    *,
    w_up: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
    counters: Optional[OverflowCounters] = None,
    unit_counts: Optional[torch.Tensor] = None,
    row_nnz: Optional[torch.Tensor] = None,
    cap: Optional[int] = None,
    config: Optional[tuple[int, int, int]] = None,
) -> torch.Tensor:
    """``y [M, d]`` of the FFN whose first projection's pre-activation is ``pre``: gated
    (``relu(pre) * (x w_up^T)``, then down) when ``w_up`` is given, else ``relu(pre)`` down.

    Args:
        x: ``[M, d]`` tokens (fp16, bf16 or fp32; rows with unit stride).
        pre: ``[M, f]`` the pre-activation ``x w_first^T`` (x's dtype, unit-stride rows), e.g.
            from cuBLAS. Read once in full, then at each token's active columns.
        w_down_t: ``[f, d]``, row ``j`` = ``w_down[:, j]``.
        w_up: ``[f, d]`` up rows (gated), or None (non-gated).
        out: optional ``[M, d]`` output (x's dtype).
        counters: :class:`OverflowCounters` to add the exact path's counts to (rows with more
            than ``cap`` active units).
        unit_counts: optional ``[f]`` int32, incremented by the number of tokens each unit fired
            for; row_nnz: optional ``[M]`` int32, set to each row's count of active units.
        cap: list slots per token (default :func:`default_cap`).
        config: ``(columns per scan step, units per gather step, warps)`` tuning knobs.

    Returns:
        ``y [M, d]``.
    """
    check_tensor(x, "x", dim=2, dtypes=KERNEL_DTYPES)
    check_tensor(pre, "pre", dim=2, dtypes=KERNEL_DTYPES)
    M, d = x.shape
    f = pre.shape[1]
    if pre.dtype != x.dtype:
        raise TypeError(f"pre has dtype {pre.dtype} but x has {x.dtype}; they must match")
    if pre.shape[0] != M or pre.stride(1) != 1 or pre.device != x.device:
        raise ValueError(f"pre must be [{M}, f] with unit-stride rows on {x.device}, got {list(pre.shape)} strides {pre.stride()}")
    if x.stride(1) != 1:
        raise ValueError(f"x must have unit-stride rows, got strides {x.stride()}")
    if w_down_t is None:
        raise ValueError("w_down_t ([f, d], w_down.T.contiguous()) is required")
    check_weight_rows(w_down_t, "w_down_t", f, d, x)
    check_weight_rows(w_up, "w_up", f, d, x)
    check_launchable(x, "x")
    if (unit_counts is None) != (row_nnz is None):
        raise ValueError("pass unit_counts and row_nnz together, or neither")
    if unit_counts is not None:
        check_tensor(unit_counts, "unit_counts", dim=1, dtypes=(torch.int32,))
        check_tensor(row_nnz, "row_nnz", dim=1, dtypes=(torch.int32,))
        if unit_counts.shape[0] != f or row_nnz.shape[0] != M or not unit_counts.is_contiguous() or not row_nnz.is_contiguous():
            raise ValueError(f"unit_counts must be contiguous [{f}] and row_nnz [{M}]")
        if unit_counts.device != x.device or row_nnz.device != x.device:
            raise ValueError(f"unit_counts and row_nnz must be on x's device {x.device}")
    cap = default_cap(f) if cap is None else int(cap)
    if not 1 <= cap <= max(f, 1):
        raise ValueError(f"cap must be in [1, f = {f}], got {cap}")
    if out is None:
        out = torch.empty(M, d, dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != (M, d) or out.dtype != x.dtype or out.stride(1) != 1 or out.device != x.device or (M > 1 and out.stride(0) < d):
        raise ValueError(f"out must be [{M}, {d}] {x.dtype} on {x.device} with unit-stride, non-overlapping rows")
    if counters is None:
        counters = OverflowCounters.zeros(x.device)
    ovf = counters.buffer
    if ovf.dtype != torch.int64 or tuple(ovf.shape) != (2,) or ovf.device != x.device or not ovf.is_contiguous():
        raise ValueError("counters.buffer must be a [2] int64 tensor on x's device (OverflowCounters.zeros)")
    ch, be, nw = config or _config(d)
    for name, v in (("columns per scan step", ch), ("units per gather step", be)):
        if v < 1 or v & (v - 1):
            raise ValueError(f"{name} must be a power of two, got {v}")
    if M == 0:
        return out
    track = unit_counts is not None
    nnz = row_nnz if track else torch.empty(M, dtype=torch.int32, device=x.device)
    lists = torch.empty(M, cap, dtype=torch.int16 if f <= 32767 else torch.int32, device=x.device)
    gated = w_up is not None
    wu = w_up if gated else w_down_t
    D = triton.next_power_of_2(max(d, 1))
    with on_device_of(x):
        _ffn_scan_kernel[(M,)](
            x, x.stride(0), pre, pre.stride(0), lists, nnz,
            wu, wu.stride(0), w_down_t, w_down_t.stride(0),
            out, out.stride(0), unit_counts if track else nnz,
            d, f, cap,
            D=D, CH=min(ch, triton.next_power_of_2(f)), BE=be, GATED=gated, TRACK=track, num_warps=nw,
        )
        # rows past the list: the whole row from `pre`, in wide programs that add into y (the
        # others read their count and stop); the row counts stand in for a one-tile TwELL's
        be2, nw2 = EXACT_CONFIG
        _ffn_from_twell_kernel[(M,)](
            x, x.stride(0),
            nnz, pre, lists,
            wu, wu.stride(0),
            w_down_t, w_down_t.stride(0),
            w_down_t, w_down_t.stride(0),
            pre, pre.stride(0),
            out, out.stride(0),
            ovf, unit_counts if track else nnz, nnz,
            d, f, cap, 1, f,
            D=D, BE=be2, NTP=1, GATED=gated, HAS_PRE=True,
            TRACK=track, ONLY_OVER=True, SKIP_OVER=False, num_warps=nw2,
        )
    return out

"""Training kernels of the sparse FFN on ELL rows (the light rows of the hybrid format).

Data flow of one gated FFN in training (``a = x w_gate^T`` comes from cuBLAS; rows with more
than W active units, "heavy", are held dense: :mod:`.heavy_rows` in the forward, cuBLAS in the
backward, see :mod:`twell.training.ops`)::

    forward   a [M, f] --pack_rows--> cols, g [M, W], counts [M]
              x, cols, g --ffn_rows_forward--> y [M, d], u [M, W], |h| summed per row [M]
    backward  dy, cols, g, u --ffn_rows_backward--> dx [M, d], du, da [M, W]
              cols, counts --unit_index--> the slots of each unit (CSC view, built on the GPU:
                                           twell.kernels.train_index)
              x, dy, du, da, g, u --ffn_weight_grads--> dw_up, dw_gate, dw_down^T [f, d]

Non-gated (``h = relu(x w_up^T)``): the ELL values are h itself, there is no u, and the
backward writes only du (= dh) and dw_up, dw_down^T.

Every kernel accumulates in float32 and takes fp32, fp16 or bf16 tensors (outputs in the input
dtype, except the per-slot gradients du and da, kept in fp32 for the weight gradients). A heavy
row is skipped by the row kernels (they write zeros where it would go: y row, u slots, dx row,
its |h| sum) and by the weight-gradient kernel (its slots are not listed); the caller writes its
dense result over those rows and passes its weight-gradient contribution as a base the kernel
adds to.

Geometry: one program per token for the row kernels (a loop over the row's slots, ``BE`` slots
at a time, and over d in ``BD`` columns), one program per (unit, d block) for the weight
gradients. Up to ``FULL_D_MAX`` columns a row of d stays in registers and the row kernels run as
one launch per weight matrix (forward: u from w_up, then y from w_down^T; backward: du, da from
w_down^T, then dx from w_up and w_gate): the rows one launch gathers then fit in L2, which at
f 5632, d 2048 all of them (46 to 69 MB) do not (the H200's L2 holds 50 MB). The launchers' ``block_*``/``num_warps`` arguments are tuning knobs; the defaults
are guesses, not measurements.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..checks import KERNEL_DTYPES, check_launchable, check_pow2, check_tensor, check_weight_rows
from ._bits import step_bit_words, write_step_entries
from ._launch import on_device_of

__all__ = [
    "pack_rows",
    "ffn_rows_forward",
    "ffn_rows_backward",
    "ffn_weight_grads",
    "col_dtype",
]


def col_dtype(f: int) -> torch.dtype:
    """Dtype of the ELL column indices: int16 while every column fits (f <= 32768; half the
    bytes saved for backward), else int32."""
    return torch.int16 if f <= 32768 else torch.int32


def _block_d(d: int, block_d: Optional[int], cap: int) -> int:
    """Columns of d per step: ``block_d``, or by default d rounded up to a power of two, at most
    ``cap`` (so that a [slots, columns] tile stays near 8K fp32 values per program)."""
    if block_d is None:
        return min(triton.next_power_of_2(max(d, 1)), cap)
    if block_d < 16 or block_d & (block_d - 1):
        raise ValueError(f"block_d must be a power of two >= 16, got {block_d}")
    return block_d


def _check_same(t: torch.Tensor, name: str, ref: torch.Tensor, ref_name: str, dtype=True) -> None:
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device} but {ref_name} is on {ref.device}; they must match")
    if dtype and t.dtype != ref.dtype:
        raise TypeError(f"{name} has dtype {t.dtype} but {ref_name} has {ref.dtype}; they must match")


def _check_ell(cols: torch.Tensor, values: torch.Tensor, counts: torch.Tensor, M: int, ref: torch.Tensor, ref_name: str) -> int:
    """Validate ELL rows ``cols, values [M, W]`` and ``counts [M]``; returns W."""
    check_tensor(cols, "cols", dim=2, dtypes=(torch.int16, torch.int32))
    check_tensor(values, "values", dim=2, dtypes=KERNEL_DTYPES)
    check_tensor(counts, "counts", dim=1, dtypes=(torch.int32,))
    W = cols.shape[1]
    if tuple(cols.shape) != (M, W) or tuple(values.shape) != (M, W) or tuple(counts.shape) != (M,):
        raise ValueError(
            f"ELL rows must be cols, values [M, W] and counts [M] with M = {M}, got cols "
            f"{list(cols.shape)}, values {list(values.shape)}, counts {list(counts.shape)}"
        )
    for t, name in ((cols, "cols"), (values, "values"), (counts, "counts")):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
        _check_same(t, name, ref, ref_name, dtype=False)
    _check_same(values, "values", ref, ref_name)
    return W


def _check_rows(t: torch.Tensor, name: str, M: int, d: int, ref: Optional[torch.Tensor] = None) -> None:
    check_tensor(t, name, dim=2, dtypes=KERNEL_DTYPES)
    if tuple(t.shape) != (M, d):
        raise ValueError(f"{name} must be [M, d] = [{M}, {d}], got {list(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")
    if ref is not None:
        _check_same(t, name, ref, "x")


# ---------------------------------------------------------------------------------------------
# Pack: dense pre-activation -> ELL rows of relu
# ---------------------------------------------------------------------------------------------


@triton.jit
def _pack_rows_kernel(
    a_ptr, stride_am, col_ptr, val_ptr, cnt_ptr,
    M, f, W,
    BM: tl.constexpr, BF: tl.constexpr, BW: tl.constexpr,
):
    # BM rows, f walked BF columns at a time: each step's bit words, then its positives written
    # at once in ascending column order (twell.kernels._bits). The count keeps running past W: a
    # heavy row is marked by count > W and its slots hold its first W entries (consumers skip it).
    rows = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)
    rmask = rows < M
    a_row = a_ptr + rows * stride_am
    run = tl.zeros([BM], dtype=tl.int32)
    for c0 in range(0, f, BF):
        # active: relu'(a) != 0, a NaN included (twell.kernels._activity.fires)
        words = step_bit_words(a_row, c0, f, rmask, BF // 32)
        run += write_step_entries(words, run, c0, a_row, val_ptr + rows * W, col_ptr + rows * W, W, BF // 32)
    # Slots at and past the count are zeroed (value 0, column 0), so that no later read of a
    # whole [M, W] buffer meets unwritten memory. They are disjoint from the slots stored above.
    s_in = tl.arange(0, BW)
    for s0 in range(0, W, BW):
        s = s0 + s_in
        pad = rmask[:, None] & (s[None, :] >= run[:, None]) & (s < W)[None, :]
        off = rows[:, None] * W + s[None, :]
        tl.store(val_ptr + off, tl.zeros([BM, BW], dtype=val_ptr.dtype.element_ty), mask=pad)
        tl.store(col_ptr + off, tl.zeros([BM, BW], dtype=col_ptr.dtype.element_ty), mask=pad)
    tl.store(cnt_ptr + rows, run, mask=rmask)


def pack_rows(
    a: torch.Tensor, width: int, *, block_m: int = 4, block_f: int = 256, num_warps: int = 4
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ELL rows of ``relu(a)``: the first ``width`` positives of each row, ascending.

    Args:
        a: ``[M, f]`` pre-activation (fp32, fp16 or bf16), rows with unit stride.
        width: W, slots per row (>= 1).
        block_m, block_f, num_warps: tuning knobs (rows per program, columns per step, warps).

    Returns:
        ``(cols [M, W] int16 or int32 (see :func:`col_dtype`), values [M, W] a.dtype,
        counts [M] int32)``. ``counts`` is the true number of positives (``counts > W`` marks a
        heavy row, whose slots hold its first W entries); slots at or past the count hold
        zeros (column 0).
    """
    check_tensor(a, "a", dim=2, dtypes=KERNEL_DTYPES)
    check_launchable(a, "a")
    if a.stride(1) != 1:
        raise ValueError(f"a must have unit-stride rows, got strides {a.stride()}")
    if not isinstance(width, int) or width < 1:
        raise ValueError(f"width must be an int >= 1, got {width!r}")
    check_pow2(block_m, "block_m", 1, 64)
    check_pow2(block_f, "block_f", 32, 4096)  # whole bit words of 32 columns
    M, f = a.shape
    cols = torch.empty(M, width, dtype=col_dtype(f), device=a.device)
    values = torch.empty(M, width, dtype=a.dtype, device=a.device)
    counts = torch.empty(M, dtype=torch.int32, device=a.device)
    if M == 0:
        return cols, values, counts
    BW = min(triton.next_power_of_2(width), 256)
    with on_device_of(a):
        _pack_rows_kernel[(triton.cdiv(M, block_m),)](
            a, a.stride(0), cols, values, counts, M, f, width,
            BM=block_m, BF=block_f, BW=BW, num_warps=num_warps,
        )
    return cols, values, counts


# ---------------------------------------------------------------------------------------------
# What every row kernel does with its row: one program per token m, its slots s at flat index
# m W + s, BE at a time
# ---------------------------------------------------------------------------------------------


@triton.jit
def _light_count(cnt_ptr, m, W):
    """Used slots of row ``m`` to process: its count, or none for a heavy row (count > W),
    whose results the dense path writes."""
    cnt = tl.load(cnt_ptr + m)
    return tl.where(cnt > W, 0, cnt)


@triton.jit
def _slot_units(col_ptr, row, s, n):
    """``(valid, j)``: which slots ``s`` of the row starting at flat slot ``row`` are used (s < n)
    and their units (int64; 0 where unused)."""
    valid = s < n
    return valid, tl.load(col_ptr + row + s, mask=valid, other=0).to(tl.int64)


@triton.jit
def _unit_rows(w_ptr, stride_w, j, valid, dd, dm):
    """``[BE, columns]``: columns ``dd`` of the ``[f, d]`` weight rows of units ``j``, one
    contiguous read per unit; zeros at unused slots and columns past d."""
    return tl.load(w_ptr + j[:, None] * stride_w + dd[None, :], mask=valid[:, None] & dm[None, :], other=0.0)


@triton.jit
def _zero_unused_slots(u_ptr, row, n, W, BE: tl.constexpr):
    """u past the row's entries (all of a heavy row's) is zero: nothing reads unwritten memory."""
    for s0 in range(0, W, BE):
        s = s0 + tl.arange(0, BE)
        tl.store(u_ptr + row + s, tl.zeros([BE], dtype=u_ptr.dtype.element_ty), mask=(s >= n) & (s < W))


@triton.jit
def _slot_h(g_ptr, u_ptr, row, s, valid, GATED: tl.constexpr):
    """``(g, u, h)`` of slots ``s`` in fp32: h = g u with u as the forward stored it (gated), or
    h = g (non-gated; u is g there, unused)."""
    g = tl.load(g_ptr + row + s, mask=valid, other=0.0).to(tl.float32)
    if GATED:
        u = tl.load(u_ptr + row + s, mask=valid, other=0.0).to(tl.float32)
        h = g * u
    else:
        u = g
        h = g
    return g, u, h


@triton.jit
def _l1_sign(h):
    """sign(h), the L1 term's gradient with respect to h (0 at 0)."""
    return tl.where(h > 0, 1.0, tl.where(h < 0, -1.0, 0.0))


@triton.jit
def _store_slot_grads(dh, g, u, du_ptr, da_ptr, row, s, valid, GATED: tl.constexpr):
    """du = dh g and da = dh u (gated), or du = dh (non-gated), in fp32 for the dx launch and
    the weight gradients."""
    if GATED:
        tl.store(du_ptr + row + s, dh * g, mask=valid)
        tl.store(da_ptr + row + s, dh * u, mask=valid)
    else:
        tl.store(du_ptr + row + s, dh, mask=valid)


# ---------------------------------------------------------------------------------------------
# Forward rows: u (gated), h, y and sum |h| per token
# ---------------------------------------------------------------------------------------------


@triton.jit
def _forward_rows_kernel(
    x_ptr, stride_xm, col_ptr, g_ptr, cnt_ptr,
    wu_ptr, stride_wu, wdt_ptr, stride_wdt,
    u_ptr, y_ptr, stride_ym, l1_ptr,
    d, W,
    BE: tl.constexpr, BD: tl.constexpr, GATED: tl.constexpr,
):
    m = tl.program_id(0).to(tl.int64)
    n = _light_count(cnt_ptr, m, W)
    es = tl.arange(0, BE)
    ds = tl.arange(0, BD)
    row = m * W
    l1 = tl.sum(tl.zeros([BE], dtype=tl.float32), axis=0)
    if GATED:
        # Phase 1: u_j = x[m] . w_up[j] for each slot, BE slots at a time (each w_up row is a
        # contiguous read). u is stored rounded to the input dtype (what dense autograd keeps),
        # and h = g u is formed from that rounded u here, in phase 2 and in the backward alike.
        for s0 in range(0, n, BE):
            s = s0 + es
            valid, j = _slot_units(col_ptr, row, s, n)
            acc = tl.zeros([BE], dtype=tl.float32)
            for d0 in range(0, d, BD):
                dd = d0 + ds
                dm = dd < d
                xv = tl.load(x_ptr + m * stride_xm + dd, mask=dm, other=0.0).to(tl.float32)
                w = _unit_rows(wu_ptr, stride_wu, j, valid, dd, dm)
                acc += tl.sum(w.to(tl.float32) * xv[None, :], axis=1)
            u = acc.to(u_ptr.dtype.element_ty)
            tl.store(u_ptr + row + s, u, mask=valid)
            g = tl.load(g_ptr + row + s, mask=valid, other=0.0).to(tl.float32)
            l1 += tl.sum(tl.abs(g * u.to(tl.float32)), axis=0)
        _zero_unused_slots(u_ptr, row, n, W, BE)
        tl.debug_barrier()  # phase 2 reads u that other threads of this program stored
    else:
        for s0 in range(0, n, BE):
            s = s0 + es
            l1 += tl.sum(tl.abs(tl.load(g_ptr + row + s, mask=s < n, other=0.0).to(tl.float32)), axis=0)
    # Phase 2: y[m] = sum_j h_j w_down^T[j], one d block at a time (a contiguous read per slot).
    for d0 in range(0, d, BD):
        dd = d0 + ds
        dm = dd < d
        acc_y = tl.zeros([BD], dtype=tl.float32)
        for s0 in range(0, n, BE):
            s = s0 + es
            valid, j = _slot_units(col_ptr, row, s, n)
            h = tl.load(g_ptr + row + s, mask=valid, other=0.0).to(tl.float32)
            if GATED:
                h = h * tl.load(u_ptr + row + s, mask=valid, other=0.0).to(tl.float32)
            w = _unit_rows(wdt_ptr, stride_wdt, j, valid, dd, dm)
            acc_y += tl.sum(h[:, None] * w.to(tl.float32), axis=0)
        tl.store(y_ptr + m * stride_ym + dd, acc_y.to(y_ptr.dtype.element_ty), mask=dm)
    tl.store(l1_ptr + m, l1)


@triton.jit
def _rows_up_kernel(
    x_ptr, stride_xm, col_ptr, cnt_ptr, wu_ptr, stride_wu, u_ptr,
    d, W,
    BE: tl.constexpr, D: tl.constexpr,
):
    # Gated forward, first launch: u_j = x[m] . w_up[j] for each slot, the whole row of d in
    # registers, BE slots at a time (each w_up row one contiguous read). u is stored rounded to
    # the input dtype (what dense autograd keeps); h = g u is formed from that rounded u in the
    # second launch and in the backward alike. Two launches, one weight matrix each: each
    # launch's gathered rows (23 MB at f 5632, d 2048) fit in the H200's L2, which the two
    # together do not.
    m = tl.program_id(0).to(tl.int64)
    n = _light_count(cnt_ptr, m, W)
    es = tl.arange(0, BE)
    dd = tl.arange(0, D)
    dm = dd < d
    row = m * W
    x = tl.load(x_ptr + m * stride_xm + dd, mask=dm, other=0.0).to(tl.float32)
    for s0 in range(0, n, BE):
        s = s0 + es
        valid, j = _slot_units(col_ptr, row, s, n)
        w = _unit_rows(wu_ptr, stride_wu, j, valid, dd, dm)
        u = tl.sum(w.to(tl.float32) * x[None, :], axis=1).to(u_ptr.dtype.element_ty)
        tl.store(u_ptr + row + s, u, mask=valid)
    _zero_unused_slots(u_ptr, row, n, W, BE)


@triton.jit
def _rows_down_kernel(
    col_ptr, g_ptr, u_ptr, cnt_ptr, wdt_ptr, stride_wdt,
    y_ptr, stride_ym, l1_ptr,
    d, W,
    BE: tl.constexpr, D: tl.constexpr, GATED: tl.constexpr,
):
    # Forward, second launch (the only one non-gated): y[m] = sum_j h_j w_down^T[j] with
    # h = g u (gated) or the stored h, and the row's sum of |h|.
    m = tl.program_id(0).to(tl.int64)
    n = _light_count(cnt_ptr, m, W)
    es = tl.arange(0, BE)
    dd = tl.arange(0, D)
    dm = dd < d
    row = m * W
    acc = tl.zeros([D], dtype=tl.float32)
    l1 = tl.sum(tl.zeros([BE], dtype=tl.float32), axis=0)
    for s0 in range(0, n, BE):
        s = s0 + es
        valid, j = _slot_units(col_ptr, row, s, n)
        h = tl.load(g_ptr + row + s, mask=valid, other=0.0).to(tl.float32)
        if GATED:
            h = h * tl.load(u_ptr + row + s, mask=valid, other=0.0).to(tl.float32)
        l1 += tl.sum(tl.abs(h), axis=0)
        wd = _unit_rows(wdt_ptr, stride_wdt, j, valid, dd, dm)
        acc += tl.sum(h[:, None] * wd.to(tl.float32), axis=0)
    tl.store(y_ptr + m * stride_ym + dd, acc.to(y_ptr.dtype.element_ty), mask=dm)
    tl.store(l1_ptr + m, l1)


# Rows of d up to this many columns are held whole in registers (the whole-row kernels: one
# launch per weight matrix, each row's slots read once per launch).
FULL_D_MAX = 4096


def _full_d(d: int, block_d: Optional[int]) -> Optional[int]:
    """The whole-row kernels' D (d rounded up to a power of two) when block_d is None and d fits."""
    D = triton.next_power_of_2(max(d, 1))
    return D if block_d is None and D <= FULL_D_MAX else None


def ffn_rows_forward(
    x: torch.Tensor,
    cols: torch.Tensor,
    values: torch.Tensor,
    counts: torch.Tensor,
    w_down_t: torch.Tensor,
    w_up: Optional[torch.Tensor] = None,
    *,
    block_e: int = 16,
    block_d: Optional[int] = None,
    num_warps: int = 4,
) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """FFN forward of the light ELL rows.

    Args:
        x: ``[M, d]`` contiguous tokens (fp32, fp16 or bf16).
        cols, values, counts: ELL rows from :func:`pack_rows` (values: the gate g if gated, else
            h = relu(x w_up^T)); rows with ``counts > W`` are skipped.
        w_down_t: ``[f, d]`` = ``w_down.t().contiguous()``; w_up: ``[f, d]`` (gated) or None.
        block_e, block_d, num_warps: tuning knobs (slots per step, d columns per step, warps).

    Returns:
        ``(y [M, d] x.dtype, u [M, W] x.dtype or None if non-gated, l1_rows [M] fp32)`` with
        ``l1_rows[m] = sum_j |h[m, j]|``. Heavy rows get zeros in y, u and l1_rows.
    """
    check_tensor(x, "x", dim=2, dtypes=KERNEL_DTYPES)
    M, d = x.shape
    if not x.is_contiguous():
        raise ValueError(f"x must be contiguous, got strides {x.stride()}")
    W = _check_ell(cols, values, counts, M, x, "x")
    check_tensor(w_down_t, "w_down_t", dim=2, dtypes=KERNEL_DTYPES)
    f = w_down_t.shape[0]
    check_weight_rows(w_down_t, "w_down_t", f, d, x)
    check_weight_rows(w_up, "w_up", f, d, x)
    check_launchable(x, "x")
    check_pow2(block_e, "block_e", 1, 256)
    BD = _block_d(d, block_d, 512)
    gated = w_up is not None
    y = torch.empty(M, d, dtype=x.dtype, device=x.device)
    u = torch.empty(M, W, dtype=x.dtype, device=x.device) if gated else None
    l1_rows = torch.empty(M, dtype=torch.float32, device=x.device)
    if M == 0:
        return y, u, l1_rows
    wu = w_up if gated else w_down_t  # an unused pointer when non-gated
    D = _full_d(d, block_d)
    if D is not None:
        with on_device_of(x):
            if gated:
                _rows_up_kernel[(M,)](
                    x, x.stride(0), cols, counts, w_up, w_up.stride(0), u,
                    d, W, BE=block_e, D=D, num_warps=num_warps,
                )
            _rows_down_kernel[(M,)](
                cols, values, u if gated else values, counts, w_down_t, w_down_t.stride(0),
                y, y.stride(0), l1_rows,
                d, W, BE=block_e, D=D, GATED=gated, num_warps=num_warps,
            )
        return y, u, l1_rows
    with on_device_of(x):
        _forward_rows_kernel[(M,)](
            x, x.stride(0), cols, values, counts,
            wu, wu.stride(0), w_down_t, w_down_t.stride(0),
            u if gated else l1_rows, y, y.stride(0), l1_rows,
            d, W,
            BE=block_e, BD=BD, GATED=gated, num_warps=num_warps,
        )
    return y, u, l1_rows


# ---------------------------------------------------------------------------------------------
# Backward rows: dh on the pattern, du, da per slot, dx
# ---------------------------------------------------------------------------------------------


@triton.jit
def _backward_rows_kernel(
    dy_ptr, stride_dym, col_ptr, g_ptr, u_ptr, cnt_ptr,
    wdt_ptr, stride_wdt, wu_ptr, stride_wu, wg_ptr, stride_wg,
    c_ptr, du_ptr, da_ptr, dx_ptr, stride_dxm,
    d, W,
    BE: tl.constexpr, BD: tl.constexpr, GATED: tl.constexpr,
):
    m = tl.program_id(0).to(tl.int64)
    n = _light_count(cnt_ptr, m, W)
    es = tl.arange(0, BE)
    ds = tl.arange(0, BD)
    row = m * W
    c = tl.load(c_ptr)  # d loss / d l1, divided by M: read on the device, no host sync
    # Phase 1: dh_j = dy[m] . w_down^T[j] + c sign(h_j) (the sampled product: only the row's
    # slots), then du = dh g and da = dh u (gated; non-gated: du = dh).
    for s0 in range(0, n, BE):
        s = s0 + es
        valid, j = _slot_units(col_ptr, row, s, n)
        acc = tl.zeros([BE], dtype=tl.float32)
        for d0 in range(0, d, BD):
            dd = d0 + ds
            dm = dd < d
            dyv = tl.load(dy_ptr + m * stride_dym + dd, mask=dm, other=0.0).to(tl.float32)
            w = _unit_rows(wdt_ptr, stride_wdt, j, valid, dd, dm)
            acc += tl.sum(w.to(tl.float32) * dyv[None, :], axis=1)
        g, u, h = _slot_h(g_ptr, u_ptr, row, s, valid, GATED)
        _store_slot_grads(acc + c * _l1_sign(h), g, u, du_ptr, da_ptr, row, s, valid, GATED)
    tl.debug_barrier()  # phase 2 reads du, da that other threads of this program stored
    # Phase 2: dx[m] = sum_j du_j w_up[j] + da_j w_gate[j], one d block at a time.
    for d0 in range(0, d, BD):
        dd = d0 + ds
        dm = dd < d
        acc_x = tl.zeros([BD], dtype=tl.float32)
        for s0 in range(0, n, BE):
            s = s0 + es
            valid, j = _slot_units(col_ptr, row, s, n)
            du = tl.load(du_ptr + row + s, mask=valid, other=0.0)
            wu = _unit_rows(wu_ptr, stride_wu, j, valid, dd, dm)
            acc_x += tl.sum(du[:, None] * wu.to(tl.float32), axis=0)
            if GATED:
                da = tl.load(da_ptr + row + s, mask=valid, other=0.0)
                wg = _unit_rows(wg_ptr, stride_wg, j, valid, dd, dm)
                acc_x += tl.sum(da[:, None] * wg.to(tl.float32), axis=0)
        tl.store(dx_ptr + m * stride_dxm + dd, acc_x.to(dx_ptr.dtype.element_ty), mask=dm)


@triton.jit
def _rows_dh_kernel(
    dy_ptr, stride_dym, col_ptr, g_ptr, u_ptr, cnt_ptr, wdt_ptr, stride_wdt,
    c_ptr, du_ptr, da_ptr,
    d, W,
    BE: tl.constexpr, D: tl.constexpr, GATED: tl.constexpr,
):
    # Backward, first launch (w_down^T only): dh_j = dy[m] . w_down^T[j] + c sign(h_j) for each
    # slot, the whole row of d in registers; du = dh g and da = dh u (gated), du = dh
    # (non-gated), stored in fp32 for the second launch and the weight gradients.
    m = tl.program_id(0).to(tl.int64)
    n = _light_count(cnt_ptr, m, W)
    es = tl.arange(0, BE)
    dd = tl.arange(0, D)
    dm = dd < d
    row = m * W
    c = tl.load(c_ptr)  # d loss / d l1, divided by M: read on the device, no host sync
    dyv = tl.load(dy_ptr + m * stride_dym + dd, mask=dm, other=0.0).to(tl.float32)
    for s0 in range(0, n, BE):
        s = s0 + es
        valid, j = _slot_units(col_ptr, row, s, n)
        wd = _unit_rows(wdt_ptr, stride_wdt, j, valid, dd, dm)
        g, u, h = _slot_h(g_ptr, u_ptr, row, s, valid, GATED)
        sign = _l1_sign(h)
        dh = tl.sum(wd.to(tl.float32) * dyv[None, :], axis=1) + c * sign
        _store_slot_grads(dh, g, u, du_ptr, da_ptr, row, s, valid, GATED)


@triton.jit
def _rows_dx_kernel(
    col_ptr, du_ptr, da_ptr, cnt_ptr, wu_ptr, stride_wu, wg_ptr, stride_wg,
    dx_ptr, stride_dxm,
    d, W,
    BE: tl.constexpr, D: tl.constexpr, GATED: tl.constexpr,
):
    # Backward, second launch: dx[m] = sum_j du_j w_up[j] + da_j w_gate[j] (gated) or
    # sum_j du_j w_up[j] (non-gated), the whole row of d in registers.
    m = tl.program_id(0).to(tl.int64)
    n = _light_count(cnt_ptr, m, W)
    es = tl.arange(0, BE)
    dd = tl.arange(0, D)
    dm = dd < d
    row = m * W
    acc = tl.zeros([D], dtype=tl.float32)
    for s0 in range(0, n, BE):
        s = s0 + es
        valid, j = _slot_units(col_ptr, row, s, n)
        du = tl.load(du_ptr + row + s, mask=valid, other=0.0)
        wu = _unit_rows(wu_ptr, stride_wu, j, valid, dd, dm)
        if GATED:
            da = tl.load(da_ptr + row + s, mask=valid, other=0.0)
            wg = _unit_rows(wg_ptr, stride_wg, j, valid, dd, dm)
            acc += tl.sum(du[:, None] * wu.to(tl.float32) + da[:, None] * wg.to(tl.float32), axis=0)
        else:
            acc += tl.sum(du[:, None] * wu.to(tl.float32), axis=0)
    tl.store(dx_ptr + m * stride_dxm + dd, acc.to(dx_ptr.dtype.element_ty), mask=dm)


def ffn_rows_backward(
    dy: torch.Tensor,
    cols: torch.Tensor,
    values: torch.Tensor,
    u: Optional[torch.Tensor],
    counts: torch.Tensor,
    w_down_t: torch.Tensor,
    w_up: torch.Tensor,
    w_gate: Optional[torch.Tensor],
    l1_scale: torch.Tensor,
    *,
    block_e: int = 16,
    block_d: Optional[int] = None,
    num_warps: int = 4,
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """FFN backward of the light ELL rows: dx and the per-slot gradients.

    Args:
        dy: ``[M, d]`` contiguous gradient of y.
        cols, values, counts: the forward's ELL rows (values: g gated, h non-gated);
        u: ``[M, W]`` from :func:`ffn_rows_forward` (gated) or None (non-gated).
        w_down_t: ``[f, d]``; w_up: ``[f, d]``; w_gate: ``[f, d]`` (gated) or None.
        l1_scale: one-element fp32 tensor ``c``, added as ``c sign(h)`` to dh (the gradient of
            the loss with respect to l1, divided by M).
        block_e, block_d, num_warps: tuning knobs.

    Returns:
        ``(dx [M, d] dy.dtype, du [M, W] fp32, da [M, W] fp32 or None)``: du = dh g, da = dh u
        (gated) or du = dh (non-gated), written only at the light rows' used slots.
        Heavy rows get zero dx rows.
    """
    check_tensor(dy, "dy", dim=2, dtypes=KERNEL_DTYPES)
    M, d = dy.shape
    if not dy.is_contiguous():
        raise ValueError(f"dy must be contiguous, got strides {dy.stride()}")
    W = _check_ell(cols, values, counts, M, dy, "dy")
    gated = w_gate is not None
    if gated != (u is not None):
        raise ValueError("pass u and w_gate together (gated) or neither (non-gated)")
    if gated:
        check_tensor(u, "u", dim=2, dtypes=KERNEL_DTYPES)
        if u.shape != values.shape or not u.is_contiguous():
            raise ValueError(f"u must be contiguous {list(values.shape)}, got {list(u.shape)}")
        _check_same(u, "u", dy, "dy")
    check_tensor(w_down_t, "w_down_t", dim=2, dtypes=KERNEL_DTYPES)
    f = w_down_t.shape[0]
    check_tensor(w_up, "w_up", dim=2, dtypes=KERNEL_DTYPES)  # required: the up rows (the first projection non-gated)
    for w, name in ((w_down_t, "w_down_t"), (w_up, "w_up"), (w_gate, "w_gate")):
        check_weight_rows(w, name, f, d, dy)
    check_tensor(l1_scale, "l1_scale", dtypes=(torch.float32,))
    if l1_scale.numel() != 1:
        raise ValueError(f"l1_scale must hold one value, got shape {list(l1_scale.shape)}")
    _check_same(l1_scale, "l1_scale", dy, "dy", dtype=False)
    check_launchable(dy, "dy")
    check_pow2(block_e, "block_e", 1, 256)
    BD = _block_d(d, block_d, 512)
    dx = torch.empty(M, d, dtype=dy.dtype, device=dy.device)
    du = torch.empty(M, W, dtype=torch.float32, device=dy.device)
    da = torch.empty(M, W, dtype=torch.float32, device=dy.device) if gated else None
    if M == 0:
        return dx, du, da
    wg = w_gate if gated else w_up
    D = _full_d(d, block_d)
    if D is not None:
        with on_device_of(dy):
            _rows_dh_kernel[(M,)](
                dy, dy.stride(0), cols, values, u if gated else values, counts, w_down_t, w_down_t.stride(0),
                l1_scale, du, da if gated else du,
                d, W, BE=block_e, D=D, GATED=gated, num_warps=num_warps,
            )
            _rows_dx_kernel[(M,)](
                cols, du, da if gated else du, counts, w_up, w_up.stride(0), wg, wg.stride(0),
                dx, dx.stride(0),
                d, W, BE=block_e, D=D, GATED=gated, num_warps=num_warps,
            )
        return dx, du, da
    with on_device_of(dy):
        _backward_rows_kernel[(M,)](
            dy, dy.stride(0), cols, values, u if gated else values, counts,
            w_down_t, w_down_t.stride(0), w_up, w_up.stride(0), wg, wg.stride(0),
            l1_scale, du, da if gated else du, dx, dx.stride(0),
            d, W,
            BE=block_e, BD=BD, GATED=gated, num_warps=num_warps,
        )
    return dx, du, da


# ---------------------------------------------------------------------------------------------
# Weight gradients: per unit, over the light rows' slots that hold it
# ---------------------------------------------------------------------------------------------


@triton.jit
def _weight_grads_kernel(
    order_ptr, off_ptr, units_ptr,
    x_ptr, stride_xm, dy_ptr, stride_dym,
    du_ptr, da_ptr, g_ptr, u_ptr,
    dwu_ptr, dwg_ptr, dwdt_ptr,
    d, W,
    BT: tl.constexpr, BD: tl.constexpr, GATED: tl.constexpr, HAS_BASE: tl.constexpr,
    X_PART: tl.constexpr, DY_PART: tl.constexpr, BY_LIST: tl.constexpr,
):
    # Unit j, columns [d0, d0 + BD): BT of its (token, slot) pairs at a time, each gathering a
    # contiguous piece of x[m] and dy[m]:
    #   dw_up[j] += du x[m],  dw_gate[j] += da x[m]          (X_PART)
    #   dw_down^T[j] += h dy[m]                               (DY_PART)
    # One launch may do both parts, or one each: then each launch gathers from one [M, d]
    # matrix, a working set half as large for L2.
    # A unit with no light slot still stores (zeros, or the base): every output row is written
    # (with BY_LIST, when units is a permutation).
    # BY_LIST: program i takes unit units[i] (the caller's order: longest first, so that no long
    # unit starts last and runs alone at the end of the launch).
    if BY_LIST:
        j = tl.load(units_ptr + tl.program_id(0)).to(tl.int64)
    else:
        j = tl.program_id(0).to(tl.int64)
    dd = tl.program_id(1) * BD + tl.arange(0, BD)
    dm = dd < d
    start = tl.load(off_ptr + j)
    end = tl.load(off_ptr + j + 1)
    ts = tl.arange(0, BT)
    acc_u = tl.zeros([BD], dtype=tl.float32)
    acc_g = tl.zeros([BD], dtype=tl.float32)
    acc_d = tl.zeros([BD], dtype=tl.float32)
    for p0 in range(start, end, BT):
        p = p0 + ts
        pm = p < end
        flat = tl.load(order_ptr + p, mask=pm, other=0)
        m = flat // W
        mask = pm[:, None] & dm[None, :]
        if X_PART:
            xr = tl.load(x_ptr + m[:, None] * stride_xm + dd[None, :], mask=mask, other=0.0).to(tl.float32)
            du = tl.load(du_ptr + flat, mask=pm, other=0.0)
            acc_u += tl.sum(du[:, None] * xr, axis=0)
            if GATED:
                da = tl.load(da_ptr + flat, mask=pm, other=0.0)
                acc_g += tl.sum(da[:, None] * xr, axis=0)
        if DY_PART:
            dyr = tl.load(dy_ptr + m[:, None] * stride_dym + dd[None, :], mask=mask, other=0.0).to(tl.float32)
            h = tl.load(g_ptr + flat, mask=pm, other=0.0).to(tl.float32)
            if GATED:
                h = h * tl.load(u_ptr + flat, mask=pm, other=0.0).to(tl.float32)
            acc_d += tl.sum(h[:, None] * dyr, axis=0)
    out = j * d + dd
    if X_PART:
        if HAS_BASE:  # the heavy rows' dense contribution, already in the output buffers
            acc_u += tl.load(dwu_ptr + out, mask=dm, other=0.0).to(tl.float32)
            if GATED:
                acc_g += tl.load(dwg_ptr + out, mask=dm, other=0.0).to(tl.float32)
        tl.store(dwu_ptr + out, acc_u.to(dwu_ptr.dtype.element_ty), mask=dm)
        if GATED:
            tl.store(dwg_ptr + out, acc_g.to(dwg_ptr.dtype.element_ty), mask=dm)
    if DY_PART:
        if HAS_BASE:
            acc_d += tl.load(dwdt_ptr + out, mask=dm, other=0.0).to(tl.float32)
        tl.store(dwdt_ptr + out, acc_d.to(dwdt_ptr.dtype.element_ty), mask=dm)


def ffn_weight_grads(
    order: torch.Tensor,
    offsets: torch.Tensor,
    x: torch.Tensor,
    dy: torch.Tensor,
    values: torch.Tensor,
    u: Optional[torch.Tensor],
    du: torch.Tensor,
    da: Optional[torch.Tensor],
    *,
    base: Optional[tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]] = None,
    dtype: Optional[torch.dtype] = None,
    block_t: int = 16,
    block_d: Optional[int] = None,
    num_warps: int = 4,
    split: bool = False,
    units: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """Weight gradients from the light rows' slots, unit by unit.

    Args:
        order, offsets: from :func:`twell.kernels.train_index.unit_index` (f = ``offsets.numel() - 1``).
        x, dy: ``[M, d]`` contiguous; values ``[M, W]`` (g gated, h non-gated); u ``[M, W]``
            or None (non-gated); du, da ``[M, W]`` fp32 from :func:`ffn_rows_backward`.
        base: optional ``(dw_up, dw_gate or None, dw_down_t)`` ``[f, d]`` contiguous tensors of
            ``dtype`` holding a contribution to add to (the heavy rows'); they are updated in
            place and returned.
        dtype: dtype of the outputs (default x.dtype).
        block_t, block_d, num_warps: tuning knobs (pairs per step, d columns per program, warps).
        split: two launches, one gathering x rows (dw_up, dw_gate), one gathering dy rows
            (dw_down^T), instead of one gathering both: the same sums in the same order, each
            launch's gathers from half the memory (which L2 holds better).
        units: optional ``[f]`` int64, a permutation of the units: the order in which the
            programs take them (the schedule of :func:`twell.kernels.train_index.heavy_and_hot`,
            longest first). Only which program takes which unit changes, not the sums. Its
            dtype, shape and device are checked, not that it is a permutation (that would cost
            a launch and a sync): a unit missing from it leaves its rows unwritten, one listed
            twice is written by two programs at once.

    Returns:
        ``(dw_up [f, d], dw_gate [f, d] or None (non-gated), dw_down_t [f, d])`` where
        ``dw_down_t`` is the transpose of the gradient of ``w_down [d, f]``.
    """
    check_tensor(x, "x", dim=2, dtypes=KERNEL_DTYPES)
    M, d = x.shape
    _check_rows(x, "x", M, d)
    _check_rows(dy, "dy", M, d, x)
    check_tensor(values, "values", dim=2, dtypes=KERNEL_DTYPES)
    W = values.shape[1]
    gated = u is not None
    if gated != (da is not None):
        raise ValueError("pass u and da together (gated) or neither (non-gated)")
    for t, name, dts in ((values, "values", KERNEL_DTYPES), (u, "u", KERNEL_DTYPES), (du, "du", (torch.float32,)), (da, "da", (torch.float32,))):
        if t is None:
            continue
        check_tensor(t, name, dim=2, dtypes=dts)
        if tuple(t.shape) != (M, W) or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous [M, W] = [{M}, {W}], got {list(t.shape)}")
        _check_same(t, name, x, "x", dtype=False)
    check_tensor(order, "order", dim=1, dtypes=(torch.int64,))
    check_tensor(offsets, "offsets", dim=1, dtypes=(torch.int64,))
    if order.numel() != M * W or offsets.numel() < 1:
        raise ValueError(f"order must hold M W = {M * W} slots and offsets f + 1 values, got {order.numel()} and {offsets.numel()}")
    f = offsets.numel() - 1
    dtype = dtype or x.dtype
    if dtype not in KERNEL_DTYPES:
        raise TypeError(f"dtype must be one of {KERNEL_DTYPES}, got {dtype}")
    if base is not None:
        for t, name in zip(base, ("dw_up", "dw_gate", "dw_down_t")):
            if t is None and name == "dw_gate" and not gated:
                continue
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != (f, d) or t.dtype != dtype or not t.is_contiguous() or t.device != x.device:
                raise ValueError(f"base {name} must be a contiguous [{f}, {d}] {dtype} tensor on {x.device}")
        dwu, dwg, dwdt = base
    else:
        dwu = torch.empty(f, d, dtype=dtype, device=x.device)
        dwg = torch.empty(f, d, dtype=dtype, device=x.device) if gated else None
        dwdt = torch.empty(f, d, dtype=dtype, device=x.device)
    if units is not None:
        check_tensor(units, "units", dim=1, dtypes=(torch.int64,))
        if units.numel() != f or not units.is_contiguous() or units.device != x.device:
            raise ValueError(f"units must be a contiguous [f] = [{f}] int64 permutation on {x.device}, got {list(units.shape)} on {units.device}")
    check_launchable(x, "x")
    check_pow2(block_t, "block_t", 1, 256)
    BD = _block_d(d, block_d, 256)
    if f == 0 or d == 0:
        return dwu, dwg, dwdt
    # the whole row of d in one step where it fits (one program per unit: x[m] and dy[m] are
    # gathered once for all of d), else blocks of d
    BD = _full_d(d, block_d) or BD
    parts = ((True, False), (False, True)) if split else ((True, True),)
    with on_device_of(x):
        for x_part, dy_part in parts:
            _weight_grads_kernel[(f, triton.cdiv(d, BD))](
                order, offsets, offsets if units is None else units, x, x.stride(0), dy, dy.stride(0),
                du, da if gated else du, values, u if gated else values,
                dwu, dwg if gated else dwu, dwdt,
                d, W,
                BT=block_t, BD=BD, GATED=gated, HAS_BASE=base is not None,
                X_PART=x_part, DY_PART=dy_part, BY_LIST=units is not None, num_warps=num_warps,
            )
    return dwu, dwg, dwdt


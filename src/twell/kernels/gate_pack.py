"""Gate with pack: ``relu(x w^T)`` written into TwELL.

Two implementations of the same op, both exact for every input:

``pack_relu(a)``
    The unfused variant: cuBLAS computes the pre-activation ``a = x w^T [M, f]`` (a plain
    ``torch.mm``) and one light Triton pass reads it once and writes the TwELL (each program
    packs ``BM`` rows of one tile). The dense ``a`` stays available to the consumer, which
    reads overflowed tiles from it instead of recomputing them. Two pack kernels: ``bits``
    (the default) turns every 32 columns into a bit word and writes the entries of each step
    of columns from its words at once; ``scan`` finds each entry by a min-reduction over a block
    of columns.

``gate_pack_fused(x, w)``
    The fused variant: a Triton matmul whose output tile is one TwELL tile (``BN = tile``)
    packs in its epilogue, so ``a`` never goes to memory. Overflowed tiles must then be
    recomputed from ``x`` and ``w`` by the consumer.

``gate_pack_persistent(x, w)``
    The same epilogue on a persistent matmul that loads its operands through tensor
    descriptors (TMA on Hopper): one program per SM walks the output tiles in grouped order.
    Checked on the H200 in bf16 and timed: its matmul alone
    reaches 0.89 to 0.94 of cuBLAS, but the epilogue, which nothing overlaps, costs as much as
    the separate pack pass or more, so it loses to cuBLAS + pack from M 16384: an opt-in.

Which one is faster is measured: on the H200 here the plain
pointer-load Triton matmul runs below cuBLAS, so the unfused variant is the default.

Layout written (see :class:`twell.format.TwELL`): ``values [M, n_tiles, slots]`` (same dtype as
the input), ``cols [M, n_tiles, slots]`` int16 within the tile, ``counts [M, n_tiles]`` int32,
the true count (``counts > slots`` marks overflow; the slots of such tiles are unspecified:
consumers recompute them). Entries are in ascending column order within a tile.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from ..checks import KERNEL_DTYPES, check_config, check_launchable, check_tensor
from ..format import TwELL, _check_tile, twell_slots
from ._activity import fires
from ._dot import dot_operand, dot_precision
from ._bits import step_bit_words, write_hot_values, write_step_entries
from ._launch import on_device_of
from .hot_units import HotUnits

__all__ = ["pack_relu", "pack_relu_hot", "gate_pack_fused", "gate_pack_persistent", "empty_twell"]


def empty_twell(M: int, f: int, tile: int, compression: int, dtype, device) -> TwELL:
    """Unwritten TwELL buffers for an ``[M, f]`` matrix (``overflow_values`` left None)."""
    _check_tile(tile, compression)
    n_tiles = math.ceil(f / tile)  # none for f = 0 (TwELL.validate and ffn_from_twell expect that)
    slots = twell_slots(tile, compression)
    values = torch.empty(M, n_tiles, slots, dtype=dtype, device=device)
    cols = torch.empty(M, n_tiles, slots, dtype=torch.int16, device=device)
    counts = torch.empty(M, n_tiles, dtype=torch.int32, device=device)
    return TwELL(values, cols, counts, f, tile, compression)


# ---------------------------------------------------------------------------------------------
# Light pack pass over a dense pre-activation
# ---------------------------------------------------------------------------------------------


@triton.jit
def _pack_relu_kernel(
    a_ptr, stride_am,
    val_ptr, col_ptr, cnt_ptr,
    M, f, SLOTS, N_TILES,
    TILE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
):
    # No prefix sum and no scatter of a [BM, BN] block: the compiler would route the block's
    # store pointers through shared memory (measured: 1.7 ms for a 1.5 GB pre-activation). The
    # s-th entry of each row is found as the smallest non-zero column past the (s-1)-th, one
    # [BM] store per step, as many steps as the fullest row of the block has entries.
    pid_m = tl.program_id(0)
    t = tl.program_id(1)
    rows = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    rmask = rows < M
    run = tl.zeros([BM], dtype=tl.int32)  # non-zeros seen so far in this (row, tile)
    out_row = rows * (N_TILES * SLOTS) + t * SLOTS
    cin = tl.arange(0, BN)
    width = tl.minimum(TILE, f - t * TILE)
    for c0 in range(0, width, BN):
        gcol = t * TILE + c0 + cin
        mask = rmask[:, None] & ((c0 + cin) < width)[None, :]
        a = tl.load(a_ptr + rows[:, None] * stride_am + gcol[None, :], mask=mask, other=0.0)
        nz = fires(a) & mask
        n_c = tl.sum(nz.to(tl.int32), axis=1)
        # an overflowing (row, tile) keeps no entries: consumers recompute it anyway
        n_write = tl.where(run + n_c > SLOTS, 0, n_c)
        prev = tl.full([BM], -1, dtype=tl.int32)
        for s in range(0, tl.max(n_write, axis=0)):
            cand = tl.where(nz & (cin[None, :] > prev[:, None]), cin[None, :], BN)
            col = tl.min(cand, axis=1)
            ok = s < n_write
            v = tl.load(a_ptr + rows * stride_am + t * TILE + c0 + col, mask=ok, other=0.0)
            tl.store(val_ptr + out_row + run + s, v, mask=ok)
            tl.store(col_ptr + out_row + run + s, (c0 + col).to(tl.int16), mask=ok)
            prev = col
        run += n_c
    tl.store(cnt_ptr + rows * N_TILES + t, run, mask=rmask)


@triton.jit
def _pack_relu_bits_kernel(
    a_ptr, stride_am,
    val_ptr, col_ptr, cnt_ptr,
    hw_ptr, hstart_ptr, hunits_ptr, hot_ptr, n_hot,
    M, f, SLOTS, N_TILES,
    TILE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, HOT: tl.constexpr, HOT_TIMES_UP: tl.constexpr,
    HB: tl.constexpr,
):
    # One pass over (BM rows, tile) in steps of BN columns: each step's bit words, then its
    # entries written at once (twell.kernels._bits). Slots past SLOTS belong to a tile that
    # overflows: its count says so and consumers recompute it without reading its slots.
    # HOT: the hot units' bits (hw_ptr, twell.kernels.hot_units) are taken out of the words, so
    # the TwELL and its counts hold the cold units only, and every hot unit's relu(a) goes to row
    # r's place in hot_ptr ([M, n_hot]; HOT_TIMES_UP: times the up projection held there).
    pid_m = tl.program_id(0)
    t = tl.program_id(1)
    rows = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    rmask = rows < M
    width = tl.minimum(TILE, f - t * TILE)
    a_row = a_ptr + rows * stride_am + t * TILE
    out_row = rows * (N_TILES * SLOTS) + t * SLOTS
    run = tl.zeros([BM], dtype=tl.int32)  # entries of the row so far in this tile
    for c0 in range(0, width, BN):
        words = step_bit_words(a_row, c0, width, rmask, BN // 32)
        if HOT:
            n_words = (f + 31) // 32
            w0 = (t * TILE + c0) // 32
            w_idx = w0 + tl.arange(0, BN // 32)
            hw = tl.load(hw_ptr + w_idx, mask=w_idx < n_words, other=0)
            lo = tl.load(hstart_ptr + w0)
            hi = tl.load(hstart_ptr + tl.minimum(w0 + BN // 32, n_words))
            write_hot_values(lo, hi, hunits_ptr, a_ptr + rows * stride_am, hot_ptr + rows * n_hot, rmask, HOT_TIMES_UP, HB)
            words = words & ~hw[None, :]
        run += write_step_entries(words, run, c0, a_row, val_ptr + out_row, col_ptr + out_row, SLOTS, BN // 32)
    tl.store(cnt_ptr + rows * N_TILES + t, run, mask=rmask)


def _check_pre(a: torch.Tensor, name: str) -> None:
    check_tensor(a, name, dim=2, dtypes=KERNEL_DTYPES)
    check_launchable(a, name)


# (rows per program, columns per step, warps), from the H200 variant sweeps. The bit-word pack
# takes one row per program up to PACK_BITS_SMALL_M rows (more programs for a small call: 1024
# programs of four rows left 4096 rows latency-bound), two rows in steps of 512 columns from
# there. The one-pass kernel, k 29: 0.088 ms at 16384 rows and 0.597 at 131072, against 0.093
# and 0.624 for two rows of 256 columns, 0.646 (131072) for one row, 0.681 for four; 1024 columns
# were within 3% either way. One warp beat two at every size.
PACK_CONFIG: tuple[int, int, int] = (4, 256, 2)
PACK_BITS_CONFIG: tuple[int, int, int] = (2, 512, 1)
PACK_BITS_SMALL_M_CONFIG: tuple[int, int, int] = (1, 256, 1)
PACK_BITS_SMALL_M = 8192
# hot units' values written per round (pack_relu_hot): a step's hot units are consecutive places
# of the hot set, so a round is one contiguous [rows, HOT_BLOCK] load of up and store of h
HOT_BLOCK = 32


def bits_config(M: int) -> tuple[int, int, int]:
    """The bit-word pack's default ``(rows per program, columns per step, warps)`` for ``M`` rows."""
    return PACK_BITS_SMALL_M_CONFIG if M <= PACK_BITS_SMALL_M else PACK_BITS_CONFIG


def pack_relu(
    a: torch.Tensor, tile: int = 256, compression: int = 4, method: str = "auto", config: Optional[tuple[int, int, int]] = None,
    _hot: Optional[tuple[HotUnits, torch.Tensor, bool]] = None,
) -> TwELL:
    """Pack ``relu(a)`` into TwELL with one pass over ``a``.

    Args:
        a: ``[M, f]`` pre-activation (float16, bfloat16 or float32), e.g. ``x @ w_gate.T`` from
            cuBLAS. Its last dimension must be contiguous.
        tile: TwELL tile width T (a power of two); compression: C in {2, 4, 8}.
        method: ``"bits"``: one bit word per 32 columns, each step's entries written from
            its words (needs tile >= 32); ``"scan"``: the s-th entry of each row found by a
            min-reduction over the current block of columns. ``"auto"``: bits where it can run
            (0.62 against 1.08 ms at k = 29 and 131072 rows on the H200), else scan.
        config: ``(rows per program, columns per step, warps)`` tuning knobs (default: by
            method, and for ``"bits"`` by ``M``: see ``PACK_BITS_SMALL_M``).

    Returns:
        A kernel-written :class:`TwELL` of ``relu(a)``: entries hold ``a``'s own values (so
        they are bit-identical to ``relu(a)``), ``overflow_values`` is None (overflowed tiles
        are read back from ``a`` or recomputed by the consumer).
    """
    _check_pre(a, "a")
    _check_tile(tile, compression)
    if method not in ("auto", "scan", "bits"):
        raise ValueError(f"method must be 'auto', 'scan' or 'bits', got {method!r}")
    if method == "auto":
        method = "bits" if tile >= 32 else "scan"
    if method == "bits" and tile < 32:
        raise ValueError(f"method='bits' needs tile >= 32, got {tile}")
    if a.stride(1) != 1:
        a = a.contiguous()
    M, f = a.shape
    hot, hot_out, times_up = _hot if _hot is not None else (None, None, False)  # (pack_relu_hot's, checked there)
    out = empty_twell(M, f, tile, compression, a.dtype, a.device)
    if M == 0 or f == 0:
        return out
    if config is None and method == "bits":
        config = bits_config(M)
    if config is not None:
        # the bits pack covers BN // 32 words a step and advances by BN: anything else drops columns
        check_config(config, (("rows per program", 1, 64, True),
                              ("columns per step", 32 if method == "bits" else 1, 4096, True), ("warps", 1, 32, True)))
    BM, BN, nw = config or PACK_CONFIG
    BN = min(tile, BN)
    grid = (triton.cdiv(M, BM), out.n_tiles)
    if method == "scan":
        with on_device_of(a):
            _pack_relu_kernel[grid](
                a, a.stride(0), out.values, out.cols, out.counts, M, f, out.slots, out.n_tiles,
                TILE=tile, BM=BM, BN=BN, num_warps=nw,
            )
    else:
        with on_device_of(a):
            _pack_relu_bits_kernel[grid](
                a, a.stride(0), out.values, out.cols, out.counts,
                *((hot.words, hot.starts, hot.units, hot_out, hot.n) if hot is not None else (out.counts, out.counts, out.counts, a, 0)),
                M, f, out.slots, out.n_tiles,
                TILE=tile, BM=BM, BN=BN, HOT=hot is not None, HOT_TIMES_UP=times_up, HB=HOT_BLOCK, num_warps=nw,
            )
    return out


def pack_relu_hot(a: torch.Tensor, hot: HotUnits, tile: int = 256, compression: int = 4,
                  config: Optional[tuple[int, int, int]] = None, up: Optional[torch.Tensor] = None,
                  ) -> tuple[TwELL, torch.Tensor]:
    """:func:`pack_relu` (bit-word pack) of the cold units only, and the hot units' hidden values.

    Args:
        a: ``[M, f]`` pre-activation; hot: the hot set (:func:`twell.kernels.hot_units.hot_units`,
            for ``f`` units, on a's device); tile, compression, config: as :func:`pack_relu`.
        up: gated FFN: ``[M, nh]`` the hot units' up projection ``x w_up[H]^T``
            (:func:`twell.kernels.hot_units.hot_up`; a's dtype, contiguous), overwritten with
            ``relu(a[:, H]) * up`` (each product in fp32, rounded once, as the dense MLP's).
            None (non-gated FFN): a new ``[M, nh]`` tensor gets ``relu(a[:, H])``.

    Returns:
        ``(g, h_hot)``: g the TwELL of ``relu(a)`` with the hot units' columns left out (counts
        too); ``h_hot [M, nh]`` (a's dtype) the hot units' hidden values, every one written by
        the same pass (``up`` itself where given).
    """
    _check_pre(a, "a")
    if not isinstance(hot, HotUnits):
        raise TypeError(f"hot must be a twell.kernels.hot_units.HotUnits, got {type(hot).__name__}")
    hot.check(a.shape[1], a.device)
    if tile < 32:
        raise ValueError(f"pack_relu_hot takes the bit-word pack, which needs tile >= 32, got {tile}")
    M = a.shape[0]
    if up is None:
        h_hot = torch.empty(M, hot.n, dtype=a.dtype, device=a.device)
    else:
        check_tensor(up, "up", dim=2, dtypes=KERNEL_DTYPES)
        if tuple(up.shape) != (M, hot.n) or up.dtype != a.dtype or not up.is_contiguous() or up.device != a.device:
            raise ValueError(f"up must be a contiguous [{M}, {hot.n}] {a.dtype} tensor on {a.device}, "
                             f"got {list(up.shape)} {up.dtype} on {up.device}")
        h_hot = up
    g = pack_relu(a, tile, compression, "bits", config, _hot=(hot, h_hot, up is not None))
    return g, h_hot


# ---------------------------------------------------------------------------------------------
# Triton matmul with the pack in its epilogue
# ---------------------------------------------------------------------------------------------


@triton.jit
def _grouped_tile(tile_id, n_m, in_group, GROUP_M: tl.constexpr):
    """``(pid_m, t)``: the row block and TwELL tile of output tile ``tile_id`` in grouped order
    (GROUP_M row blocks in turn for each tile: they share its w rows while those are in L2), of
    ``n_m`` row blocks, ``in_group = GROUP_M * N_TILES``."""
    first_m = (tile_id // in_group) * GROUP_M
    size_m = tl.minimum(n_m - first_m, GROUP_M)
    return first_m + (tile_id % in_group) % size_m, (tile_id % in_group) // size_m


@triton.jit
def _gate_pack_kernel(
    x_ptr, stride_xm, w_ptr, stride_wf,
    val_ptr, col_ptr, cnt_ptr,
    M, f, d, SLOTS, N_TILES,
    BM: tl.constexpr, TILE: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, PREC: tl.constexpr,
):
    pid = tl.program_id(0)
    n_m = tl.cdiv(M, BM)
    pid_m, t = _grouped_tile(pid, n_m, GROUP_M * N_TILES, GROUP_M)
    rows = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    cin = tl.arange(0, TILE)
    gcol = t * TILE + cin
    rmask, cmask = rows < M, gcol < f
    ks = tl.arange(0, BK)
    acc = tl.zeros([BM, TILE], dtype=tl.float32)
    for k0 in range(0, d, BK):
        kmask = (k0 + ks) < d
        xa = tl.load(x_ptr + rows[:, None] * stride_xm + (k0 + ks)[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        wb = tl.load(w_ptr + gcol.to(tl.int64)[None, :] * stride_wf + (k0 + ks)[:, None], mask=kmask[:, None] & cmask[None, :], other=0.0)
        acc = tl.dot(dot_operand(xa, PREC), dot_operand(wb, PREC), acc, input_precision=PREC)
    a = acc.to(val_ptr.dtype.element_ty)
    mask = rmask[:, None] & cmask[None, :]
    nz = fires(a) & mask
    nzi = nz.to(tl.int32)
    pos = tl.cumsum(nzi, axis=1) - 1
    keep = nz & (pos < SLOTS)
    off = (rows * (N_TILES * SLOTS) + t * SLOTS)[:, None] + pos
    tl.store(val_ptr + off, a, mask=keep)
    tl.store(col_ptr + off, (cin[None, :] + tl.zeros([BM, TILE], dtype=tl.int32)).to(tl.int16), mask=keep)
    tl.store(cnt_ptr + rows * N_TILES + t, tl.sum(nzi, axis=1), mask=rmask)


def _check_gate_pack_args(x: torch.Tensor, w: torch.Tensor, tile: int, compression: int, name: str) -> None:
    """Clear errors for the matmul gate-packs' inputs: x ``[M, d]``, w ``[f, d]`` of one kernel
    dtype and device, and a tile that is also the matmul's N block."""
    check_tensor(x, "x", dim=2, dtypes=KERNEL_DTYPES)
    check_tensor(w, "w", dim=2, dtypes=KERNEL_DTYPES)
    if w.shape[1] != x.shape[1]:
        raise ValueError(f"w must be [f, {x.shape[1]}] for x [M, {x.shape[1]}], got {list(w.shape)}")
    if w.dtype != x.dtype or w.device != x.device:
        raise TypeError(f"x ({x.dtype}, {x.device}) and w ({w.dtype}, {w.device}) must share dtype and device")
    check_launchable(x, "x")
    _check_tile(tile, compression)
    if not 16 <= tile <= 256:
        raise ValueError(f"the {name} gate-pack needs 16 <= tile <= 256 (its N block), got {tile}")


def gate_pack_fused(
    x: torch.Tensor,
    w: torch.Tensor,
    tile: int = 128,
    compression: int = 4,
    block_m: int = 128,
    block_k: int = 64,
    num_warps: int = 8,
    num_stages: int = 3,
) -> TwELL:
    """``relu(x w^T)`` into TwELL by a Triton matmul that packs in its epilogue.

    Args:
        x: ``[M, d]``; w: ``[f, d]`` (nn.Linear layout), same dtype (fp16, bf16 or fp32).
        tile: TwELL tile width, which is also the matmul's N block (16 to 256).
        compression, block_m, block_k, num_warps, num_stages: format and tuning knobs.

    Returns:
        A kernel-written :class:`TwELL` (``overflow_values`` None: recompute overflowed tiles
        from ``x`` and ``w``). ``[M, f]`` never goes to memory.
    """
    _check_gate_pack_args(x, w, tile, compression, "fused")
    x = x if x.stride(1) == 1 else x.contiguous()
    w = w if w.stride(1) == 1 else w.contiguous()
    M, d = x.shape
    f = w.shape[0]
    out = empty_twell(M, f, tile, compression, x.dtype, x.device)
    if M == 0 or f == 0:
        return out
    if d == 0:
        out.counts.zero_()
        return out
    grid = (triton.cdiv(M, block_m) * out.n_tiles,)
    with on_device_of(x):
        _gate_pack_kernel[grid](
            x, x.stride(0), w, w.stride(0), out.values, out.cols, out.counts,
            M, f, d, out.slots, out.n_tiles,
            BM=block_m, TILE=tile, BK=block_k, GROUP_M=8,
            # fp32 operands: full-precision products (tl.dot defaults to TF32 on NVIDIA GPUs)
            PREC=dot_precision(x),
            num_warps=num_warps, num_stages=num_stages,
        )
    return out


# ---------------------------------------------------------------------------------------------
# Persistent matmul with tensor-descriptor (TMA) loads, same pack epilogue
# ---------------------------------------------------------------------------------------------


@triton.jit
def _gate_pack_persistent_kernel(
    x_desc, w_desc,
    val_ptr, col_ptr, cnt_ptr, out_ptr,
    M, f, d, SLOTS, N_TILES,
    NUM_PROGS,
    BM: tl.constexpr, TILE: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    PACK: tl.constexpr, PREC: tl.constexpr, FLATTEN: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
):
    # Program p computes output tiles p, p + NUM_PROGS, ... in grouped order (GROUP_M row blocks
    # share each w tile while it is in L2). Descriptor loads past the edges of x and w read
    # zeros, so the k loop needs no masks; the epilogue masks rows >= M and columns >= f.
    # PACK: the TwELL epilogue of _gate_pack_kernel; else a plain store of a (the matmul alone,
    # to time it against cuBLAS).
    pid = tl.program_id(0)
    n_m = tl.cdiv(M, BM)
    in_group = GROUP_M * N_TILES
    # not flattened by default: a flattened loop keeps the k pipeline's buffers live through the
    # epilogue, whose [BM, TILE] scan needs its own shared memory (tile 256, 3 stages: 272 KB >
    # 227 KB, compiled for sm_90 with Triton 3.6). FLATTEN / WARP_SPECIALIZE: Triton's loop
    # options, to measure (a producer warp loading the next tile's operands during the epilogue)
    for tile_id in tl.range(pid, n_m * N_TILES, NUM_PROGS, flatten=FLATTEN, warp_specialize=WARP_SPECIALIZE):
        pid_m, t = _grouped_tile(tile_id, n_m, in_group, GROUP_M)
        acc = tl.zeros([BM, TILE], dtype=tl.float32)
        for k0 in range(0, d, BK):
            xa = x_desc.load([pid_m * BM, k0])
            wb = w_desc.load([t * TILE, k0])
            acc = tl.dot(dot_operand(xa, PREC), dot_operand(wb, PREC).T, acc, input_precision=PREC)
        rows = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
        cin = tl.arange(0, TILE)
        gcol = t * TILE + cin
        rmask, cmask = rows < M, gcol < f
        a = acc.to(val_ptr.dtype.element_ty)
        mask = rmask[:, None] & cmask[None, :]
        if PACK:  # the epilogue of _gate_pack_kernel, with int32 offsets within the block
            nz = fires(a) & mask
            nzi = nz.to(tl.int32)
            pos = tl.cumsum(nzi, axis=1) - 1
            keep = nz & (pos < SLOTS)
            # a scalar int64 base and int32 offsets within the block: a [BM, TILE] int64 offset
            # live across both stores spilled registers at tile 256
            base = (pid_m * BM).to(tl.int64) * (N_TILES * SLOTS) + t * SLOTS
            off = (tl.arange(0, BM) * (N_TILES * SLOTS))[:, None] + pos
            tl.store(val_ptr + base + off, a, mask=keep)
            tl.store(col_ptr + base + off, (cin[None, :] + tl.zeros([BM, TILE], dtype=tl.int32)).to(tl.int16), mask=keep)
            tl.store(cnt_ptr + rows * N_TILES + t, tl.sum(nzi, axis=1), mask=rmask)
        else:
            tl.store(out_ptr + rows[:, None] * f + gcol[None, :], a, mask=mask)


def _descriptor_ok(t: torch.Tensor) -> bool:
    """Tensor descriptors (TMA) need unit-stride rows, 16-byte aligned row strides and base."""
    return t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0


def gate_pack_persistent(
    x: torch.Tensor,
    w: torch.Tensor,
    tile: int = 128,
    compression: int = 4,
    block_m: int = 128,
    block_k: int = 64,
    num_warps: int = 8,
    num_stages: int = 3,
    num_programs: Optional[int] = None,
    pack: bool = True,
    flatten: bool = False,
    warp_specialize: bool = False,
):
    """``relu(x w^T)`` into TwELL by a persistent Triton matmul with tensor-descriptor loads that
    packs in its epilogue (as :func:`gate_pack_fused`; the same layout and overflow contract).

    Args:
        x: ``[M, d]``; w: ``[f, d]`` (nn.Linear layout), same dtype (fp16, bf16 or fp32), unit-stride
            rows whose byte stride is a multiple of 16 (bf16: d a multiple of 8).
        tile: TwELL tile width, which is also the matmul's N block (16 to 256).
        num_programs: programs of the persistent grid (default: the GPU's SM count, at most the
            number of output tiles).
        pack: False returns the dense pre-activation ``[M, f]`` instead (the matmul alone, for
            benchmarks).
        flatten, warp_specialize: Triton's options for the loop over output tiles (``tl.range``),
            for benchmarks; off by default (see the note in the kernel).

    Returns:
        A kernel-written :class:`TwELL` (``overflow_values`` None: recompute overflowed tiles
        from ``x`` and ``w``), or with ``pack=False`` the ``[M, f]`` tensor ``x w^T``.
    """
    from triton.tools.tensor_descriptor import TensorDescriptor

    _check_gate_pack_args(x, w, tile, compression, "persistent")
    for t, name in ((x, "x"), (w, "w")):
        if not _descriptor_ok(t):
            raise ValueError(
                f"{name} must have unit-stride rows with a byte stride that is a multiple of 16 and a 16-byte "
                f"aligned start (tensor descriptors), got strides {t.stride()} of {t.dtype}"
            )
    M, d = x.shape
    f = w.shape[0]
    out = empty_twell(M, f, tile, compression, x.dtype, x.device)
    dense = None if pack else torch.empty(M, f, dtype=x.dtype, device=x.device)
    if M == 0 or f == 0:
        return out if pack else dense
    if d == 0:
        if pack:
            out.counts.zero_()
            return out
        return dense.zero_()
    n_out = triton.cdiv(M, block_m) * out.n_tiles
    if num_programs is None:
        num_programs = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
    num_programs = max(1, min(num_programs, n_out))
    x_desc = TensorDescriptor.from_tensor(x, [block_m, block_k])
    w_desc = TensorDescriptor.from_tensor(w, [tile, block_k])
    with on_device_of(x):
        _gate_pack_persistent_kernel[(num_programs,)](
            x_desc, w_desc, out.values, out.cols, out.counts, dense if dense is not None else out.counts,
            M, f, d, out.slots, out.n_tiles, num_programs,
            BM=block_m, TILE=tile, BK=block_k, GROUP_M=8, PACK=pack,
            PREC=dot_precision(x), FLATTEN=flatten, WARP_SPECIALIZE=warp_specialize,
            num_warps=num_warps, num_stages=num_stages,
        )
    return out if pack else dense

"""The FFN of a small batch in three launches: the gate lists every (unit, token) that fires, then
hundreds of small programs do up and down one fire at a time.

In :mod:`twell.kernels.decode_fused` one program per block of 64 units does gate, up and down
in turn. From 6 tokens on the H200 its gate costs what any gate product does (about 13.5 us: 23 MB
with L2 flushed), but its up and down phases add 5 to 6 us each, whatever their bytes: 88 programs,
one per SM, each waiting on its own chain of loads. Here the work after the gate is spread over
about a thousand programs instead, each with one round of loads per fire::

    1. _fire_gate_kernel, one program per BU units, the batch's tokens as one tile:
           a^T[u, m] = w_first[u] . x[m]       tensor cores; rounded to x's dtype as the dense
                                                path's product is; x and w_first read by tensor
                                                descriptors (TMA) from 33 tokens, by pointers below
           every fire (a[m, u] > 0 or NaN)      appended to a list by one atomic ticket per block:
                                                entry u * 64 + m, and relu(a) beside it
           fires past the list's capacity       done by this program itself, as the fused kernel
                                                does a block (tensor cores): exact, slower
    2. _fire_updown_kernel, P programs walking the list; for a fire (u, m) with gate value g:
           gated:     h = g * (x[m] . w_up[u])     the up row, x row and down row loaded together
           non-gated: h = g
           acc[m]    += h * w_down_t[u]             fp32 atomic adds
    3. the fused kernel's write-out (decode_fused._write_out_reset_kernel): y = acc in x's dtype;
       acc zeroed; the list emptied, its length kept as the call's number of fires.

On Hopper each launch after the first is a programmatic dependent launch of the one before: it
starts while that one runs and waits in ``griddepcontrol.wait`` until it has completed and its
writes are visible.

The buffers live in a :class:`SplitScratch` that the caller keeps (:mod:`twell.inference.dispatch` shares
one among a device's layers of one shape; one stream at a time); every call leaves it zeroed and
its list empty. Or they are the call's own (:meth:`SplitScratch.for_one_call`, what
``twell.inference.dispatch.DECODE_SCRATCH = False`` takes): then a zero fill comes first, four launches.
The down sums run in fp32 in whatever order the programs finish: exact up to rounding, not
bit-reproducible.

Measured (H200, bf16, d 2048, f 5632, CUDA graphs, L2 flushed): 18 to 20 us at 8 and 16 tokens for k
8 to 56 (dense 40 to 41 us, the fused kernel 28.5 to 29.5), 20 to 27 us at 32 tokens and 23 to 35 us
at 64; the time grows with the number of fires (about 4 to 5 ns each) over a gate of 17 to 21 us. At
one token the fused CUDA-core kernel is faster (15 against 18 us). Timed as a model runs them (eight
layers back to back in one graph, no flush): 13.5 to 17 us at 4 to 16 tokens and 19 to 31 us at 64,
against dense's 31 to 35. The dispatcher (:mod:`twell.inference.dispatch`) takes these kernels from
``SPLIT_MIN_M`` to 64 tokens while the expected number of fires is at most ``SPLIT_MAX_FIRES``.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from ._launch import on_device_of, pdl_ok
from ._dot import dot_operand, dot_precision
from ..checks import check_config
from .decode import check_decode_args, check_stat_buffers
from .decode_fused import _block_activity, _up_down_block, launch_write_out
from .gate_pack import _descriptor_ok

__all__ = ["ffn_decode_split", "decode_split_launch", "gate_loads", "SplitScratch", "SplitConfig", "SPLIT_CONFIG",
           "SPLIT_DESC_CONFIG", "SPLIT_MAX_M", "SPLIT_CAPACITY"]

SPLIT_MAX_M = 64  # tokens per call: the gate's token tile, and the token field of a list entry
SPLIT_CAPACITY = 8192  # list entries of a SplitScratch unless asked (48 KB in bf16)
_MAX_F = 2**31 // SPLIT_MAX_M  # an entry u * 64 + m must fit in int32


@triton.jit
def _gate_tile(x_ptr, stride_xm, wf_ptr, stride_wf, rows, rmask, units, umask, d,
               ROWS: tl.constexpr, BU: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr):
    """``a [ROWS, BU]``: the block's gate products on tensor cores, rounded to the weights' dtype
    as the dense path's product is. Units as the dot's rows: measured the faster orientation here."""
    ks = tl.arange(0, BK)
    acc = tl.zeros([BU, ROWS], dtype=tl.float32)
    for k0 in range(0, d, BK):
        kk = k0 + ks
        kmask = kk < d
        w = tl.load(wf_ptr + units.to(tl.int64)[:, None] * stride_wf + kk[None, :], mask=umask[:, None] & kmask[None, :], other=0.0)
        xt = tl.load(x_ptr + rows.to(tl.int64)[None, :] * stride_xm + kk[:, None], mask=rmask[None, :] & kmask[:, None], other=0.0)
        acc = tl.dot(dot_operand(w, PREC), dot_operand(xt, PREC), acc, input_precision=PREC)
    return tl.trans(acc.to(wf_ptr.dtype.element_ty).to(tl.float32))


@triton.jit
def _gate_tile_desc(x_desc, w_desc, u0, d, out_ty: tl.constexpr, ROWS: tl.constexpr, BU: tl.constexpr,
                    BK: tl.constexpr, PREC: tl.constexpr):
    """:func:`_gate_tile` with tensor-descriptor (TMA) loads: the x block ``[ROWS, BK]`` and the
    weight block ``[BU, BK]`` from units ``u0``; loads past the edges of x (tokens past M) and of
    w (units past f, columns past d) read zeros, so the loop needs no masks. Tokens as the dot's
    rows, as in gate_pack's persistent matmul. Used from GATE_DESC_MIN_ROWS tokens (see there)."""
    acc = tl.zeros([ROWS, BU], dtype=tl.float32)
    for k0 in range(0, d, BK):
        xa = x_desc.load([0, k0])
        wb = w_desc.load([u0, k0])
        acc = tl.dot(dot_operand(xa, PREC), dot_operand(wb, PREC).T, acc, input_precision=PREC)
    return acc.to(out_ty).to(tl.float32)


@triton.jit
def _unlisted_fires(over, a, x_ptr, stride_xm, rows, rmask, units, wu_ptr, stride_wu, wd_ptr, stride_wd, acc_ptr, d,
                    ROWS: tl.constexpr, BU: tl.constexpr, BK: tl.constexpr, GATED: tl.constexpr, PREC: tl.constexpr):
    """The fires ``over [ROWS, BU]`` that found no slot in the list, done by the gate program
    itself as the fused kernel does a block (tensor cores): exact, slower."""
    over_i = over.to(tl.int32)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    _up_down_block(tl.where(over, a, 0.0), x_rows, rmask, rows, units, tl.max(over_i, axis=0) > 0, tl.sum(over_i, axis=1),
                   wu_ptr, stride_wu, wd_ptr, stride_wd, acc_ptr, d, ROWS, BU, BK, BK, GATED, PREC)


@triton.jit
def _add_fire_in_steps(h, x_row, wu_row, wd_row, acc_row, d, BD: tl.constexpr, GATED: tl.constexpr):
    """One fire with d in steps of BD (d larger than one step): h (its gate value) times its up
    product (gated), rounded as the dense path rounds, then ``acc_row += h * wd_row``."""
    cs = tl.arange(0, BD)
    if GATED:
        part = tl.zeros([BD], dtype=tl.float32)
        for c0 in range(0, d, BD):
            cols = c0 + cs
            cmask = cols < d
            part += tl.load(wu_row + cols, mask=cmask, other=0.0).to(tl.float32) * tl.load(x_row + cols, mask=cmask, other=0.0).to(tl.float32)
        h = h * tl.sum(part, axis=0).to(wu_row.dtype.element_ty).to(tl.float32)
    h = h.to(wd_row.dtype.element_ty).to(tl.float32)
    for c0 in range(0, d, BD):
        cols = c0 + cs
        cmask = cols < d
        wd = tl.load(wd_row + cols, mask=cmask, other=0.0).to(tl.float32)
        tl.atomic_add(acc_row + cols, h * wd, mask=cmask, sem="relaxed")


@triton.jit
def _fire_gate_kernel(
    x_ptr, stride_xm, wf_ptr, stride_wf, wu_ptr, stride_wu, wd_ptr, stride_wd,
    entry_ptr, gate_ptr, count_ptr, acc_ptr, counts_ptr, uc_ptr, nnz_ptr,
    x_desc, w_desc,
    M, d, f, capacity,
    ROWS: tl.constexpr, BU: tl.constexpr, BK: tl.constexpr, TOK: tl.constexpr,
    GATED: tl.constexpr, TRACK: tl.constexpr, PREC: tl.constexpr, GDC: tl.constexpr, DESC: tl.constexpr,
):
    if GDC:  # the next launch may start now (it waits for this one's end to read the list)
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    rows = tl.arange(0, ROWS)
    rmask = rows < M
    units = b * BU + tl.arange(0, BU)
    umask = units < f
    if DESC:  # x_desc, w_desc: tensor descriptors of x and w_first (else unused)
        a = _gate_tile_desc(x_desc, w_desc, b * BU, d, wf_ptr.dtype.element_ty, ROWS, BU, BK, PREC)  # [ROWS, BU]
    else:
        a = _gate_tile(x_ptr, stride_xm, wf_ptr, stride_wf, rows, rmask, units, umask, d, ROWS, BU, BK, PREC)
    fires, active, n_active, per_row = _block_activity(a, rows, rmask, units, umask, b, counts_ptr, uc_ptr, nnz_ptr, TRACK)
    n = tl.sum(per_row, axis=0)  # this block's fires
    if n > 0:
        base = tl.atomic_add(count_ptr, n)  # this block's slots in the list
        # unit-major: a unit's fires side by side, so that programs running at the same time
        # mostly read the same up and down rows (as measured)
        fired = tl.reshape(tl.trans(fires.to(tl.int32)), [BU * ROWS])
        slot = base + tl.cumsum(fired, axis=0) - 1
        listed = (fired > 0) & (slot < capacity)
        entry = tl.reshape(units[:, None] * TOK + rows[None, :], [BU * ROWS])
        tl.store(entry_ptr + slot, entry, mask=listed)
        tl.store(gate_ptr + slot, tl.reshape(tl.trans(a), [BU * ROWS]).to(gate_ptr.dtype.element_ty), mask=listed)
        if base + n > capacity:
            # the list is full: this block's remaining fires are done here, exactly as the fused
            # kernel does a block (slower, and rare where the dispatcher chose these kernels)
            _unlisted_fires(fires & (tl.trans(tl.reshape(slot, [BU, ROWS])) >= capacity), a, x_ptr, stride_xm, rows, rmask,
                            units, wu_ptr, stride_wu, wd_ptr, stride_wd, acc_ptr, d, ROWS, BU, BK, GATED, PREC)


@triton.jit
def _fire_updown_kernel(
    x_ptr, stride_xm, wu_ptr, stride_wu, wd_ptr, stride_wd,
    entry_ptr, gate_ptr, count_ptr, acc_ptr,
    d, capacity, P,
    BD: tl.constexpr, ONE_STEP: tl.constexpr, TOK: tl.constexpr, GATED: tl.constexpr, GDC: tl.constexpr,
):
    if GDC:
        tl.extra.cuda.gdc_wait()  # the gate launch has completed and its list is visible
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    n = tl.minimum(tl.load(count_ptr), capacity)
    cs = tl.arange(0, BD)
    for i in range(pid, n, P):
        e = tl.load(entry_ptr + i)
        u = (e // TOK).to(tl.int64)
        m = (e % TOK).to(tl.int64)
        h = tl.load(gate_ptr + i).to(tl.float32)  # relu(a[m, u]): > 0, or NaN
        acc_row = acc_ptr + m * d
        if ONE_STEP:  # d in one step: the up row, the x row and the down row in one round of loads
            cmask = cs < d
            wd = tl.load(wd_ptr + u * stride_wd + cs, mask=cmask, other=0.0).to(tl.float32)
            if GATED:
                wu = tl.load(wu_ptr + u * stride_wu + cs, mask=cmask, other=0.0).to(tl.float32)
                xm = tl.load(x_ptr + m * stride_xm + cs, mask=cmask, other=0.0).to(tl.float32)
                up = tl.sum(wu * xm, axis=0).to(wu_ptr.dtype.element_ty).to(tl.float32)  # the dense path rounds it
                h = h * up
            h = h.to(wd_ptr.dtype.element_ty).to(tl.float32)  # and h, before the down product
            # relaxed: nothing reads acc until the write-out, ordered after this launch's end
            tl.atomic_add(acc_row + cs, h * wd, mask=cmask, sem="relaxed")
        else:
            _add_fire_in_steps(h, x_ptr + m * stride_xm, wu_ptr + u * stride_wu, wd_ptr + u * stride_wd, acc_row, d, BD, GATED)


class SplitScratch:
    """What a :func:`ffn_decode_split` call keeps between calls, for any number of layers of one
    shape (:mod:`twell.inference.dispatch` shares one per device) and one stream at a time, left zeroed (the
    accumulator) and empty (the list) by every call.

    Attributes: ``acc [64, d]`` fp32 (shared with a :class:`twell.kernels.decode_fused.DecodeScratch`
    of 64 rows when given; ``[M, d]`` from :meth:`for_one_call`); ``entries [capacity]`` int32,
    the list (``u * 64 + m``);
    ``gates [capacity]`` relu(a) of each entry in the inputs' dtype; ``count [2]`` int32: the
    list's length during a call (``count[0]``) and the last call's number of fires
    (``count[1]``). About ``6 capacity`` bytes besides the accumulator: 48 KB at the default
    capacity, bf16. Make a kept one outside a CUDA graph capture: a buffer from a capture's
    memory pool is the graph's (one for a single call, :meth:`for_one_call`, may come from it)."""

    def __init__(self, d: int, f: int, dtype: torch.dtype, device, capacity: int = SPLIT_CAPACITY,
                 acc: Optional[torch.Tensor] = None) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.f, self.capacity = f, capacity
        # normal tensors even when made under torch.inference_mode (a serving loop's first call):
        # inference tensors could not be reset in place outside that mode after a failed call
        with torch.inference_mode(False):
            if acc is None:
                acc = torch.zeros(SPLIT_MAX_M, d, dtype=torch.float32, device=device)
            elif acc.shape != (SPLIT_MAX_M, d) or acc.dtype != torch.float32 or not acc.is_contiguous():
                raise ValueError(f"acc must be a contiguous [{SPLIT_MAX_M}, {d}] float32 tensor, got {list(acc.shape)} {acc.dtype}")
            self.acc = acc
            self.entries = torch.zeros(capacity, dtype=torch.int32, device=device)
            self.gates = torch.zeros(capacity, dtype=dtype, device=device)
            self.count = torch.zeros(2, dtype=torch.int32, device=device)

    @classmethod
    def for_one_call(cls, M: int, d: int, f: int, dtype: torch.dtype, device,
                     capacity: int = SPLIT_CAPACITY) -> "SplitScratch":
        """Buffers for one call of ``M`` tokens, from PyTorch's allocator, dropped with the call
        (what :data:`twell.inference.dispatch.DECODE_SCRATCH` off asks for): ``acc [M, d]`` and ``count``
        share one zero-filled allocation (one fill launch per call), ``entries`` and ``gates`` are
        left unfilled (the gate writes each slot before it is read). Inside a CUDA graph capture
        they come from the graph's pool and are reused by whatever runs after the call."""
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self = cls.__new__(cls)
        self.f, self.capacity = f, capacity
        # count [2] int32 in the last two fp32 slots: all-zero bits are 0 in both types
        flat = torch.zeros(M * d + 2, dtype=torch.float32, device=device)
        self.acc = flat[:M * d].view(M, d)
        self.count = flat[M * d:].view(torch.int32)
        self.entries = torch.empty(capacity, dtype=torch.int32, device=device)
        self.gates = torch.empty(capacity, dtype=dtype, device=device)
        return self

    def fires(self) -> torch.Tensor:
        """The last call's number of fires, of whichever layer sharing the buffers ran last (``[]``
        int32 on the scratch's device; reading it on the host waits for the GPU). Those past the
        list's capacity took the slower path."""
        return self.count[1]

    def reset(self) -> None:
        """Empty the list and zero the accumulator (after a call that failed half-way; the
        number of fires then reads 0)."""
        self.count.zero_()
        self.acc.zero_()


class SplitConfig(NamedTuple):
    """Launch shapes: the gate's ``BU`` units per program, its steps of ``BK`` columns, warps and
    stages; the up/down launch's ``P`` programs, their steps of at most ``BD`` columns, and warps."""

    BU: int
    BK: int
    num_warps: int
    num_stages: int
    P: int
    BD: int
    updown_warps: int


# 1056 programs with d in one step were the fastest or within 0.5 us of it from 1 to 64 tokens
# (528 and 2112 programs also tried); the gate's shape the fastest stand-alone gate (13.3 to 13.6
# us at 8 tokens). In eight layers back to back in one graph, as a model runs them (12 shapes):
# the up/down programs with 8 warps instead of 4
# were the fastest in 14 of 15 records from 4 to 64 tokens, 0.1 to 0.5 us (1% to 3%) faster.
SPLIT_CONFIG = SplitConfig(64, 128, 4, 6, 1056, 4096, 8)

# What a config may hold (twell.checks.check_config): tensor-core tiles of at least 16 units.
SPLIT_KNOBS = (("BU", 16, 256, True), ("BK", 16, 4096, True), ("num_warps", 1, 32, True), ("num_stages", 1, 8, False),
               ("P", 1, 1 << 16, False), ("BD", 16, 8192, True), ("updown_warps", 1, 32, True))

# The gate reads x and w_first through tensor descriptors (TMA) from this token tile on, where
# both allow it (unit-stride rows, 16-byte aligned rows and base); pointer loads below it and
# otherwise. Eight layers back to back in a graph: the
# 64-token tile 0.6 to 0.8 us faster with descriptors (k 29: 23.1 against 23.9 us), the 16-token
# tile 0.6 to 0.8 us slower (k 29: 15.5 against 14.8).
GATE_DESC_MIN_ROWS = 64
# The shape of a call whose gate reads by descriptors (see above) when no config is given.
# In the same chain (64 tokens, k 8 / 29 / 56): 32 units per
# gate program with 4 stages (176 programs, two of them fit an SM's shared memory) took 17.2 /
# 22.2 / 29.2 us against 17.8 / 22.8 / 29.6 for SPLIT_CONFIG's 64 units and 6 stages; 32 units
# with 6, 3 or 2 stages, 64 columns a step, 8 warps, 16 units, or 64 units with 3 stages were
# slower (17.9 to 36.0 us at k 29).
SPLIT_DESC_CONFIG = SplitConfig(32, 128, 4, 4, 1056, 4096, 8)


def _token_tile(M: int) -> int:
    """The gate's token tile for M tokens: M rounded up to a power of two, at least 16."""
    return max(16, triton.next_power_of_2(M))


def gate_loads(x: torch.Tensor, w_first: torch.Tensor) -> tuple:
    """``(desc, config)`` for a call on ``x [M, d]``: whether the gate reads by tensor descriptors
    (a token tile of at least GATE_DESC_MIN_ROWS, rows both can take), and the shape used when
    the caller gives none (SPLIT_DESC_CONFIG with descriptors, else SPLIT_CONFIG)."""
    desc = _token_tile(x.shape[0]) >= GATE_DESC_MIN_ROWS and _descriptor_ok(x) and _descriptor_ok(w_first)
    return desc, (SPLIT_DESC_CONFIG if desc else SPLIT_CONFIG)


@functools.cache
def _shared_memory(index: int) -> int:
    """Bytes of shared memory a block may use on CUDA device ``index``."""
    try:
        return int(triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"])
    except Exception:  # noqa: BLE001 - an unknown driver: the smallest of recent NVIDIA GPUs'
        return 99 * 1024


_FEWER_STAGES: dict = {}  # (device, dtype, rows, descriptor loads) -> stages, where the estimate below failed


def _gate_stages(x: torch.Tensor, rows: int, cfg: SplitConfig, BK: int, desc: bool = False) -> int:
    """The gate's pipeline stages: the config's, fewer where they would not fit in the device's
    shared memory (fp32 inputs, 64-token tiles, GPUs before Hopper); ``desc``: the gate's loads
    by tensor descriptors (a failure remembered for one load path does not pin the other)."""
    if not x.is_cuda:
        return 1
    known = _FEWER_STAGES.get((x.device, x.dtype, rows, desc))
    if known is not None:
        return known
    per_stage = (cfg.BU + rows) * BK * x.element_size()
    idx = x.device.index if x.device.index is not None else torch.cuda.current_device()
    fit = (_shared_memory(idx) - 8 * 1024) // per_stage  # some left for the reductions
    return max(1, min(cfg.num_stages, fit))


def decode_split_launch(x, w_first, w_down_t, w_up, unit_counts, row_nnz, *, scratch: SplitScratch,
                        config: Optional[SplitConfig] = None):
    """:func:`ffn_decode_split` without the argument checks, for callers that validated them.

    Returns ``(y, counts, M)``: ``counts [NB]`` int32, the active units of each block of ``BU``
    units (the batch is one chunk of M tokens), as :func:`twell.kernels.decode_fused.decode_fused_launch`
    returns them."""
    M, d = x.shape
    f = w_first.shape[0]
    if M > SPLIT_MAX_M:  # a list entry keeps the token in 6 bits: never decode one wrongly
        raise ValueError(f"the split decode kernels take at most {SPLIT_MAX_M} tokens per call, got {M}")
    if M == 0 or d == 0 or f == 0:
        return torch.zeros(M, d, dtype=x.dtype, device=x.device), torch.zeros(0, dtype=torch.int32, device=x.device), max(M, 1)
    rows = _token_tile(M)
    desc, cfg = gate_loads(x, w_first)
    cfg = config or cfg
    NB = triton.cdiv(f, cfg.BU)
    counts = torch.empty(NB, dtype=torch.int32, device=x.device)
    track = unit_counts is not None
    gdc = pdl_ok(x)
    dpow = max(16, triton.next_power_of_2(d))
    BK = min(cfg.BK, dpow)
    BD = min(cfg.BD, dpow)
    w_up_ = w_up if w_up is not None else w_first
    prec = dot_precision(x)
    gated = w_up is not None
    weights = (w_first, w_first.stride(0), w_up_, w_up_.stride(0), w_down_t, w_down_t.stride(0))
    lists = (scratch.entries, scratch.gates, scratch.count, scratch.acc)
    stats = (counts, unit_counts if track else counts, row_nnz if track else counts)
    stages = _gate_stages(x, rows, cfg, BK, desc)
    if desc:
        from triton.tools.tensor_descriptor import TensorDescriptor

        descs = (TensorDescriptor.from_tensor(x, [rows, BK]), TensorDescriptor.from_tensor(w_first, [cfg.BU, BK]))
    else:
        descs = (x, w_first)  # placeholders: the kernel is compiled without the descriptor loads
    try:
        with on_device_of(x):
            for attempt in (0, 1):
                try:
                    _fire_gate_kernel[(NB,)](x, x.stride(0), *weights, *lists, *stats, *descs, M, d, f, scratch.capacity,
                                             ROWS=rows, BU=cfg.BU, BK=BK, TOK=SPLIT_MAX_M, GATED=gated, TRACK=track,
                                             PREC=prec, GDC=gdc, DESC=desc, num_warps=cfg.num_warps, num_stages=stages)
                    break
                except triton.runtime.errors.OutOfResources:
                    # compiled, not launched: a GPU whose shared memory the estimate above got
                    # wrong takes one stage, remembered for its later calls
                    if attempt or stages == 1:
                        raise
                    stages = _FEWER_STAGES[(x.device, x.dtype, rows, desc)] = 1
            _fire_updown_kernel[(cfg.P,)](
                x, x.stride(0), *weights[2:], *lists, d, scratch.capacity, cfg.P,
                BD=BD, ONE_STEP=BD >= d, TOK=SPLIT_MAX_M, GATED=gated, GDC=gdc,
                num_warps=cfg.updown_warps, launch_pdl=gdc,
            )
            y = launch_write_out(scratch.acc, M, x.dtype, gdc, count=scratch.count)
    except BaseException:
        scratch.reset()  # never hand a half-done call's sums or list to the next call
        raise
    return y, counts, M


def check_split_scratch(scratch, x: torch.Tensor, f: int) -> None:
    """A clear error unless ``scratch`` is a :class:`SplitScratch` for x's d, dtype and device and
    ``f`` units, with an accumulator row for each of x's tokens."""
    M, d = x.shape
    if not isinstance(scratch, SplitScratch) or scratch.acc.shape[1] != d or scratch.acc.shape[0] < M \
            or scratch.f != f or scratch.gates.dtype != x.dtype or scratch.acc.device != x.device:
        raise ValueError(f"scratch must be a SplitScratch(d={d}, f={f}, dtype={x.dtype}, device={x.device}), or "
                         f"SplitScratch.for_one_call of at least {M} tokens")


def ffn_decode_split(
    x: torch.Tensor,
    w_first: torch.Tensor,
    w_down_t: torch.Tensor,
    *,
    scratch: SplitScratch,
    w_up: Optional[torch.Tensor] = None,
    unit_counts: Optional[torch.Tensor] = None,
    row_nnz: Optional[torch.Tensor] = None,
    config: Optional[SplitConfig] = None,
) -> torch.Tensor:
    """The whole FFN of at most 64 tokens in three launches, four with buffers of its own (see the module's text).

    Args:
        x: ``[M, d]`` tokens, ``M <= 64`` (fp16, bf16 or fp32; unit-stride rows).
        w_first: ``[f, d]`` gate (gated) or up (non-gated) rows, ``f < 2**25``; w_down_t:
            ``[f, d]``, row ``j`` = ``w_down[:, j]``; w_up: ``[f, d]`` for the gated MLP, None for
            the non-gated one.
        scratch: a :class:`SplitScratch` for x's d, dtype and device and f units (kept between
            calls, or :meth:`SplitScratch.for_one_call` of at least M tokens).
        unit_counts: optional ``[f]`` int32, overwritten with the tokens each unit fired for;
            row_nnz: optional ``[M]`` int32 zeros, given the active units of each token (both
            or neither).
        config: a :class:`SplitConfig`; None: :data:`SPLIT_DESC_CONFIG` where the gate reads by
            tensor descriptors (from :data:`GATE_DESC_MIN_ROWS` tokens), else :data:`SPLIT_CONFIG`.

    Returns:
        ``y [M, d]`` in x's dtype.
    """
    M, d, f = check_decode_args(x, w_first, w_down_t, w_up)
    if M > SPLIT_MAX_M:
        raise ValueError(f"the split decode kernels take at most {SPLIT_MAX_M} tokens per call, got {M}")
    if f >= _MAX_F:
        raise ValueError(f"the split decode kernels take fewer than {_MAX_F} units, got f = {f}")
    check_stat_buffers(x, unit_counts, row_nnz, f)
    check_split_scratch(scratch, x, f)
    if config is not None:
        check_config(config, SPLIT_KNOBS)
        config = SplitConfig(*config)
    return decode_split_launch(x, w_first, w_down_t, w_up, unit_counts, row_nnz, scratch=scratch, config=config)[0]

"""The FFN of a small batch in three launches that spread up and down over many small programs.

In :mod:`twell.kernels.decode_fused` one program per block of 64 units does gate, up and down
in turn. From 6 tokens on the H200 its gate costs what any gate product does (about 13.5 us:
23 MB with L2 flushed), but the up and down phases add 5 to 6 us each, whatever their bytes:
88 programs, one per SM, each waiting on its own chain (benchmarks/NOTES_decode.md, ninth
session). Here the work after the gate is spread over hundreds of programs instead::

    1. _split_gate_kernel, one program per BU units:
           a^T[u, m] = w_first[u] . x[m]       tensor cores, units as the dot's rows; rounded to
                                                x's dtype as the dense path's product is
           active units (a > 0 for some token)  appended to a list by one atomic ticket per block,
                                                with their relu(a) column: a_t[slot, tokens]
    2. _split_updown_kernel, P programs walking the list; for a listed unit u:
           gated:     h[m] = relu(a[m, u]) * (x[m] . w_up[u])   only for the tokens u fires for
                                                                 (other x rows are never read)
           non-gated: h[m] = relu(a[m, u])
           acc[m]    += h[m] * w_down_t[u]                       fp32 atomic adds, those tokens only
    3. the fused kernel's write-out (decode_fused._write_out_reset_kernel): y = acc in x's dtype;
       acc zeroed, the list emptied.

Up and down run on CUDA cores, one listed unit per loop step. On Hopper each launch after the
first is a programmatic dependent launch of the one before: it starts while that one runs and
waits in ``griddepcontrol.wait`` until it has completed and its writes are visible.

The buffers live in a :class:`SplitScratch` that the caller keeps (one per layer, one stream at
a time); every call leaves it zeroed and its list empty. The down sums run in fp32 in whatever
order the programs finish: exact up to rounding, not bit-reproducible.

Measured in ``benchmarks/decode_gate_probe.py --split`` (H200, bf16, d 2048, f 5632, CUDA
graphs), with the probe's versions of these kernels (no statistics or block counts; int32 row
offsets):
- 8 tokens: 1.55x to 1.78x of dense, k 8 to 56;
- 16 tokens: 1.57x to 1.71x, k 8 and 29. The fused kernel gives 1.38x to 1.43x at 8 and 16
  tokens;
- slower than the fused kernels at 1 to 4 tokens, at 16 tokens with a union share of 0.15
  (k 56), and from 32 tokens at k 29.

The dispatcher (:mod:`twell.dispatch`) takes them only with ``DECODE_SPLIT`` on, off until
their GPU tests have run on this code.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from ._launch import on_device_of, pdl_ok
from .decode import check_decode_args, check_stat_buffers
from .decode_fused import _block_activity, launch_write_out

__all__ = ["ffn_decode_split", "decode_split_launch", "SplitScratch", "SplitConfig", "SPLIT_CONFIG", "SPLIT_MAX_M"]

SPLIT_MAX_M = 16  # tokens per call: the token tile of the gate's dot and of the list's a_t rows


@triton.jit
def _split_gate_kernel(
    x_ptr, stride_xm, wf_ptr, stride_wf,
    at_ptr, list_ptr, count_ptr, counts_ptr, uc_ptr, nnz_ptr,
    M, d, f,
    ROWS: tl.constexpr, BU: tl.constexpr, BK: tl.constexpr, TRACK: tl.constexpr, PREC: tl.constexpr, GDC: tl.constexpr,
):
    if GDC:  # the next launch may start now (it waits for this one's end to read the list)
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    rows = tl.arange(0, ROWS)
    rmask = rows < M
    units = b * BU + tl.arange(0, BU)
    umask = units < f
    ks = tl.arange(0, BK)
    acc = tl.zeros([BU, ROWS], dtype=tl.float32)
    for k0 in range(0, d, BK):
        kk = k0 + ks
        kmask = kk < d
        w = tl.load(wf_ptr + units.to(tl.int64)[:, None] * stride_wf + kk[None, :], mask=umask[:, None] & kmask[None, :], other=0.0)
        xt = tl.load(x_ptr + rows.to(tl.int64)[None, :] * stride_xm + kk[:, None], mask=rmask[None, :] & kmask[:, None], other=0.0)
        acc = tl.dot(w, xt, acc, input_precision=PREC)
    a_t = acc.to(wf_ptr.dtype.element_ty).to(tl.float32)  # the dense path's rounding of the product
    fires, active, n_active, per_row = _block_activity(tl.trans(a_t), rows, rmask, units, umask, b, counts_ptr, uc_ptr,
                                                       nnz_ptr, TRACK)
    if n_active > 0:
        base = tl.atomic_add(count_ptr, n_active)  # this block's slots in the list
        slot = base + tl.cumsum(active.to(tl.int32), axis=0) - 1
        tl.store(list_ptr + slot, units, mask=active)
        h_t = tl.where(tl.trans(fires), a_t, 0.0)
        tl.store(at_ptr + slot.to(tl.int64)[:, None] * ROWS + rows[None, :], h_t.to(at_ptr.dtype.element_ty), mask=active[:, None])


@triton.jit
def _split_updown_kernel(
    x_ptr, stride_xm, wu_ptr, stride_wu, wd_ptr, stride_wd,
    at_ptr, list_ptr, count_ptr, acc_ptr,
    M, d, P,
    ROWS: tl.constexpr, BD: tl.constexpr, GATED: tl.constexpr, GDC: tl.constexpr,
):
    if GDC:
        tl.extra.cuda.gdc_wait()  # the gate launch has completed and its list is visible
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    n = tl.load(count_ptr)
    rows = tl.arange(0, ROWS)
    rmask = rows < M
    cs = tl.arange(0, BD)
    for i in range(pid, n, P):
        j = tl.load(list_ptr + i).to(tl.int64)
        h = tl.load(at_ptr + i * ROWS + rows, mask=rmask, other=0.0).to(tl.float32)  # relu(a), 0 where not firing
        fire = h > 0
        if GATED:  # the up row times the x rows of the tokens this unit fires for
            u = tl.zeros([ROWS], dtype=tl.float32)
            for c0 in range(0, d, BD):
                cols = c0 + cs
                cmask = cols < d
                w = tl.load(wu_ptr + j * stride_wu + cols, mask=cmask, other=0.0).to(tl.float32)
                xs = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xm + cols[None, :], mask=fire[:, None] & cmask[None, :],
                             other=0.0).to(tl.float32)
                u += tl.sum(xs * w[None, :], axis=1)
            h = h * u.to(wu_ptr.dtype.element_ty).to(tl.float32)  # the dense path rounds the up product
        h = h.to(wd_ptr.dtype.element_ty).to(tl.float32)  # and h, before the down product
        for c0 in range(0, d, BD):
            cols = c0 + cs
            cmask = cols < d
            w = tl.load(wd_ptr + j * stride_wd + cols, mask=cmask, other=0.0).to(tl.float32)
            # relaxed: nothing reads acc until the write-out, ordered after this launch's end
            tl.atomic_add(acc_ptr + rows[:, None] * d + cols[None, :], h[:, None] * w[None, :],
                          mask=fire[:, None] & cmask[None, :], sem="relaxed")


class SplitScratch:
    """What a :func:`ffn_decode_split` call keeps between calls, for one layer and one stream at a
    time, left zeroed (the accumulator) and empty (the list) by every call.

    Attributes: ``acc [16, d]`` fp32; ``a_t [f, 16]`` the listed units' relu(a) columns (the
    inputs' dtype); ``units [f]`` int32, the list; ``count [1]`` int32, its length. About
    ``16 (4 d + 2 f) + 4 f`` bytes: 250 KB at d 2048, f 5632, bf16. Make it outside a CUDA graph
    capture: a buffer from a capture's memory pool is the graph's."""

    def __init__(self, d: int, f: int, dtype: torch.dtype, device) -> None:
        # normal tensors even when made under torch.inference_mode (a serving loop's first call):
        # inference tensors could not be reset in place outside that mode after a failed call
        with torch.inference_mode(False):
            self.acc = torch.zeros(SPLIT_MAX_M, d, dtype=torch.float32, device=device)
            self.a_t = torch.zeros(f, SPLIT_MAX_M, dtype=dtype, device=device)
            self.units = torch.zeros(f, dtype=torch.int32, device=device)
            self.count = torch.zeros(1, dtype=torch.int32, device=device)

    def reset(self) -> None:
        """Empty the list and zero the accumulator (after a call that failed half-way)."""
        self.count.zero_()
        self.acc.zero_()


class SplitConfig(NamedTuple):
    """Launch shapes: the gate's ``BU`` units per program, its steps of ``BK`` columns, warps and
    stages; the up/down launch's ``P`` programs, their steps of ``BD`` columns, and warps."""

    BU: int
    BK: int
    num_warps: int
    num_stages: int
    P: int
    BD: int
    updown_warps: int


# The fastest of the probe's shapes at 8 and 16 tokens (benchmarks/decode_gate_probe.py --split,
# call 9: 528 programs of 4 warps, 512- or 1024-column steps; the gate's shape the fastest
# stand-alone gate of call 1, 13.3 to 13.6 us).
SPLIT_CONFIG = SplitConfig(64, 128, 4, 6, 528, 512, 4)


def decode_split_launch(x, w_first, w_down_t, w_up, unit_counts, row_nnz, *, scratch: SplitScratch,
                        config: Optional[SplitConfig] = None):
    """:func:`ffn_decode_split` without the argument checks, for callers that validated them.

    Returns ``(y, counts, M)``: ``counts [NB]`` int32, the active units of each block of ``BU``
    units (the batch is one chunk of M tokens), as :func:`twell.kernels.decode_fused.decode_fused_launch`
    returns them."""
    M, d = x.shape
    f = w_first.shape[0]
    if M == 0 or d == 0 or f == 0:
        return torch.zeros(M, d, dtype=x.dtype, device=x.device), torch.zeros(0, dtype=torch.int32, device=x.device), max(M, 1)
    cfg = config or SPLIT_CONFIG
    NB = triton.cdiv(f, cfg.BU)
    counts = torch.empty(NB, dtype=torch.int32, device=x.device)
    track = unit_counts is not None
    gdc = pdl_ok(x)
    dpow = max(16, triton.next_power_of_2(d))
    try:
        with on_device_of(x):
            _split_gate_kernel[(NB,)](
                x, x.stride(0), w_first, w_first.stride(0),
                scratch.a_t, scratch.units, scratch.count, counts,
                unit_counts if track else counts, row_nnz if track else counts, M, d, f,
                ROWS=SPLIT_MAX_M, BU=cfg.BU, BK=min(cfg.BK, dpow), TRACK=track,
                PREC="ieee" if x.dtype == torch.float32 else "tf32", GDC=gdc,
                # fp32 operands at 6 stages need 200 KB of shared memory (more than pre-Hopper
                # GPUs have); 2 stages need 40 KB. bf16 and fp16 take 20 KB at any depth here.
                num_warps=cfg.num_warps, num_stages=cfg.num_stages if x.element_size() < 4 else min(cfg.num_stages, 2),
            )
            w_up_ = w_up if w_up is not None else w_first
            _split_updown_kernel[(cfg.P,)](
                x, x.stride(0), w_up_, w_up_.stride(0), w_down_t, w_down_t.stride(0),
                scratch.a_t, scratch.units, scratch.count, scratch.acc, M, d, cfg.P,
                ROWS=SPLIT_MAX_M, BD=min(cfg.BD, dpow), GATED=w_up is not None, GDC=gdc,
                num_warps=cfg.updown_warps, launch_pdl=gdc,
            )
            y = launch_write_out(scratch.acc, M, x.dtype, gdc, count=scratch.count)
    except BaseException:
        scratch.reset()  # never hand a half-done call's sums or list to the next call
        raise
    return y, counts, M


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
    """The whole FFN of at most 16 tokens in three launches (see the module's text).

    Args:
        x: ``[M, d]`` tokens, ``M <= 16`` (fp16, bf16 or fp32; unit-stride rows).
        w_first: ``[f, d]`` gate (gated) or up (non-gated) rows; w_down_t: ``[f, d]``, row ``j`` =
            ``w_down[:, j]``; w_up: ``[f, d]`` for the gated MLP, None for the non-gated one.
        scratch: a :class:`SplitScratch` for x's d, f, dtype and device.
        unit_counts: optional ``[f]`` int32, overwritten with the tokens each unit fired for;
            row_nnz: optional ``[M]`` int32 zeros, given the active units of each token (both
            or neither).
        config: a :class:`SplitConfig`; None: :data:`SPLIT_CONFIG`.

    Returns:
        ``y [M, d]`` in x's dtype.
    """
    M, d, f = check_decode_args(x, w_first, w_down_t, w_up)
    if M > SPLIT_MAX_M:
        raise ValueError(f"the split decode kernels take at most {SPLIT_MAX_M} tokens per call, got {M}")
    check_stat_buffers(x, unit_counts, row_nnz, f)
    if not isinstance(scratch, SplitScratch) or scratch.acc.shape != (SPLIT_MAX_M, d) or scratch.a_t.shape != (f, SPLIT_MAX_M) \
            or scratch.a_t.dtype != x.dtype or scratch.acc.device != x.device:
        raise ValueError(f"scratch must be a SplitScratch(d={d}, f={f}, dtype={x.dtype}, device={x.device})")
    return decode_split_launch(x, w_first, w_down_t, w_up, unit_counts, row_nnz, scratch=scratch, config=config)[0]

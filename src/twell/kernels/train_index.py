"""The hybrid format's bookkeeping on the device: which slots are used, by which units, and which
rows and units leave the common path. No host synchronisation; the unit counts, the slot keys and
the heavy rows with the hot units are one Triton launch each (the unit index adds PyTorch's sort
and binary search).

The sparse training op (:mod:`twell.training.ops`) needs, after the pack (``cols [M, W]``,
``counts [M]``; :func:`twell.kernels.train_ffn.pack_rows`)::

    light_unit_counts   [f]      light rows' used slots per unit (a row is light when counts <= W;
                                 its slots s < counts are used)
    heavy_and_hot       heavy    rows with counts > W, listed in order, then zeros
                        n_heavy  how many
                        hot      units with more than max(hot_min, hot_factor x mean) light slots
                        info     (n_heavy, hot units, light slots at hot units): the backward's
                                 sizes, copied to the host
                        schedule the units, the most light slots first (the weight gradients'
                                 programs take them in this order)
    unit_index          the used light slots grouped by unit (hot units left out): slot keys,
                        one stable sort, a binary search per unit

Written as PyTorch element-wise ops these were about 25 launches per forward and 8 per backward:
about 0.5 ms of host time per forward + backward on the H200 machine here, where the sparse op
at 8192 to 16384 tokens is bound by its host. The reference semantics are in the
docstrings, and tests/test_train_index.py compares each kernel with plain PyTorch.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._launch import on_device_of

__all__ = ["TRASH_KEYS", "key_dtype", "light_unit_counts", "slot_keys", "unit_index", "heavy_and_hot"]

# Unused slots (padding, heavy rows) and left-out units' slots are keyed past the units, spread
# over TRASH_KEYS keys, so that the sort does not meet one long run of equal keys.
TRASH_KEYS = 1024


def key_dtype(f: int) -> torch.dtype:
    """The slot keys' dtype: int16 while every key (at most ``f + TRASH_KEYS - 1``) fits, else
    int32. PyTorch's radix sort on the GPU passes over the key's bytes, so 16-bit keys sort faster:
    0.063 against 0.096 ms for 1M keys on the H200; the order is the same, as the sort is stable."""
    return torch.int16 if f + TRASH_KEYS - 1 <= torch.iinfo(torch.int16).max else torch.int32

_BLOCK = 1024  # slots per program (unit counts, keys)
_STEP = 4096  # rows or units per step of the one heavy-and-hot program


@triton.jit
def _used_slots(col_ptr, cnt_ptr, p, n, W):
    """Flat slots ``p`` (``m W + s``) of ``[M, W]`` ELL rows: ``(inside, used, unit)``, used when
    the row is light (count <= W) and s < count."""
    inside = p < n
    m = p // W
    c = tl.load(cnt_ptr + m, mask=inside, other=0)
    used = inside & ((p - m * W) < c) & (c <= W)
    unit = tl.load(col_ptr + p, mask=used, other=0).to(tl.int32)
    return inside, used, unit


@triton.jit
def _unit_counts_kernel(col_ptr, cnt_ptr, out_ptr, n, W, BLOCK: tl.constexpr):
    p = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    _, used, unit = _used_slots(col_ptr, cnt_ptr, p, n, W)
    tl.atomic_add(out_ptr + unit, tl.full([BLOCK], 1, tl.int64), mask=used, sem="relaxed")


@triton.jit
def _slot_keys_kernel(col_ptr, cnt_ptr, ex_ptr, key_ptr, n, W, f, HAS_EX: tl.constexpr, TRASH: tl.constexpr,
                      BLOCK: tl.constexpr):
    p = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside, used, unit = _used_slots(col_ptr, cnt_ptr, p, n, W)
    if HAS_EX:
        used = used & (tl.load(ex_ptr + unit, mask=used, other=0) == 0)
    key = tl.where(used, unit, f + (p % TRASH).to(tl.int32))
    tl.store(key_ptr + p, key.to(key_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _hot_limit(per_ptr, f, factor, hot_min, BLOCK: tl.constexpr):
    # in fp32, as PyTorch computes (int64 tensor) * (Python float) and its compare with that
    ar = tl.arange(0, BLOCK)
    total = tl.sum(tl.zeros([BLOCK], dtype=tl.int64), axis=0)
    for j0 in range(0, f, BLOCK):
        j = j0 + ar
        total += tl.sum(tl.load(per_ptr + j, mask=j < f, other=0), axis=0)
    return tl.maximum(total.to(tl.float32) * factor, hot_min)


@triton.jit
def _schedule_bin(per, hot, first_bin):
    # The weight gradients' schedule, by bins: a unit with s light slots (s taken at most
    # 2^31 - 1, so that nothing below overflows), s in [2^e, 2^(e+1)) (e from s's fp32
    # exponent: exact up to 2^24, where the conversion can round s up to the next power of 2),
    # is in half octave h = 2 e + 1, or 2 e + 2 from s^2 >= 2^(2e+1) (s >= 2^e sqrt 2) on: bin
    # 63 - h, so the most slots come first; units with none in bin 63, after every other; hot
    # units (left to cuBLAS: no slot on the per-unit kernel) in bin 64, last. Bins below
    # first_bin (more slots than the call's M: not from a pack) are merged into it, so that the
    # schedule stays a permutation.
    s = tl.minimum(per, 2147483647)
    e = ((s.to(tl.float32).to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.minimum(tl.maximum(e, 0), 30)
    upper = (s * s) >= (tl.full(per.shape, 2, tl.int64) << (2 * e).to(tl.int64))
    half_octave = tl.where(per > 0, 2 * e + 1 + upper.to(tl.int32), 0)
    return tl.maximum(tl.where(hot, 64, 63 - tl.minimum(half_octave, 63)), first_bin)


@triton.jit
def _heavy_hot_kernel(cnt_ptr, per_ptr, heavy_ptr, hot_ptr, info_ptr, sched_ptr, M, W, f, factor, hot_min, first_bin,
                      BLOCK: tl.constexpr):
    # Program 0: the heavy rows and the hot units. M and f are a few thousand to a few hundred
    # thousand, a few loads per thread, and one program keeps the list in row order without a
    # second launch. Programs 1 on: bin first_bin + pid - 1 of the schedule each (_schedule_bin;
    # bins below first_bin hold no unit, as no unit has more than M slots), in unit order,
    # after the units of every lower bin: a counting sort with no communication between
    # programs (each recomputes the hot limit as program 0 does, the same fp32 value).
    ar = tl.arange(0, BLOCK)
    pid = tl.program_id(0)
    limit = _hot_limit(per_ptr, f, factor, hot_min, BLOCK)
    if pid == 0:
        n_heavy = tl.sum(tl.zeros([BLOCK], dtype=tl.int64), axis=0)
        for m0 in range(0, M, BLOCK):
            m = m0 + ar
            heavy = (m < M) & (tl.load(cnt_ptr + m, mask=m < M, other=0) > W)
            flag = heavy.to(tl.int64)
            tl.store(heavy_ptr + n_heavy + tl.cumsum(flag, axis=0) - 1, m.to(tl.int64), mask=heavy)
            n_heavy += tl.sum(flag, axis=0)
        for m0 in range(0, M, BLOCK):
            m = m0 + ar
            tl.store(heavy_ptr + m, tl.zeros([BLOCK], dtype=tl.int64), mask=(m < M) & (m >= n_heavy))
        n_hot = tl.sum(tl.zeros([BLOCK], dtype=tl.int64), axis=0)
        hot_slots = tl.sum(tl.zeros([BLOCK], dtype=tl.int64), axis=0)
        for j0 in range(0, f, BLOCK):
            j = j0 + ar
            per = tl.load(per_ptr + j, mask=j < f, other=0)
            hot = (j < f) & (per.to(tl.float32) > limit)
            tl.store(hot_ptr + j, hot.to(tl.int8), mask=j < f)
            n_hot += tl.sum(hot.to(tl.int64), axis=0)
            hot_slots += tl.sum(tl.where(hot, per, 0), axis=0)
        tl.store(info_ptr, n_heavy)
        tl.store(info_ptr + 1, n_hot)
        tl.store(info_ptr + 2, hot_slots)
    else:
        mine = first_bin + pid - 1
        place = tl.sum(tl.zeros([BLOCK], dtype=tl.int64), axis=0)
        for j0 in range(0, f, BLOCK):  # the units of lower bins come first
            j = j0 + ar
            per = tl.load(per_ptr + j, mask=j < f, other=0)
            b = _schedule_bin(per, per.to(tl.float32) > limit, first_bin)
            place += tl.sum(((j < f) & (b < mine)).to(tl.int64), axis=0)
        for j0 in range(0, f, BLOCK):
            j = j0 + ar
            per = tl.load(per_ptr + j, mask=j < f, other=0)
            flag = ((j < f) & (_schedule_bin(per, per.to(tl.float32) > limit, first_bin) == mine)).to(tl.int64)
            tl.store(sched_ptr + place + tl.cumsum(flag, axis=0) - 1, j.to(tl.int64), mask=flag != 0)
            place += tl.sum(flag, axis=0)


def _check_ell(cols: torch.Tensor, counts: torch.Tensor) -> None:
    if cols.dim() != 2 or not cols.is_contiguous() or cols.dtype not in (torch.int16, torch.int32):
        raise ValueError(f"cols must be a contiguous [M, W] int16/int32 tensor, got {list(cols.shape)} {cols.dtype}")
    if counts.shape != (cols.shape[0],) or counts.dtype != torch.int32 or not counts.is_contiguous() \
            or counts.device != cols.device:
        raise ValueError(f"counts must be a contiguous [M] = [{cols.shape[0]}] int32 tensor on {cols.device}, "
                         f"got {list(counts.shape)} {counts.dtype} on {counts.device}")


def light_unit_counts(cols: torch.Tensor, counts: torch.Tensor, f: int) -> torch.Tensor:
    """``[f]`` int64: how many used slots of light rows hold each unit.

    Reference: ``bincount(cols[m, s] for m with counts[m] <= W, s < counts[m])``. ``cols [M, W]``
    int16/int32 and ``counts [M]`` int32 as :func:`twell.kernels.train_ffn.pack_rows` returns them.
    """
    _check_ell(cols, counts)
    out = torch.zeros(f, dtype=torch.int64, device=cols.device)
    n = cols.numel()
    if n:
        with on_device_of(cols):
            _unit_counts_kernel[(triton.cdiv(n, _BLOCK),)](cols, counts, out, n, cols.shape[1], BLOCK=_BLOCK)
    return out


def slot_keys(cols: torch.Tensor, counts: torch.Tensor, f: int, exclude: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[M W]`` sort keys (dtype :func:`key_dtype`) of the flat slots: the unit of each used
    slot of a light row, unless ``exclude [f]`` (bool) marks it; every other slot ``p`` gets
    ``f + p % TRASH_KEYS``."""
    _check_ell(cols, counts)
    n = cols.numel()
    key = torch.empty(n, dtype=key_dtype(f), device=cols.device)
    if exclude is not None and (exclude.shape != (f,) or exclude.dtype != torch.bool or exclude.device != cols.device):
        raise ValueError(f"exclude must be an [f] = [{f}] bool tensor on {cols.device}, got {list(exclude.shape)} "
                         f"{exclude.dtype} on {exclude.device}")
    if n:
        with on_device_of(cols):
            _slot_keys_kernel[(triton.cdiv(n, _BLOCK),)](
                cols, counts, key if exclude is None else exclude.view(torch.int8), key, n, cols.shape[1], f,
                HAS_EX=exclude is not None, TRASH=TRASH_KEYS, BLOCK=_BLOCK)
    return key


def unit_index(cols: torch.Tensor, counts: torch.Tensor, f: int,
               exclude: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The transposed (per-unit, CSC) view of the light rows' used slots, on the device, with no
    host sync.

    Args:
        cols ``[M, W]``, counts ``[M]`` int32: ELL rows; f: number of units.
        exclude: optional ``[f]`` bool, units to leave out (their ranges come out empty: the
            caller handles them otherwise, e.g. densely).

    Returns:
        ``(order [M W] int64, offsets [f + 1] int64)``: the flat slot indices ``m W + s``
        grouped by unit (unit j's are ``order[offsets[j]:offsets[j + 1]]``, ascending, so its
        tokens come in order). Unused slots, heavy rows' slots and excluded units' slots are
        keyed f or above and sorted past every unit.
    """
    sorted_key, order = torch.sort(slot_keys(cols, counts, f, exclude), stable=True)
    # unit j's slots start at the first key >= j: a binary search per unit, no atomics
    offsets = torch.searchsorted(sorted_key, torch.arange(f + 1, dtype=sorted_key.dtype, device=cols.device))
    return order, offsets


def heavy_and_hot(counts: torch.Tensor, W: int, per_unit: torch.Tensor, hot_min: float, hot_factor: float):
    """``(heavy, n_heavy, hot, info, schedule)``, one launch, no host sync.

    Args:
        counts: ``[M]`` int32 active units per row; W: the ELL width.
        per_unit: ``[f]`` int64 light slots per unit (:func:`light_unit_counts`).
        hot_min, hot_factor: a unit is hot when it holds more than
            ``max(hot_min, hot_factor x sum(per_unit) / f)`` slots (the limit in fp32).

    Returns:
        ``heavy [M]`` int64, the rows with ``counts > W`` in ascending order, then zeros;
        ``n_heavy`` int64 scalar tensor, how many; ``hot [f]`` bool; ``info [3]`` int64 =
        (n_heavy, hot units, light slots at hot units); ``schedule [f]`` int64, a permutation
        of the units, the most light slots first by half octaves (of the slot count as fp32),
        then units with none, then the hot units, in unit order within each
        group: the order in which :func:`twell.kernels.train_ffn.ffn_weight_grads` takes them
        (``units``), so that a long unit does not start last and run alone at the end of the
        launch.
    """
    M, f = counts.shape[0], per_unit.shape[0]
    if counts.dtype != torch.int32 or per_unit.dtype != torch.int64 or per_unit.device != counts.device \
            or not counts.is_contiguous() or not per_unit.is_contiguous():
        raise ValueError(f"counts must be contiguous int32 and per_unit contiguous int64 on one device, got "
                         f"{counts.dtype} on {counts.device} and {per_unit.dtype} on {per_unit.device}")
    dev = counts.device
    heavy = torch.empty(max(M, 1), dtype=torch.int64, device=dev)[:M]  # (a valid pointer at M = 0)
    hot = torch.empty(f, dtype=torch.bool, device=dev)
    info = torch.empty(3, dtype=torch.int64, device=dev)
    sched = torch.empty(f, dtype=torch.int64, device=dev)
    if f == 0:  # no unit: no count exceeds W >= 1, no row is heavy, no unit hot
        heavy.zero_(), info.zero_()
    else:
        # a unit has at most M light slots: half octave at most 2 floor(log2 M) + 2
        top = min(2 * max(M, 1).bit_length(), 63)
        with on_device_of(counts):
            _heavy_hot_kernel[(1 + top + 2,)](counts, per_unit, heavy, hot.view(torch.int8), info, sched, M, W, f,
                                             float(hot_factor) / f, float(hot_min), 63 - top, BLOCK=_STEP, num_warps=8)
    return heavy, info[0], hot, info, sched

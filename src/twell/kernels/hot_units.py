"""Hot units: a layer's most frequently active units computed as one small dense block.

The up/down kernels gather 4 d bytes of weight rows per (token, active unit): about 1 ns per
pair at 131072 tokens on the H100 and H200. A unit that fires
for a share ``p`` of the tokens costs ``p`` such gathers per token, while as a dense column of a
cuBLAS product it costs about ``4 d`` flops per token whatever ``p`` (a hundredth of a gather).
So past a share of about 1% a unit is cheaper dense. Layers whose units fire at skewed rates
(trained models; the benchmark's ``skewed`` units) have a few such units, and they carry a large
part of the pairs: about half at ``k = 29`` with 256 hot units.

With a hot set ``H`` of ``nh`` units, one FFN call is::

    pre   = x w_gate^T                          (cuBLAS, all f columns, as without hot units)
    up_H  = x w_up[H]^T                         (hot_up: cuBLAS, [M, nh])
    pack  TwELL of the cold columns only; up_H overwritten by h_H = relu(pre[:, H]) * up_H
    y     = h_H w_down[:, H]^T                  (hot_down: cuBLAS, written, not added)
    y    += up/down from the TwELL              (the cold units: the kernels add to y's rows)
    rows computed whole (heavy rows, overflowed tiles) are then written over, all f units

The same sum as the dense MLP's, split in two: the hot part accumulates in fp32 in cuBLAS and is
rounded to y's dtype, the cold part accumulates in fp32 on top of it and is rounded once more.
In float16 that first rounding can overflow where the dense MLP's single one would not (a hot
part beyond 65504 that the cold units bring back into range), so the module takes hot units in
bfloat16 and float32 only (:meth:`twell.inference.dispatch.LayerState._hot_for`).

Why this order (the hot product written first, the kernels adding to it) and the pack writing
``h_H``, rather than the hot product added last (``addmm``, a second read and write of y) after a
zero fill of ``g_hot`` and a separate ``g_hot * up_H`` pass: on the H100 at 131072 tokens, skewed k
29 with 320 hot units (kernel medians): the down product 0.53 -> 0.30 ms, the fill and the product
pass (0.10 ms) gone, against the pack +0.06 ms and the down kernel +0.04 ms (it reads y's rows): the
call's kernels 7.22 -> 7.00 ms.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..checks import check_tensor

__all__ = ["HotUnits", "hot_units", "hot_up", "hot_down", "hot_words_of"]


@dataclass
class HotUnits:
    """A hot set of ``nh`` units out of ``f``, on one device, in the forms the kernels read.

    ``units [nh]`` int64: the hot units in ascending order; ``words [ceil(f / 32)]`` int32: bit
    ``b`` of word ``w`` set where unit ``32 w + b`` is hot (the pack masks its bit words with
    them); ``starts [ceil(f / 32) + 1]`` int32: how many hot units lie below column ``32 w``
    (the hot units of columns ``32 w`` to ``32 v - 1`` are ``units[starts[w]:starts[v]]``)."""

    units: torch.Tensor
    words: torch.Tensor
    starts: torch.Tensor
    f: int

    @property
    def n(self) -> int:
        return self.units.shape[0]

    def check(self, f: int, device) -> None:
        """Raise unless this set is for ``f`` units on ``device`` and consistent."""
        nw = (f + 31) // 32
        if self.f != f or self.words.shape != (nw,) or self.starts.shape != (nw + 1,):
            raise ValueError(f"hot units are for f = {self.f} (words {list(self.words.shape)}, starts "
                             f"{list(self.starts.shape)}), not f = {f}")
        for t, name, dt in ((self.units, "units", torch.int64), (self.words, "words", torch.int32),
                            (self.starts, "starts", torch.int32)):
            if t.dtype != dt or t.dim() != 1 or not t.is_contiguous() or t.device != torch.device(device):
                raise ValueError(f"hot units' {name} must be a contiguous 1-d {dt} tensor on {device}, "
                                 f"got {t.dtype} {list(t.shape)} on {t.device}")


def hot_words_of(units: torch.Tensor, f: int) -> torch.Tensor:
    """``[ceil(f / 32)]`` int32 bit words of the hot ``units`` (int64) out of ``f``."""
    flag = torch.zeros(f, dtype=torch.int64, device=units.device)
    flag[units] = 1  # (f entries, not the padded words: a unit >= f is an index error here)
    flag = torch.cat([flag, flag.new_zeros((-f) % 32)])
    bits = flag.view(-1, 32) << torch.arange(32, device=units.device, dtype=torch.int64)
    words = bits.sum(dim=1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # bit 31: the sign bit


def hot_units(units: torch.Tensor, f: int) -> HotUnits:
    """The :class:`HotUnits` of the unit indices ``units`` (any order, no repeats) out of ``f``,
    made on ``units``' device without a host synchronisation."""
    check_tensor(units, "units", dim=1, dtypes=(torch.int64, torch.int32))
    units = torch.sort(units.to(torch.int64)).values
    if units.numel() > f:
        raise ValueError(f"{units.numel()} hot units out of f = {f}")
    words = hot_words_of(units, f)
    bounds = torch.arange(0, 32 * (words.shape[0] + 1), 32, device=units.device, dtype=torch.int64)
    starts = torch.searchsorted(units, bounds).to(torch.int32)  # hot units below each 32 w
    return HotUnits(units, words, starts, f)


def hot_up(x: torch.Tensor, hot: HotUnits, w_up: torch.Tensor) -> torch.Tensor:
    """``[M, nh]`` the hot units' up projection ``x w_up[H]^T`` (cuBLAS), for
    :func:`twell.kernels.gate_pack.pack_relu_hot` to turn into their hidden values in place.

    Args: x ``[M, d]``; hot: the hot set; w_up ``[f, d]`` (rows of unit stride, any row stride).
    """
    return torch.mm(x, w_up.index_select(0, hot.units).t())  # 2 nh d bytes gathered per call


def hot_down(h_hot: torch.Tensor, hot: HotUnits, w_down_t: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = h_hot w_down[:, H]^T`` (cuBLAS, written over ``out``, which the up/down kernels
    then add the cold units to); returns ``out``.

    Args:
        h_hot: ``[M, nh]`` the hot units' hidden values (:func:`twell.kernels.gate_pack.pack_relu_hot`).
        hot: the hot set; w_down_t: ``[f, d]`` down rows; out: ``[M, d]`` (h_hot's dtype).
    """
    return torch.mm(h_hot, w_down_t.index_select(0, hot.units), out=out)  # [nh, d]: 2 nh d bytes

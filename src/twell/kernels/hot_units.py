"""Hot units: a layer's most frequently active units computed as one small dense block.

The up/down kernels gather 4 d bytes of weight rows per (token, active unit): about 1 ns per
pair at 131072 tokens on the H100 and H200 (benchmarks/NOTES_inference.md). A unit that fires
for a share ``p`` of the tokens costs ``p`` such gathers per token, while as a dense column of a
cuBLAS product it costs about ``4 d`` flops per token whatever ``p`` (a hundredth of a gather).
So past a share of about 1% a unit is cheaper dense. Layers whose units fire at skewed rates
(trained models; the benchmark's ``skewed`` units) have a few such units, and they carry a large
part of the pairs: about half at ``k = 29`` with 256 hot units (benchmarks/hot_units_probe.py).

With a hot set ``H`` of ``nh`` units, one FFN call is::

    pre   = x w_gate^T                         (cuBLAS, all f columns, as without hot units)
    pack  TwELL of the cold columns only; g_hot [M, nh] = relu(pre[:, H])   (one pass over pre)
    y     = up/down from the TwELL                                          (the cold units)
    y    += (g_hot * (x w_up[H]^T)) w_down[:, H]^T                          (hot_block: cuBLAS)
    rows computed whole (heavy rows, overflowed tiles) are then written over, all f units

The same sum as the dense MLP's, split in two; each part accumulates in fp32 and y is rounded
once more than dense's (the cold part's bf16 y before the hot product adds to it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..checks import check_tensor

__all__ = ["HotUnits", "hot_units", "hot_block", "hot_words_of"]


@dataclass
class HotUnits:
    """A hot set of ``nh`` units out of ``f``, on one device, in the three forms the kernels read.

    ``units [nh]`` int64: the hot units in ascending order; ``pos [f]`` int32: a unit's place in
    ``units``, -1 for a cold unit; ``words [ceil(f / 32)]`` int32: bit ``b`` of word ``w`` set
    where unit ``32 w + b`` is hot (the pack masks its bit words with them)."""

    units: torch.Tensor
    pos: torch.Tensor
    words: torch.Tensor

    @property
    def n(self) -> int:
        return self.units.shape[0]

    @property
    def f(self) -> int:
        return self.pos.shape[0]

    def check(self, f: int, device) -> None:
        """Raise unless this set is for ``f`` units on ``device`` and consistent."""
        if self.f != f or self.words.shape != ((f + 31) // 32,):
            raise ValueError(f"hot units are for f = {self.f} (words {list(self.words.shape)}), not f = {f}")
        for t, name, dt in ((self.units, "units", torch.int64), (self.pos, "pos", torch.int32), (self.words, "words", torch.int32)):
            if t.dtype != dt or t.dim() != 1 or not t.is_contiguous() or t.device != torch.device(device):
                raise ValueError(f"hot units' {name} must be a contiguous 1-d {dt} tensor on {device}, "
                                 f"got {t.dtype} {list(t.shape)} on {t.device}")


def hot_words_of(pos: torch.Tensor) -> torch.Tensor:
    """``[ceil(f / 32)]`` int32 bit words of the hot units marked in ``pos [f]`` (>= 0: hot)."""
    f = pos.shape[0]
    flag = torch.zeros((f + 31) // 32 * 32, dtype=torch.int64, device=pos.device)
    flag[:f] = (pos >= 0).to(torch.int64)
    bits = flag.view(-1, 32) << torch.arange(32, device=pos.device, dtype=torch.int64)
    words = bits.sum(dim=1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # bit 31: the sign bit


def hot_units(units: torch.Tensor, f: int) -> HotUnits:
    """The :class:`HotUnits` of the unit indices ``units`` (any order, no repeats) out of ``f``,
    made on ``units``' device without a host synchronisation."""
    check_tensor(units, "units", dim=1, dtypes=(torch.int64, torch.int32))
    units = torch.sort(units.to(torch.int64)).values
    if units.numel() > f:
        raise ValueError(f"{units.numel()} hot units out of f = {f}")
    pos = torch.full((f,), -1, dtype=torch.int32, device=units.device)
    pos[units] = torch.arange(units.numel(), dtype=torch.int32, device=units.device)
    return HotUnits(units, pos, hot_words_of(pos))


def hot_block(
    x: torch.Tensor,
    g_hot: torch.Tensor,
    hot: HotUnits,
    w_down_t: torch.Tensor,
    out: torch.Tensor,
    w_up: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``out += h_hot w_down[:, H]^T`` with ``h_hot = g_hot * (x w_up[H]^T)`` (gated) or
    ``g_hot`` (non-gated), in place; returns ``out``.

    Args:
        x: ``[M, d]``; g_hot: ``[M, nh]`` the hot units' ``relu`` of the first projection, as
            :func:`twell.kernels.gate_pack.pack_relu_hot` writes it (x's dtype, contiguous).
        hot: the hot set; w_down_t: ``[f, d]`` down rows; w_up: ``[f, d]`` (gated) or None.
        out: ``[M, d]`` (x's dtype), the cold units' y.
    """
    if hot.n == 0 or x.shape[0] == 0:
        return out
    down = w_down_t.index_select(0, hot.units)  # [nh, d]: 4 nh d bytes, gathered per call
    # g_hot is relu(pre) already (the pack stored the units that fire, zeros elsewhere), so
    # relu(g) * u is one in-place product; a PyTorch op issues faster than a Triton launch
    h = g_hot if w_up is None else torch.mm(x, w_up.index_select(0, hot.units).t()).mul_(g_hot)
    return out.addmm_(h, down)

"""Inputs for the kernel tests: gates with chosen, adversarial sparsity patterns.

Column 0 of x is the constant 1 and column 0 of the first projection holds minus a threshold,
so the pattern is set by a few numbers: zero rows (x[m, 1:] = 0), dense rows (x[m, 0] very
negative flips every threshold), heavy rows (x[m, 0] = 0: about half the units), hot units
(negative threshold: fire for every token), dead units (large threshold).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch


def gate_case(M: int, d: int, f: int, dtype=torch.float32, seed: int = 0, density: float = 0.08, adversarial: bool = True):
    """``(x [M, d], w_first [f, d], w_up [f, d], w_down [d, f])`` with a controlled ReLU pattern."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, d, generator=g)
    w = torch.randn(f, d, generator=g) / math.sqrt(d - 1)
    # z = x[1:] . w[1:] ~ N(0, 1): threshold for the wanted density
    t = float(torch.special.ndtri(torch.tensor(1.0 - density, dtype=torch.float64)))
    x[:, 0] = 1.0
    w[:, 0] = -t
    if adversarial:
        if M > 3:
            x[1] = 0.0  # all-zero row (a = 0 exactly: no active unit)
            x[2, 0] = -40.0  # dense row: every tile overflows
            x[M - 1, 0] = 0.0  # heavy row: about half the units
        if f > 4:
            w[3, 0] = 30.0  # hot unit
            w[f - 2, 0] = -30.0  # dead unit (except in the dense row)
    w_up = torch.randn(f, d, generator=g) / math.sqrt(d)
    w_down = torch.randn(d, f, generator=g) / math.sqrt(f)
    return tuple(t_.to(dtype) for t_ in (x, w, w_up, w_down))


def packed(a: torch.Tensor, tile: int, compression: int):
    """``relu(a)`` in TwELL as the pack kernels leave it, for the tests of the kernels that read
    TwELL: the true counts, the entries of every tile that fits its slots, and every other slot
    (past a tile's count, all of an overflowed tile's) as ``torch.empty`` left it, NaN under the
    tests' fixture.

    Built in PyTorch: under the Triton interpreter ``pack_relu`` takes 0.2 to 0.9 s a call,
    most of a consumer test's time, and ``tests/test_kernels_pack.py`` checks that it writes
    exactly these entries and counts (``assert_same_twell``)."""
    from twell.format import pack_twell
    from twell.kernels.gate_pack import empty_twell

    ref = pack_twell(torch.relu(a), tile, compression)
    out = empty_twell(a.shape[0], a.shape[1], tile, compression, a.dtype, a.device)
    out.counts.copy_(ref.counts)
    used = torch.arange(out.slots) < out.counts.unsqueeze(-1)
    used &= ~out.overflowed().unsqueeze(-1)
    out.values[used] = ref.values[used]
    out.cols[used] = ref.cols[used]
    return out


# Poisoned buffers, for the tests that check what a kernel leaves alone: outputs that are the
# first M rows of GUARD-row-longer buffers filled with NaN (floats) or I16 (integers).
GUARD = 4
I16 = 12345


def poison_(t: torch.Tensor) -> torch.Tensor:
    """``t`` filled in place with NaN (floating point) or I16 (integers)."""
    return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(I16)


def untouched(t: torch.Tensor) -> torch.Tensor:
    """Where ``t`` still holds :func:`poison_`'s value."""
    return torch.isnan(t) if t.is_floating_point() else t == I16


class Guarded(NamedTuple):
    """One buffer :func:`guard_empty` handed out: ``base[before:before + rows]`` is what the
    caller got; ``guards`` are the slices of ``base`` in front of it and after it."""

    base: torch.Tensor
    before: int
    rows: int

    @property
    def guards(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.base[: self.before], self.base[self.before + self.rows :]


def guard_empty(monkeypatch, chosen=lambda size, kw: True, after: int = GUARD, before: int = 0, fill=poison_):
    """Make ``torch.empty`` hand out guarded buffers, for the tests that check a kernel neither
    writes nor reads past the buffers its launcher allocates.

    For each call with an integer size that ``chosen(size, kw)`` accepts, the caller gets rows
    ``[before, before + size[0])`` of a buffer ``before + size[0] + after`` rows long, all filled
    by ``fill`` (by default :func:`poison_`: NaN, or I16 for integers). A write past the buffer
    then changes a guard row, which the test sees, instead of corrupting the heap (which the
    interpreter shows only as a crash, at random); a read past it gets the fill, which the test
    can choose to spoil the result. Every other call goes to the real ``torch.empty``.

    Returns the list of :class:`Guarded` buffers handed out, in order, filled as calls come."""
    real = torch.empty
    handed: list[Guarded] = []

    def empty(*size, **kw):
        dims = tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else size
        if not dims or not all(isinstance(n, int) for n in dims) or not chosen(dims, kw):
            return real(*size, **kw)
        base = fill(real(before + dims[0] + after, *dims[1:], **kw))
        handed.append(Guarded(base, before, dims[0]))
        return base[before : before + dims[0]]

    monkeypatch.setattr(torch, "empty", empty)
    return handed


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64 (NaN if out has any NaN)."""
    out, ref = out.double(), ref.double()
    if torch.isnan(out).any():
        return float("nan")
    return float((out - ref).norm() / ref.norm().clamp(min=1e-30))


def case_id(value):
    """Test ids with dtypes by name (``float16``, not ``dtype3``)."""
    return str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else None

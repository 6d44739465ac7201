"""Synthetic FFN inputs whose ReLU gate has a chosen sparsity.

The gate of token ``m`` and unit ``j`` is ``a = x[m] . w_gate[j]``. Column 0 of ``x`` is the
constant 1 and column 0 of ``w_gate`` holds ``-t_j``, a per-unit threshold, so that
``a = z - t_j`` with ``z = x[m, 1:] . w_gate[j, 1:]``, about ``N(0, s_m^2)`` for random
Gaussian rows (``s_m`` a per-token scale). The thresholds set how often each unit fires:

``even``
    every unit fires for a fraction ``k / f`` of the tokens (one threshold for all).
``skewed``
    30% of the units are dead (never fire), 1% are hot (fire for up to half the tokens), the
    rest fire at log-normally spread rates; the rates sum to ``k``.
``heavy``
    one threshold for all units, but token scales ``s_m`` are log-normal (sigma 0.6 unless
    asked), so a few rows carry tens of times the mean number of active units (they overflow
    TwELL tiles).

In each case the mean number of active units per token is ``k`` up to sampling noise (the
generator calibrates on a sample of rows; the benchmark records the measured mean too).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["DISTRIBUTIONS", "SyntheticFFN", "make_ffn"]

DISTRIBUTIONS = ("even", "skewed", "heavy")


@dataclass
class SyntheticFFN:
    """Inputs of one gated FFN: ``x [M, d]``, ``w_gate``/``w_up [f, d]``, ``w_down [d, f]``."""

    x: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor
    k: float
    distribution: str


def _unit_rates(f: int, k: float, gen: torch.Generator, device) -> torch.Tensor:
    """Per-unit firing rates for ``skewed``: 30% dead, 1% hot, log-normal rest; sum = k."""
    n_dead = int(0.3 * f)
    n_hot = max(1, int(0.01 * f))
    perm = torch.randperm(f, generator=gen, device="cpu").to(device)
    weight = torch.exp(torch.randn(f, generator=gen, device="cpu")).to(device)
    weight[perm[n_dead : n_dead + n_hot]] *= 60.0
    weight[perm[:n_dead]] = 0.0
    cap = 0.5
    if k > cap * (f - n_dead) * 0.999:
        raise ValueError(f"skewed: k = {k} is more than this distribution can reach ({cap * (f - n_dead):.0f})")
    lo, hi = 0.0, 1.0
    while (weight * hi).clamp(max=cap).sum() < k:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        if (weight * mid).clamp(max=cap).sum() < k:
            lo = mid
        else:
            hi = mid
    return (weight * hi).clamp(max=cap)


def make_ffn(
    M: int,
    d: int,
    f: int,
    k: float,
    distribution: str = "even",
    dtype=torch.bfloat16,
    device="cpu",
    seed: int = 0,
    heavy_sigma: float = 0.6,
) -> SyntheticFFN:
    """Random FFN inputs whose ReLU gate has about ``k`` active units per token on average.

    Args:
        M, d, f: tokens, hidden size, intermediate size (d >= 2).
        k: mean active units per token, 0 < k <= f (``skewed`` reaches at most 0.35 f).
        distribution: ``"even"``, ``"skewed"`` or ``"heavy"`` (see the module docstring).
        heavy_sigma: ``"heavy"``'s log-normal sigma of the token scales (smaller: rows of more
            equal length).

    Returns:
        :class:`SyntheticFFN` with tensors of ``dtype`` on ``device``.
    """
    if distribution not in DISTRIBUTIONS:
        raise ValueError(f"distribution must be one of {DISTRIBUTIONS}, got {distribution!r}")
    if d < 2:
        raise ValueError(f"d must be at least 2 (column 0 carries the thresholds), got {d}")
    if not 0 < k <= f:
        raise ValueError(f"k must be in (0, f = {f}], got {k}")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    dev_gen = torch.Generator(device=device).manual_seed(seed + 1)
    x = torch.randn(M, d, generator=dev_gen, device=device)
    scale = torch.ones(M, device=device)
    if distribution == "heavy":
        scale = torch.exp(heavy_sigma * torch.randn(M, generator=dev_gen, device=device))
        x[:, 1:] *= scale[:, None]
    x[:, 0] = 1.0
    w_gate = torch.randn(f, d, generator=dev_gen, device=device) / math.sqrt(d - 1)
    w_gate[:, 0] = 0.0
    if distribution == "skewed":
        p = _unit_rates(f, k, gen, device)
        # z ~ N(0, 1) per unit: fire when z > t_j, t_j = Phi^-1(1 - p_j); dead units: t = 50.
        t = torch.where(p > 0, torch.special.ndtri(1 - p.clamp(min=1e-12, max=1 - 1e-7).double()).float(), torch.full_like(p, 50.0))
    elif k >= f:
        t = torch.full((f,), -10.0 * float(scale.max()) - 10.0, device=device)
    else:
        # one threshold: the (1 - k/f) quantile of z over a sample of rows
        rows = x[: min(M, max(1, 2_000_000 // f))]
        z = (rows.to(dtype).float()[:, 1:] @ w_gate[:, 1:].to(dtype).float().T).flatten()
        n = z.numel()
        q = max(1, min(n, int(round(n * (1 - k / f)))))
        t = torch.full((f,), float(torch.kthvalue(z.cpu(), q).values), device=device)
    w_gate[:, 0] = -t
    w_up = torch.randn(f, d, generator=dev_gen, device=device) / math.sqrt(d)
    w_down = torch.randn(d, f, generator=dev_gen, device=device) / math.sqrt(max(k, 1.0))
    cast = lambda t_: t_.to(dtype).contiguous()  # noqa: E731
    return SyntheticFFN(cast(x), cast(w_gate), cast(w_up), cast(w_down), float(k), distribution)

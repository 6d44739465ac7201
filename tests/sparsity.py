"""Adversarial sparsity patterns for tests: hidden matrices [M, f] with chosen structure."""

from __future__ import annotations

import torch

PATTERNS = ("random", "all_zero_rows", "dense_rows", "heavy_rows", "hot_units", "dead_units", "empty", "full")


def sparse_hidden(M: int, f: int, pattern: str, density: float, seed: int, dtype=torch.float64) -> torch.Tensor:
    """A non-negative ``[M, f]`` matrix (like a ReLU output) with the given pattern.

    Non-zero values are drawn from ``U(0.1, 1.1)`` so they are never accidentally zero.
    """
    g = torch.Generator().manual_seed(seed)
    values = torch.rand(M, f, generator=g, dtype=torch.float64) + 0.1
    mask = torch.rand(M, f, generator=g) < density
    if pattern == "all_zero_rows":
        mask[:: 2] = False
    elif pattern == "dense_rows":
        mask[:: 3] = True
    elif pattern == "heavy_rows":
        heavy = torch.randperm(M, generator=g)[: max(1, M // 5)]
        mask[heavy] = torch.rand(len(heavy), f, generator=g) < 0.9
    elif pattern == "hot_units":
        hot = torch.randperm(f, generator=g)[: max(1, f // 10)]
        mask[:, hot] = True
    elif pattern == "dead_units":
        dead = torch.randperm(f, generator=g)[: max(1, (3 * f) // 10)]
        mask[:, dead] = False
    elif pattern == "empty":
        mask[:] = False
    elif pattern == "full":
        mask[:] = True
    elif pattern != "random":
        raise ValueError(pattern)
    return torch.where(mask, values, torch.zeros((), dtype=torch.float64)).to(dtype)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere gives inf (fails every bound)."""
    out, ref = out.detach().double(), ref.detach().double()
    if not torch.isfinite(out).all():
        return float("inf")
    denom = ref.norm()
    return float((out - ref).norm() / denom) if denom > 0 else float((out - ref).norm())

"""Plain PyTorch oracles for every twell op, forward and backward.

These are the math the kernels must reproduce. They favour clarity over speed: the sparse
variants gather one ``[nnz, d]`` matrix of rows, so use them on test-sized inputs.

Notation (one token is a row of length d, f hidden units)::

    a = x w_gate^T        [M, f]   gate pre-activation
    g = relu(a)           [M, f]   gate; its non-zeros are the pattern P
    u = x w_up^T          [M, f]   up (only needed on P)
    h = g * u             [M, f]   hidden (zero off P)
    y = h w_down^T        [M, d]   down; w_down is [d, f] (nn.Linear layout)

Non-gated: ``h = relu(x w_up^T)``, ``y = h w_down^T``.

Backward, everything restricted to P (relu' is zero off P, and relu'(0) = 0 as in PyTorch)::

    dh  = (dy w_down) on P                 sampled dense-dense product
    du  = dh * g,  da = dh * u             (both zero off P)
    dx  = du w_up + da w_gate              two sparse x dense products
    dw_up = du^T x,  dw_gate = da^T x,  dw_down = dy^T h   transposed sparse x dense
"""

from __future__ import annotations

from typing import Optional

import torch

from .checks import check_mlp_args
from .format import Hybrid, TwELL

__all__ = [
    "gated_mlp",
    "mlp",
    "gate_tiles",
    "fill_overflow",
    "twell_coo",
    "gated_mlp_from_twell",
    "mlp_from_twell",
    "gated_mlp_from_hybrid",
    "mlp_from_hybrid",
    "gated_mlp_backward",
    "mlp_backward",
    "l1_penalty",
]


# --- dense -----------------------------------------------------------------------------------


def gated_mlp(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """Dense ReLU-gated MLP: ``y = (relu(x w_gate^T) * (x w_up^T)) w_down^T``.

    x ``[M, d]``, w_gate ``[f, d]``, w_up ``[f, d]``, w_down ``[d, f]`` -> y ``[M, d]``.
    """
    check_mlp_args(x, w_up, w_down, w_gate)
    return (torch.relu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T


def mlp(x: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """Dense non-gated ReLU MLP: ``y = relu(x w_up^T) w_down^T``; x ``[M, d]`` -> y ``[M, d]``."""
    check_mlp_args(x, w_up, w_down)
    return torch.relu(x @ w_up.T) @ w_down.T


def l1_penalty(h: torch.Tensor) -> torch.Tensor:
    """The L1 term of one layer: mean over tokens of the *sum* over hidden units of ``|h|``.

    This is the convention of the paper's published training code (its equation writes a mean
    over units; with a mean, lambda = 2e-5 would be f times weaker). h ``[..., f]`` -> scalar.
    """
    return h.abs().sum(dim=-1).mean()


# --- TwELL -----------------------------------------------------------------------------------


def gate_tiles(x: torch.Tensor, w_gate: torch.Tensor, rows: torch.Tensor, tiles: torch.Tensor, tile: int) -> torch.Tensor:
    """Recompute whole gate tiles exactly: ``relu(x[r] . w_gate[t*T:(t+1)*T])`` for each pair.

    x ``[M, d]``, w_gate ``[f, d]``, rows and tiles ``[n]`` -> ``[n, tile]`` (zeros past f).
    This is the exact path for overflowed TwELL tiles.
    """
    f = w_gate.shape[0]
    cols = tiles.long().unsqueeze(1) * tile + torch.arange(tile, device=x.device)
    valid = cols < f
    w = w_gate[cols.clamp(max=f - 1)]  # [n, T, d]
    out = torch.relu(torch.einsum("nd,ntd->nt", x[rows.long()], w))
    return torch.where(valid, out, torch.zeros((), dtype=out.dtype, device=out.device))


def fill_overflow(t: TwELL, x: torch.Tensor, w_gate: torch.Tensor) -> TwELL:
    """A copy of ``t`` whose overflowed tiles carry their dense values, recomputed from the gate."""
    index = torch.nonzero(t.overflowed().flatten()).flatten()
    rows, tiles = index // t.n_tiles, index % t.n_tiles
    values = gate_tiles(x, w_gate, rows, tiles, t.tile).to(t.values.dtype)
    return TwELL(t.values, t.cols, t.counts, t.f, t.tile, t.compression, index, values)


def twell_coo(t: TwELL) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(rows, cols, values)`` of every non-zero of a TwELL, with global column indices.

    Overflowed tiles contribute the non-zeros of their dense copy (``t.overflow_values``)."""
    M, n_tiles, slots = t.values.shape
    over = t.overflowed()
    if bool(over.any()) and t.overflow_values is None:
        raise ValueError("overflowed tiles need their values: call fill_overflow(t, x, w_gate) first")
    used = torch.arange(slots, device=t.values.device) < t.counts.unsqueeze(-1)
    used &= ~over.unsqueeze(-1)
    r, tl_, s = torch.nonzero(used, as_tuple=True)
    rows, cols, vals = r, tl_.long() * t.tile + t.cols[r, tl_, s].long(), t.values[r, tl_, s]
    if t.overflow_values is not None and t.overflow_index.numel():
        k, c = torch.nonzero(t.overflow_values, as_tuple=True)
        flat = t.overflow_index[k]
        rows = torch.cat([rows, flat // n_tiles])
        cols = torch.cat([cols, (flat % n_tiles) * t.tile + c])
        vals = torch.cat([vals, t.overflow_values[k, c]])
    return rows, cols, vals


def _down_from_coo(rows, cols, h, w_down, M) -> torch.Tensor:
    y = torch.zeros(M, w_down.shape[0], dtype=w_down.dtype, device=w_down.device)
    return y.index_add_(0, rows, h.unsqueeze(1) * w_down.T[cols])


def _gated_from_coo(x, rows, cols, g, w_up, w_down) -> torch.Tensor:
    u = (x[rows] * w_up[cols]).sum(dim=1)
    return _down_from_coo(rows, cols, g * u, w_down, x.shape[0])


def gated_mlp_from_twell(
    x: torch.Tensor,
    g: TwELL,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    w_gate: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Gated MLP from the gate in TwELL form: for each active (m, j),
    ``h = g[m, j] * (x[m] . w_up[j])`` and ``y[m] += h * w_down[:, j]``.

    x ``[M, d]``, g TwELL ``[M, f]``, w_up ``[f, d]``, w_down ``[d, f]`` -> y ``[M, d]``.
    ``w_gate`` is needed only to recompute overflowed tiles of a kernel-written TwELL.
    """
    check_mlp_args(x, w_up, w_down, w_gate)
    if g.overflow_values is None and bool(g.overflowed().any()):
        if w_gate is None:
            raise ValueError("g has overflowed tiles without values: pass w_gate to recompute them")
        g = fill_overflow(g, x, w_gate)
    rows, cols, vals = twell_coo(g)
    return _gated_from_coo(x, rows, cols, vals, w_up, w_down)


def mlp_from_twell(h: TwELL, w_down: torch.Tensor) -> torch.Tensor:
    """Non-gated down projection from ``h = relu(x w_up^T)`` in TwELL form:
    h TwELL ``[M, f]``, w_down ``[d, f]`` -> y ``[M, d]``."""
    rows, cols, vals = twell_coo(h)
    return _down_from_coo(rows, cols, vals, w_down, h.shape[0])


# --- hybrid ----------------------------------------------------------------------------------


def gated_mlp_from_hybrid(x: torch.Tensor, g: Hybrid, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """Gated MLP from the gate in hybrid form; shapes as :func:`gated_mlp_from_twell`."""
    check_mlp_args(x, w_up, w_down)
    rows, cols, vals = g.to_coo()
    return _gated_from_coo(x, rows, cols, vals, w_up, w_down)


def mlp_from_hybrid(h: Hybrid, w_down: torch.Tensor) -> torch.Tensor:
    """Non-gated down projection from h in hybrid form: ``[M, f]`` -> y ``[M, d]``."""
    rows, cols, vals = h.to_coo()
    return _down_from_coo(rows, cols, vals, w_down, h.shape[0])


def gated_mlp_backward(
    x: torch.Tensor,
    g: Hybrid,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    dy: torch.Tensor,
    l1_coef: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of the gated MLP computed only on the gate's pattern.

    Args:
        x ``[M, d]``; g: the gate ``relu(x w_gate^T)`` in hybrid form ``[M, f]``;
        w_gate, w_up ``[f, d]``; w_down ``[d, f]``; dy ``[M, d]`` the gradient of y.
        l1_coef: if the loss also holds ``l1_coef * sum(|h|)``, its gradient
            ``l1_coef * sign(h)`` is added to dh (pass ``lambda / M`` for the mean over tokens).

    Returns:
        ``(dx [M, d], dw_gate [f, d], dw_up [f, d], dw_down [d, f])``, equal to dense autograd
        of :func:`gated_mlp` up to rounding.
    """
    check_mlp_args(x, w_up, w_down, w_gate)
    rows, cols, gv = g.to_coo()
    xr = x[rows]
    u = (xr * w_up[cols]).sum(dim=1)
    h = gv * u
    dh = (dy[rows] * w_down.T[cols]).sum(dim=1)  # sampled: only on P
    if l1_coef:
        dh = dh + l1_coef * torch.sign(h)
    du, da = dh * gv, dh * u
    dx = torch.zeros_like(x).index_add_(0, rows, du.unsqueeze(1) * w_up[cols] + da.unsqueeze(1) * w_gate[cols])
    dw_up = torch.zeros_like(w_up).index_add_(0, cols, du.unsqueeze(1) * xr)
    dw_gate = torch.zeros_like(w_gate).index_add_(0, cols, da.unsqueeze(1) * xr)
    dw_down_t = torch.zeros_like(w_up).index_add_(0, cols, h.unsqueeze(1) * dy[rows])
    return dx, dw_gate, dw_up, dw_down_t.T.contiguous()


def mlp_backward(
    x: torch.Tensor,
    h: Hybrid,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    dy: torch.Tensor,
    l1_coef: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of the non-gated MLP ``y = relu(x w_up^T) w_down^T`` on the pattern of h.

    h is ``relu(x w_up^T)`` in hybrid form. Returns ``(dx [M, d], dw_up [f, d], dw_down [d, f])``.
    """
    check_mlp_args(x, w_up, w_down)
    rows, cols, hv = h.to_coo()
    xr = x[rows]
    dh = (dy[rows] * w_down.T[cols]).sum(dim=1)
    if l1_coef:
        dh = dh + l1_coef * torch.sign(hv)
    dx = torch.zeros_like(x).index_add_(0, rows, dh.unsqueeze(1) * w_up[cols])
    dw_up = torch.zeros_like(w_up).index_add_(0, cols, dh.unsqueeze(1) * xr)
    dw_down_t = torch.zeros_like(w_up).index_add_(0, cols, hv.unsqueeze(1) * dy[rows])
    return dx, dw_up, dw_down_t.T.contiguous()

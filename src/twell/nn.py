"""Sparse FFN modules: drop-ins for Hugging Face's LlamaMLP with a ReLU gate.

Both modules keep ``nn.Linear`` weights under the Hugging Face names and layouts
(``gate_proj.weight [f, d]``, ``up_proj.weight [f, d]``, ``down_proj.weight [d, f]``), so
``load_state_dict`` from a LlamaMLP works unchanged. After every forward they expose:

- ``l1``: the layer's L1 term, mean over tokens of the sum over hidden units of ``|h|``
  (a scalar tensor that carries gradient in training; None when not computed). The training
  loss is ``cross_entropy + lambda * mean over layers of l1``: see :func:`l1_loss`.
- ``stats``: :class:`SparsityStats` of the call (active units per token, per-unit firings).
- ``fire_counts`` / ``tokens_seen``: firings per unit accumulated since
  :meth:`reset_fire_counts`, for dead-unit tracking (:meth:`dead_units`).

None of these forces a host synchronisation: they are tensors on the module's device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

import torch
from torch import nn

from . import reference

__all__ = ["SparsityStats", "SparseGatedMLP", "SparseMLP", "l1_loss", "sparse_modules"]


@dataclass
class SparsityStats:
    """Sparsity of one forward call.

    Attributes:
        active_mean: scalar float tensor, mean number of active hidden units per token.
        active_max: scalar int64 tensor, the most active units of any token.
        unit_counts: ``[f]`` int64, how many tokens each unit fired for.
        tokens: number of tokens (rows) in the call.
    """

    active_mean: torch.Tensor
    active_max: torch.Tensor
    unit_counts: torch.Tensor
    tokens: int


class _SparseFFN(nn.Module):
    """What the gated and the non-gated modules share: L1, statistics, dead units."""

    hidden_size: int
    intermediate_size: int

    def _init_tracking(self, device) -> None:
        self.track_stats = True
        self.l1: Optional[torch.Tensor] = None
        self.stats: Optional[SparsityStats] = None
        f = self.intermediate_size
        self.register_buffer("fire_counts", torch.zeros(f, dtype=torch.int64, device=device), persistent=False)
        self.register_buffer("tokens_seen", torch.zeros((), dtype=torch.int64, device=device), persistent=False)

    def _check_input(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"input must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() < 1 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"input must be [..., {self.hidden_size}] (hidden_size), got {tuple(x.shape)}")
        if not x.is_floating_point():
            raise TypeError(f"input must be a floating tensor, got {x.dtype}")
        w = self.down_proj.weight
        if x.device != w.device:
            raise ValueError(f"input is on {x.device} but the module's weights are on {w.device}")
        if x.dtype != w.dtype and not torch.is_autocast_enabled(x.device.type):
            raise TypeError(
                f"input has dtype {x.dtype} but the module's weights are {w.dtype}; cast one of them "
                "(or run under torch.autocast)"
            )

    def _record(self, active: torch.Tensor, h: Optional[torch.Tensor]) -> None:
        """active: ``[M, f]`` bool pattern of the call; h: ``[M, f]`` hidden (for the L1 term)."""
        self.l1 = reference.l1_penalty(h) if (h is not None and self.training and torch.is_grad_enabled()) else None
        if not self.track_stats:
            return
        with torch.no_grad():
            per_token = active.sum(dim=1)
            unit_counts = active.sum(dim=0, dtype=torch.int64)
            M = active.shape[0]
            self.stats = SparsityStats(
                active_mean=per_token.float().mean() if M else torch.zeros((), device=active.device),
                active_max=per_token.max() if M else torch.zeros((), dtype=torch.int64, device=active.device),
                unit_counts=unit_counts,
                tokens=M,
            )
            self.fire_counts += unit_counts
            self.tokens_seen += M

    def reset_fire_counts(self) -> None:
        """Start a new window for dead-unit tracking."""
        self.fire_counts.zero_()
        self.tokens_seen.zero_()

    def dead_units(self) -> torch.Tensor:
        """``[f]`` bool: units that did not fire for any token since the last reset."""
        return self.fire_counts == 0

    @torch.no_grad()
    def reinit_dead_units(
        self,
        keep: float = 0.9,
        std: float = 0.02,
        generator: Optional[torch.Generator] = None,
        mask: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """The paper's Eq. 6: for each dead unit j, ``W[j] <- keep * W[j] + (1 - keep) * N(0, std^2)``
        on the first projection (gate for the gated module, up for the non-gated one).

        ``mask`` (``[f]`` bool) names the units to treat as dead; by default, those that have not
        fired since :meth:`reset_fire_counts` (:meth:`dead_units`). Returns the ``[f]`` bool mask
        of re-initialised units (a tensor: reading it needs no sync).
        """
        dead = self.dead_units() if mask is None else mask.to(torch.bool)
        w = self._first_projection().weight
        noise = torch.randn(w.shape, generator=generator, device=w.device, dtype=torch.float32).to(w.dtype) * std
        w.copy_(torch.where(dead.unsqueeze(1), keep * w + (1.0 - keep) * noise, w))
        return dead

    def _first_projection(self) -> nn.Linear:
        raise NotImplementedError


class SparseGatedMLP(_SparseFFN):
    """ReLU-gated MLP: ``y = down(relu(gate(x)) * up(x))``, a drop-in for LlamaMLP.

    Args:
        hidden_size: d. intermediate_size: f. bias: give the three projections biases
            (Hugging Face's ``mlp_bias``).

    Shapes: input ``[..., d]`` -> output ``[..., d]``; ``gate_proj.weight [f, d]``,
    ``up_proj.weight [f, d]``, ``down_proj.weight [d, f]``.

    Example:
        >>> mlp = SparseGatedMLP(64, 176)
        >>> y = mlp(torch.randn(2, 5, 64))
        >>> y.shape, float(mlp.stats.active_mean) <= 176
        (torch.Size([2, 5, 64]), True)
    """

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, device=None, dtype=None):
        super().__init__()
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        kw = dict(bias=bias, device=device, dtype=dtype)
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, **kw)
        self._init_tracking(device)

    @classmethod
    def from_config(cls, config) -> "SparseGatedMLP":
        """Build from a Hugging Face config (``hidden_size``, ``intermediate_size``, ``mlp_bias``)."""
        return cls(config.hidden_size, config.intermediate_size, bias=getattr(config, "mlp_bias", False))

    def _first_projection(self) -> nn.Linear:
        return self.gate_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        shape = x.shape
        x2 = x.reshape(-1, self.hidden_size)
        g = torch.relu(self.gate_proj(x2))
        h = g * self.up_proj(x2)
        y = self.down_proj(h)
        self._record(g > 0, h)
        return y.reshape(shape)

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, gate=relu"


class SparseMLP(_SparseFFN):
    """Non-gated ReLU MLP: ``y = down(relu(up(x)))``.

    Shapes: input ``[..., d]`` -> ``[..., d]``; ``up_proj.weight [f, d]``, ``down_proj.weight [d, f]``.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, device=None, dtype=None):
        super().__init__()
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        kw = dict(bias=bias, device=device, dtype=dtype)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, **kw)
        self._init_tracking(device)

    def _first_projection(self) -> nn.Linear:
        return self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        shape = x.shape
        x2 = x.reshape(-1, self.hidden_size)
        h = torch.relu(self.up_proj(x2))
        y = self.down_proj(h)
        self._record(h > 0, h)
        return y.reshape(shape)

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, act=relu"


def sparse_modules(model: nn.Module) -> list[_SparseFFN]:
    """The twell FFN modules of ``model``, in registration order."""
    return [m for m in model.modules() if isinstance(m, _SparseFFN)]


def l1_loss(model_or_modules) -> torch.Tensor:
    """Mean over layers of each layer's ``l1`` from the last forward (0 if none computed).

    The training loss is ``cross_entropy + lam * l1_loss(model)``; with the sum-over-units
    convention of :func:`twell.reference.l1_penalty`, ``lam = 2e-5`` is the paper's setting.
    """
    modules: Iterable[_SparseFFN] = (
        sparse_modules(model_or_modules) if isinstance(model_or_modules, nn.Module) else model_or_modules
    )
    terms = [m.l1 for m in modules if m.l1 is not None]
    if not terms:
        return torch.zeros(())
    return torch.stack(terms).mean()

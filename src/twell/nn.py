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
from .checks import triton_interpreting

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
        # CUDA inference path: "auto" picks TwELL kernels or dense cuBLAS from measured
        # sparsity, "dense" / "twell" force one; kernel_max_density (None: the measured default)
        # is the break-even share of active units (see _KernelPath).
        self.kernel_mode = "auto"
        self.kernel_max_density: Optional[float] = None
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

    def _record(self, first: torch.Tensor, h: Optional[torch.Tensor]) -> None:
        """first: ``[M, f]`` output of the ReLU, or its pre-activation (``first > 0`` is the call's pattern);
        h: ``[M, f]`` hidden (for the L1 term)."""
        self.l1 = reference.l1_penalty(h) if (h is not None and self.training and torch.is_grad_enabled()) else None
        if not self.track_stats:
            return  # no pass over [M, f] for statistics nobody asked for
        with torch.no_grad():
            active = first > 0
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

    def refresh_kernel_weights(self) -> None:
        """Drop the kernel path's cached weight layouts (rebuilt at the next CUDA inference call).

        The cache notices in-place updates that go through autograd's version counter (optimizer
        steps, ``load_state_dict``, ``copy_`` on the parameter); call this after editing a
        weight through ``.data``, which that counter does not see.
        """
        self.__dict__.pop("_kernel_path_state", None)

    def _load_from_state_dict(self, *args, **kwargs):
        self.refresh_kernel_weights()
        super()._load_from_state_dict(*args, **kwargs)

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
        self.refresh_kernel_weights()
        return dead

    def _first_projection(self) -> nn.Linear:
        raise NotImplementedError


# --- kernel path (inference on CUDA) ----------------------------------------------------------


def _kernel_path(module: "_SparseFFN", x: torch.Tensor) -> Optional["_KernelPath"]:
    """The layer's :class:`_KernelPath` if this call may run the TwELL kernels, else None.

    Eligible: CUDA input (or the Triton interpreter with ``kernel_mode = "twell"``, for tests),
    fp16/bf16 of the weights' dtype, no bias, and no gradient needed (grad mode off, or no
    parameter nor the input requiring grad in eval mode). Anything else keeps the dense path
    untouched, so CPU training never reaches this."""
    mode = module.kernel_mode
    if not (x.is_cuda or (mode == "twell" and triton_interpreting())):
        return None
    w = module.down_proj.weight
    if any(p.dtype != x.dtype for p in module.parameters()) or w.device != x.device or module.down_proj.bias is not None:
        return None
    if x.is_cuda and x.dtype not in (torch.float16, torch.bfloat16):
        return None
    if torch.is_grad_enabled() and (module.training or x.requires_grad or any(p.requires_grad for p in module.parameters())):
        return None
    if torch.is_autocast_enabled(x.device.type):
        return None  # autocast recasts the cuBLAS gate; the dense path follows its rules
    path = module.__dict__.get("_kernel_path_state")
    if path is None:
        path = _KernelPath()
        module.__dict__["_kernel_path_state"] = path
    path._sync_knobs(module)
    return path


class _KernelPath:
    """Per-layer state of the inference path on CUDA: weight layout cache, sparsity estimate.

    Choosing kernels or dense never syncs: after each call the layer's row statistics (mean,
    root mean square and maximum of active units per token, overflowed tiles per token) are
    copied to pinned host memory without blocking, and a later call reads them once its CUDA
    event has completed (``event.query()``). Until a first estimate arrives, and whenever it
    says the layer is too dense, the dense path runs. A call of ``M`` tokens takes the kernels
    while ``cost <= kernel_max_density * f`` (5% more once on them: ``HYSTERESIS``), in active
    units per token::

        cost = mean + 0.1 * (rms - mean) + 850 * max / M + overflowed tiles per token * min(tile, f) / 8

    The up/down kernel runs one program per token, so its time is at least the longest row's
    (about 1 us per entry on the H200, against about 1.2 ns per entry of throughput: the
    ``850 * max / M`` term), and a heavy-tailed layer loses more than its mean says (the rms
    term); an overflowed tile is recomputed exactly at about an eighth of a dense pass over its
    units. The threshold and the weights come from the H200 benchmark
    (benchmarks/NOTES_inference.md); set ``module.kernel_max_density`` to override the
    threshold, or ``module.kernel_mode`` to ``"dense"`` / ``"twell"`` to force a path.

    The dense path taken here (inference only) is the module's own math with ``relu(gate) * up``
    fused into one pass (:func:`twell.kernels.elementwise.relu_mul_`), and the ``[M, f]``
    pattern is only formed when ``track_stats`` is on. ``kernel_mode = "dense"`` takes it too.
    """

    # Break-even density measured on the H200 (d 2048, f 5632, bf16): see NOTES_inference.md.
    DEFAULT_MAX_DENSITY = 0.0102
    RMS_WEIGHT = 0.1
    TAIL_WEIGHT = 850.0
    HYSTERESIS = 1.05  # a layer on the kernels keeps them up to 5% past the threshold

    def __init__(self) -> None:
        self.estimate: Optional[tuple[float, float]] = None  # (cost without the tail, max row)
        self._tile = 256
        self._host: Optional[torch.Tensor] = None
        self._event = None
        self._weights = None
        self._weights_key = None
        self.counters = None  # OverflowCounters, accumulated over the layer's kernel calls
        self._mode = "auto"
        self._max_density = self.DEFAULT_MAX_DENSITY
        self._on_kernels = False  # the previous auto decision

    # -- decision -------------------------------------------------------------------------------

    def _poll(self) -> None:
        if self._event is not None and self._event.query():
            mean, rms, top, over = (float(v) for v in self._host.tolist())
            self.estimate = (mean + self.RMS_WEIGHT * max(0.0, rms - mean) + over * self._tile / 8, top)
            self._event = None

    def cost(self, M: int) -> Optional[float]:
        """Estimated kernel cost of a call of ``M`` tokens, in active units per token."""
        if self.estimate is None:
            return None
        base, top = self.estimate
        return base + self.TAIL_WEIGHT * top / max(M, 1)

    def use_kernels(self, f: int, M: int) -> bool:
        if self._mode == "dense":
            return False
        self._poll()
        if self._mode == "twell":
            return True
        c = self.cost(M)
        if c is None:
            return False
        # Hysteresis: the dense branch estimates from sampled rows, the kernel branch from all of
        # them (a larger maximum), so near the threshold the two would hand over every call.
        limit = self._max_density * f * (self.HYSTERESIS if self._on_kernels else 1.0)
        self._on_kernels = c <= limit
        return self._on_kernels

    def _publish(self, per_row: torch.Tensor, over_per_token: torch.Tensor) -> None:
        """per_row: ``[n]`` active units of (a sample of) the call's rows."""
        if self._event is not None or not per_row.is_cuda or per_row.numel() == 0:
            return  # one probe in flight at a time
        if self._host is None:
            self._host = torch.empty(4, dtype=torch.float32, pin_memory=True)
        p = per_row.float()
        stats = torch.stack([p.mean(), p.square().mean().sqrt(), p.max(), over_per_token.float()])
        self._host.copy_(stats, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()

    def _sync_knobs(self, module) -> None:
        self._mode = module.kernel_mode
        self._max_density = module.kernel_max_density or self.DEFAULT_MAX_DENSITY

    # -- dense inference ------------------------------------------------------------------------

    def _sample(self, g: torch.Tensor) -> None:
        """Publish the active units of up to 4096 rows of the ReLU output ``g``, when a new
        estimate is wanted (one probe in flight at a time)."""
        if self._mode == "dense" or self._event is not None or not g.is_cuda or g.shape[0] == 0:
            return
        self._publish((g[:4096] > 0).sum(dim=1), torch.zeros((), device=g.device))

    def gated_dense(self, module: "SparseGatedMLP", x: torch.Tensor) -> torch.Tensor:
        from .kernels.elementwise import relu_mul_

        shape = x.shape
        x2 = x.reshape(-1, module.hidden_size)
        with torch.no_grad():
            a = module.gate_proj(x2)  # the pre-activation: a > 0 is the ReLU pattern
            self._sample(a)
            module._record(a, None)  # statistics (no L1: no gradient)
            u = module.up_proj(x2)
            # relu(a) * u in one pass, into u (a stays as gate_proj returned it, for any hook)
            y = module.down_proj(relu_mul_(u, a) if u.is_contiguous() and a.is_contiguous() else torch.relu(a) * u)
        return y.reshape(shape)

    def mlp_dense(self, module: "SparseMLP", x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, module.hidden_size)
        with torch.no_grad():
            h = torch.relu(module.up_proj(x2))
            self._sample(h)
            module._record(h, None)
            y = module.down_proj(h)
        return y.reshape(shape)

    # -- kernels --------------------------------------------------------------------------------

    def _cached(self, key, build):
        if self._weights_key != key:
            self._weights = build()
            self._weights_key = key
        return self._weights

    def _run(self, module: "_SparseFFN", x: torch.Tensor, first: torch.Tensor, w_up, w_down_t) -> torch.Tensor:
        from .kernels import OverflowCounters, ffn_from_twell, pack_relu
        from .ops import DEFAULT_COMPRESSION, default_tile

        shape = x.shape
        x2 = x.reshape(-1, module.hidden_size)
        x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
        M, f = x2.shape[0], module.intermediate_size
        if self.counters is None or self.counters.buffer.device != x.device:
            self.counters = OverflowCounters.zeros(x.device)
        # a new estimate only when none is in flight: skip its small launches otherwise
        probe = M > 0 and self._mode != "dense" and self._event is None
        with torch.no_grad():
            before = self.counters.tiles.clone() if probe else None
            pre = torch.mm(x2, first.T)  # cuBLAS gate (measured faster than a fused Triton gate)
            self._tile = min(default_tile(f), f)
            g = pack_relu(pre, default_tile(f), DEFAULT_COMPRESSION)
            track = module.track_stats
            uc = torch.zeros(f, dtype=torch.int32, device=x.device) if track else None
            nnz = torch.empty(M, dtype=torch.int32, device=x.device) if track else None
            y = ffn_from_twell(x2, g, w_down_t, w_up=w_up, pre=pre, counters=self.counters, unit_counts=uc, row_nnz=nnz)
            module.l1 = None
            if M:
                if track:
                    per_token = nnz.long()
                    unit_counts = uc.long()
                    module.stats = SparsityStats(
                        active_mean=per_token.float().mean(), active_max=per_token.max(), unit_counts=unit_counts, tokens=M
                    )
                    module.fire_counts += unit_counts
                    module.tokens_seen += M
                if probe:
                    self._publish(per_token if track else g.counts.sum(dim=1), (self.counters.tiles - before).float() / M)
            elif track:
                z = torch.zeros((), dtype=torch.int64, device=x.device)
                module.stats = SparsityStats(torch.zeros((), device=x.device), z, torch.zeros(f, dtype=torch.int64, device=x.device), 0)
        return y.reshape(shape)

    def gated_forward(self, module: "SparseGatedMLP", x: torch.Tensor) -> torch.Tensor:
        from .ops import prepare_gated_weights

        up, down = module.up_proj.weight, module.down_proj.weight
        key = (up.data_ptr(), up._version, down.data_ptr(), down._version, up.dtype, up.device)
        w = self._cached(key, lambda: prepare_gated_weights(up.detach(), down.detach()))
        return self._run(module, x, module.gate_proj.weight.detach(), w.up, w.down_t)

    def mlp_forward(self, module: "SparseMLP", x: torch.Tensor) -> torch.Tensor:
        down = module.down_proj.weight
        key = (down.data_ptr(), down._version, down.dtype, down.device)
        w_down_t = self._cached(key, lambda: down.detach().T.contiguous())
        return self._run(module, x, module.up_proj.weight.detach(), None, w_down_t)


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
        """``[..., d] -> [..., d]``. On CUDA, when no gradient is needed and there is no bias,
        runs the TwELL kernels if this layer's measured sparsity makes them pay, else dense
        cuBLAS (see :class:`_KernelPath`; ``self.kernel_mode = "dense" | "twell" | "auto"``)."""
        self._check_input(x)
        path = _kernel_path(self, x)
        if path is not None:  # CUDA inference
            if path.use_kernels(self.intermediate_size, x.numel() // self.hidden_size):
                return path.gated_forward(self, x)
            return path.gated_dense(self, x)
        shape = x.shape
        x2 = x.reshape(-1, self.hidden_size)
        g = torch.relu(self.gate_proj(x2))
        h = g * self.up_proj(x2)
        y = self.down_proj(h)
        self._record(g, h)
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
        """``[..., d] -> [..., d]``; picks TwELL kernels or dense cuBLAS as
        :meth:`SparseGatedMLP.forward` does."""
        self._check_input(x)
        path = _kernel_path(self, x)
        if path is not None:  # CUDA inference
            if path.use_kernels(self.intermediate_size, x.numel() // self.hidden_size):
                return path.mlp_forward(self, x)
            return path.mlp_dense(self, x)
        shape = x.shape
        x2 = x.reshape(-1, self.hidden_size)
        h = torch.relu(self.up_proj(x2))
        y = self.down_proj(h)
        self._record(h, h)
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

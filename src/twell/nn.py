"""Sparse FFN modules: drop-ins for Hugging Face's LlamaMLP with a ReLU gate.

Both modules keep ``nn.Linear`` weights under the Hugging Face names and layouts
(``gate_proj.weight [f, d]``, ``up_proj.weight [f, d]``, ``down_proj.weight [d, f]``), so
``load_state_dict`` from a LlamaMLP works unchanged. After every forward they expose:

- ``l1``: the layer's L1 term, mean over tokens of the sum over hidden units of ``|h|``
  (a scalar tensor that carries gradient in training; None when not computed). The training
  loss is ``cross_entropy + lambda * mean over layers of l1``: see :func:`l1_loss`.
- ``stats``: :class:`SparsityStats` of the call (active units per token, per-unit firings).
- ``fire_counts`` / ``tokens_seen``: firings per unit accumulated since
  :meth:`reset_fire_counts`, for dead-unit tracking (:meth:`dead_units`). A module switched to
  eval mode before it recorded anything drops them (None: a served model keeps no buffers for
  statistics it does not take); they come back, zeroed, at the first call that records
  statistics or on return to training mode.

Statistics are kept in training steps (training mode with gradients on); in eval mode, or under
``torch.no_grad()`` / ``torch.inference_mode()``, only when ``track_stats = True`` (serving
should not pay for counts nobody reads). None of these forces a host synchronisation: they are
tensors on the module's device.

In eval mode ``down_proj.weight`` is stored as the transpose of a contiguous ``[f, d]`` matrix
(see :meth:`_SparseFFN.train`): the same ``[d, f]`` tensor to every caller, laid out so that the
inference kernels read a unit's down column as one row, with no second copy of the weights.
"""

from __future__ import annotations

import math
from typing import Iterable, Optional

import torch
from torch import nn
from torch.nn.utils import parametrize

from . import reference
from .training import path as train_path
from .checks import KERNEL_DTYPES, triton_interpreting
from .inference.dispatch import MODES, _distributed
from .optim_layout import follow_layout
from .training.ops import autocast_off, dense_ffn, dense_gated_ffn, layer_ffn, sparse_ffn, sparse_gated_ffn

__all__ = ["SparsityStats", "SparseGatedMLP", "SparseMLP", "l1_loss", "sparse_modules", "use_kernel_layout"]


class SparsityStats:
    """Sparsity of one forward call.

    Attributes:
        active_mean: scalar float tensor, mean number of active hidden units per token.
        active_max: scalar int64 tensor, the most active units of any token.
        unit_counts: ``[f]`` int64, how many tokens each unit fired for.
        tokens: number of tokens (rows) in the call.

    The modules record the call's per-token counts (``per_token [M]``) and compute
    ``active_mean`` and ``active_max`` from them when first read: a training step that nobody
    asks for them costs no launches for them (four small ones per layer per call).
    """

    __slots__ = ("_mean", "_max", "_per_token", "unit_counts", "tokens")

    def __init__(self, active_mean: Optional[torch.Tensor] = None, active_max: Optional[torch.Tensor] = None,
                 unit_counts: Optional[torch.Tensor] = None, tokens: int = 0, *,
                 per_token: Optional[torch.Tensor] = None) -> None:
        if per_token is None and (active_mean is None or active_max is None):
            raise ValueError("SparsityStats needs active_mean and active_max, or per_token")
        self._mean, self._max, self._per_token = active_mean, active_max, per_token
        self.unit_counts, self.tokens = unit_counts, tokens

    @property
    def active_mean(self) -> torch.Tensor:
        if self._mean is None:
            p = self._per_token
            self._mean = p.float().mean() if self.tokens else torch.zeros((), device=p.device)
        return self._mean

    @property
    def active_max(self) -> torch.Tensor:
        if self._max is None:
            p = self._per_token
            self._max = p.long().max() if self.tokens else torch.zeros((), dtype=torch.int64, device=p.device)
        return self._max

    def __repr__(self) -> str:
        return (f"SparsityStats(active_mean={self.active_mean}, active_max={self.active_max}, "
                f"unit_counts={self.unit_counts}, tokens={self.tokens})")


_HALF = (torch.float16, torch.bfloat16)


def _param(linear: nn.Module, name: str = "weight") -> Optional[torch.Tensor]:
    """``linear.<name>`` (``weight`` or ``bias``) read from the module's parameter dict:
    ``nn.Module.__getattr__`` costs about a microsecond a lookup, and a one-token eager call makes
    four (a visible share of its host time). One that is not a plain parameter (a
    parametrization) or that the module's class defines itself (a property over the stored
    parameter) is read as an attribute."""
    params = linear._parameters
    if name in params and not _class_defines(type(linear), name):
        return params[name]
    return getattr(linear, name)


_CLASS_DEFINES: dict = {}


def _class_defines(cls: type, name: str) -> bool:
    # a plain dict, not functools.lru_cache: torch.compile traces through this function and
    # warns about an lru_cache's wrapper (seen on the H200)
    key = (cls, name)
    known = _CLASS_DEFINES.get(key)
    if known is None:
        known = _CLASS_DEFINES[key] = hasattr(cls, name)
    return known


def _hooked(projections: Iterable[nn.Module]) -> bool:
    """Whether a projection has forward hooks of its own. ``weight_norm``, ``spectral_norm`` and
    pruning recompute the weight in a pre-hook; twell's kernel paths never call the projections,
    so such calls take the dense math, which does."""
    for p in projections:  # a loop, not any(generator): this runs in every inference call
        if p._forward_pre_hooks or p._forward_hooks:
            return True
    return False


_SETTING_CHOICES = {"kernel_mode": MODES, "train_kernels": train_path.TRAIN_MODES}
_DENSITY_SETTINGS = ("kernel_max_density", "train_max_density")


def _token_rows(x: torch.Tensor) -> torch.Tensor:
    """``x [..., d]`` as ``[tokens, d]`` (a view where it can be); unlike ``reshape(-1, d)``
    also for d = 0."""
    return x.reshape(math.prod(x.shape[:-1]), x.shape[-1])


def _is_share(value) -> bool:
    """Whether ``value`` can be a break-even share of active units: a real number >= 0 (not a
    bool, a string or NaN)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0 and math.isfinite(value)


class _SparseFFN(nn.Module):
    """What the gated and the non-gated modules share: L1, statistics, dead units, and the
    inference path (:mod:`twell.inference.dispatch`)."""

    hidden_size: int
    intermediate_size: int

    def _init_tracking(self, device) -> None:
        # None: statistics in training steps only (training mode, gradients on: nobody reads
        # them while serving); True/False force them on or off
        self.track_stats: Optional[bool] = None
        # Inference path on CUDA (see twell.inference.dispatch): "auto" picks decode kernels, prefill
        # kernels or dense cuBLAS per call; "dense", "twell", "decode", "prefill" force one.
        # kernel_max_density (None: the measured default, LayerState.limit) is the prefill
        # kernels' break-even share of active units.
        self.kernel_mode = "auto"
        self.kernel_max_density: Optional[float] = None
        # Training path (gradients wanted) on CUDA, see twell.training.path: "auto" takes the sparse
        # training kernels while this layer's measured sparsity makes them pay (on calls of at least
        # train_path.MIN_SPARSE_TOKENS tokens), "dense" or
        # "sparse" force one; train_max_density (None: the measured default) is the break-even.
        self.train_kernels = "auto"
        self.train_max_density: Optional[float] = None
        self.l1: Optional[torch.Tensor] = None
        self.stats: Optional[SparsityStats] = None
        self._stats_recorded = False  # since the last reset (see _keep_stat_buffers)
        f = self.intermediate_size
        self.register_buffer("fire_counts", torch.zeros(f, dtype=torch.int64, device=device), persistent=False)
        self.register_buffer("tokens_seen", torch.zeros((), dtype=torch.int64, device=device), persistent=False)
        self._new_layer_state()
        # built on CUDA in training mode: the training layout from the start, as .to() gives it
        self._take_mode_layout()

    def __setattr__(self, name: str, value) -> None:
        # the path settings are checked when set: on the CPU (no kernel path) nothing else reads them
        allowed = _SETTING_CHOICES.get(name)
        if allowed is not None and value not in allowed:
            raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
        if name in _DENSITY_SETTINGS and value is not None and not _is_share(value):
            raise ValueError(f"{name} must be None or a number >= 0 (a share of active units), got {value!r}")
        if name == "track_stats" and value not in (None, True, False):
            raise ValueError(f"track_stats must be None, True or False, got {value!r}")
        super().__setattr__(name, value)

    # -- the per-layer inference state: not copied or pickled, rebuilt for each module ---------

    def _new_layer_state(self) -> None:
        from .inference.dispatch import LayerState

        from .training.path import TrainPath

        follow_layout(self)  # this module's down_proj may change layout: optimizer state follows it
        state = LayerState(self)
        self.__dict__["_twell_layer"] = state
        self.__dict__["_twell_key"] = state.key  # the registry key (twell.inference.dispatch.layer_state)
        self.__dict__["_twell_train"] = TrainPath()

    def __getstate__(self):
        state = dict(self.__dict__)
        for key in ("_twell_layer", "_twell_key", "_twell_train"):
            state.pop(key, None)
        # The last forward's L1 term belongs to that forward's autograd graph: deepcopy refuses a
        # non-leaf tensor (an EMA copy taken mid-training would fail), and a copy has run no forward.
        if state.get("l1") is not None:
            state["l1"] = None
        return state

    def __setstate__(self, state):
        # modules pickled before these settings existed
        state.setdefault("train_kernels", "auto")
        state.setdefault("train_max_density", None)
        state.setdefault("_stats_recorded", True)  # counts of unknown age: never dropped unasked
        super().__setstate__(state)
        self._new_layer_state()

    @property
    def last_path(self) -> Optional[str]:
        """The inference path of the last kernel-eligible call: "dense", "decode" or "prefill"."""
        return self._twell_layer.last_path

    @property
    def last_train_path(self) -> Optional[str]:
        """The path of the last call that wanted gradients on CUDA: "dense" or "sparse" (the
        training kernels); None before any."""
        return self._twell_train.last_path

    @property
    def eager_graphs(self):
        """:class:`twell.inference.eager_graphs.EagerGraphs` of this layer: the CUDA graphs its small eager
        inference calls replay (``captures``, ``replays``, ``last``, ``disabled``)."""
        return self._twell_layer.graphs

    @property
    def overflow_counters(self):
        """:class:`twell.kernels.OverflowCounters` of this layer's prefill calls (None before the
        first): (row, tile) pairs and rows that took the exact path."""
        return self._twell_layer.counters

    def _tracking(self) -> bool:
        t = self.track_stats
        # None: in training steps only (training mode with gradients on); a training-mode module
        # called under no_grad or inference_mode serves, and serving reads no statistics
        return (self.training and torch.is_grad_enabled()) if t is None else bool(t)

    # -- weight layout --------------------------------------------------------------------------

    def train(self, mode: bool = True):
        """As ``nn.Module.train``; in eval mode ``down_proj.weight`` is kept as the transpose of a
        contiguous ``[f, d]`` tensor (same values, same ``[d, f]`` shape, strides ``(1, d)``), so
        that the inference kernels read a unit's down column as one contiguous row with no
        second copy of the weights; back in training mode it is made contiguous again, unless
        training on CUDA, where the training kernels read the same layout
        (``twell.training.path.KERNEL_LAYOUT``, on by default). An optimizer's state made in the
        other layout is re-laid out before its next step (:mod:`twell.optim_layout`). Where a
        process group is up, eval mode keeps the layout it finds (:meth:`_take_mode_layout`)."""
        super().train(mode)
        self._take_mode_layout()
        self._keep_stat_buffers(mode or self.track_stats is True)
        return self

    def _apply(self, fn, recurse=True):
        # .to() / .cuda() / .half(): a module moved to CUDA in training mode takes the training
        # layout at once, before an optimizer or a DDP wrapper records its parameters' strides
        super()._apply(fn, recurse)
        if recurse:  # else down_proj (a child) was not moved
            self._take_mode_layout()
        return self

    def _take_mode_layout(self) -> None:
        """The layout of the current mode: the kernels' in eval mode, in training mode where
        :meth:`_trains_in_kernel_layout`. Where a process group is up, eval mode leaves the layout
        as it is: a model loaded in eval mode (``from_pretrained``, then ``twell.sparsify``) must
        stay wrappable by FSDP2's ``fully_shard``, which refuses non-contiguous parameters, and
        DDP's gradient buckets keep the strides they recorded. Inference there runs dense unless
        the model took the kernels' layout before the process group was initialised."""
        if self.training:
            self._set_kernel_layout(self._trains_in_kernel_layout())
        elif not _distributed():
            self._set_kernel_layout(True)

    def _trains_in_kernel_layout(self) -> bool:
        """Whether training keeps the kernel layout too (``train_path.KERNEL_LAYOUT``, weights on
        CUDA, or any device under the Triton interpreter; not in a process group): the training
        ops read it without a copy, and one layout in both modes means an optimizer's state does
        not change strides under it. Decided at each ``train()`` / ``eval()`` and each move
        (``.to()``)."""
        w = self._stored_down_weight()
        if w is None:
            return False
        # Not where a process group is up: FSDP2's fully_shard refuses non-contiguous parameters
        # (a model moved to CUDA in training mode, then sharded, would fail there), and the
        # layout would have to be taken before DDP records the parameters' strides. Nor on the
        # meta device (a model that a later materialisation lays out anyway).
        return (train_path.KERNEL_LAYOUT and not _distributed()
                and (w.is_cuda or (triton_interpreting() and not w.is_meta)))

    def _keep_stat_buffers(self, keep: bool) -> None:
        """``fire_counts`` / ``tokens_seen`` made (zeros) where ``keep`` and missing; dropped where
        not ``keep`` and nothing was recorded since the last reset (on the meta device kept, for
        whoever materialises the module)."""
        counts = self.fire_counts
        if keep and counts is None:
            self._make_stat_buffers(self._first_projection().weight.device)
        elif not keep and counts is not None and counts.device.type != "meta" and not self._stats_recorded:
            self.fire_counts = self.tokens_seen = None

    def _make_stat_buffers(self, device) -> None:
        self.fire_counts = torch.zeros(self.intermediate_size, dtype=torch.int64, device=device)
        self.tokens_seen = torch.zeros((), dtype=torch.int64, device=device)

    def _stored_down_weight(self) -> Optional[torch.Tensor]:
        """``down_proj``'s stored weight, or None under a parametrization: reading
        ``down_proj.weight`` there recomputes it (spectral_norm would advance its power iteration
        at every ``train()``), and the layout of a recomputed weight is not kept anyway."""
        down = self.down_proj
        w = down._parameters.get("weight")
        if w is None and not parametrize.is_parametrized(down):
            w = getattr(down, "weight", None)  # a class's own property, an old-style weight_norm
        return w if isinstance(w, torch.Tensor) else None

    @torch.no_grad()
    def _set_kernel_layout(self, kernel: bool) -> bool:
        """Lay ``down_proj.weight`` out for the kernels (``kernel``) or as ``nn.Linear`` does;
        True when it was laid out anew."""
        w = self._stored_down_weight()
        # only plain local tensors: FSDP's sharded DTensors (and their unsharded views) are FSDP's
        if w is None or type(w.data) is not torch.Tensor or w.dim() != 2:
            return False
        if kernel and w.untyped_storage().nbytes() != w.numel() * w.element_size():
            # a view into a larger buffer (FSDP1's flat parameter with use_orig_params, a user's
            # packed weights): a new tensor would cut it loose from the buffer its owner updates
            return False
        if kernel and not w.t().is_contiguous():
            w.data = w.data.t().contiguous().t()
        elif not kernel and not w.is_contiguous():
            w.data = w.data.contiguous()
        else:
            return False
        g = w.grad
        if g is not None and type(g) is torch.Tensor and g.shape == w.shape:
            # a gradient kept across the change (zero_grad(set_to_none=False), accumulation):
            # later backward passes add into it in place, and fused optimizers read it as flat
            # memory beside the weight, so it takes the weight's layout too
            w.grad = torch.empty_like(w).copy_(g)
        return True

    # -- checks, statistics ---------------------------------------------------------------------

    def _check_input(self, x: torch.Tensor, w: torch.Tensor) -> None:
        """Clear errors before any kernel; ``w``: ``down_proj.weight``. The common case (same
        dtype and device as the weights) is decided first: at one token per call this Python is
        a visible share of the call."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"input must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() < 1 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"input must be [..., {self.hidden_size}] (hidden_size), got {tuple(x.shape)}")
        if x.dtype is w.dtype and x.device == w.device and w.is_floating_point():
            return
        if not x.is_floating_point():
            raise TypeError(f"input must be a floating tensor, got {x.dtype}")
        if x.device != w.device:
            raise ValueError(f"input is on {x.device} but the module's weights are on {w.device}")
        if x.dtype != w.dtype and not torch.is_autocast_enabled(x.device.type):
            raise TypeError(
                f"input has dtype {x.dtype} but the module's weights are {w.dtype}; cast one of them "
                "(or run under torch.autocast)"
            )

    def _inference_ok(self, x: torch.Tensor, w: torch.Tensor) -> bool:
        """True when this call may take the inference path (:mod:`twell.inference.dispatch`): fp16/bf16 on
        CUDA (or fp16/bf16/fp32 under the Triton interpreter with a kernel path forced, for tests), no
        bias, no forward hooks on the projections, no autocast, and no gradient needed (grad mode
        off, or in eval mode with neither the input nor a weight requiring grad). ``w``:
        ``down_proj.weight``."""
        if x.is_cuda:
            if x.dtype not in _HALF:
                return False
        elif self.kernel_mode in ("auto", "dense") or not triton_interpreting() or x.dtype not in KERNEL_DTYPES \
                or x.is_meta:
            return False  # (float64 and the like, or the meta device: the dense math)
        if torch.is_grad_enabled() and (self.training or x.requires_grad or self._weights_require_grad()):
            return False
        if torch.is_autocast_enabled("cuda" if x.is_cuda else x.device.type):
            return False  # autocast recasts the matmuls; the dense path follows its rules
        projections = self._modules
        return (w.dtype == x.dtype and _param(projections["down_proj"], "bias") is None
                and not _hooked(projections.values()))

    def _weights_require_grad(self) -> bool:
        raise NotImplementedError

    # -- training path --------------------------------------------------------------------------

    def _train_choice(self, x: torch.Tensor) -> Optional[tuple[str, int]]:
        """``(path, width)`` of a call that wants gradients and may take the training kernels
        (CUDA, or the Triton interpreter with ``train_kernels`` "sparse" or "dense" for tests; no
        bias; fp32/fp16/bf16 after autocast; no forward hooks on the projections); None: the
        plain dense math, no choice made. While ``torch.compile`` traces: ``("layer",
        LAYER_CHOICE)``, the choice left to the training op at run time
        (:func:`twell.training.ops.layer_ffn`); with ``train_kernels`` "dense" and
        ``twell.training.path.FUSED_DENSE`` off, None (the PyTorch ops, compiled)."""
        if not torch.is_grad_enabled() or self.down_proj.bias is not None or _hooked(self._modules.values()):
            return None
        if not x.is_cuda and not (self.train_kernels != "auto" and triton_interpreting() and not x.is_meta):
            return None
        dev = x.device.type
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        if dtype not in KERNEL_DTYPES:
            return None  # float64 and the like: the dense math
        if torch.compiler.is_compiling():
            if self.train_kernels == "dense" and not train_path.FUSED_DENSE:
                return None  # the dense path as PyTorch ops, which the compiler fuses as it likes
            # The choice reads this layer's measured sparsity on the host and changes with it: made
            # in the op at run time, so that one compiled graph serves every layer and every choice
            return "layer", train_path.LAYER_CHOICE
        return train_path.call_choice(self, x.numel() // max(self.hidden_size, 1), x.is_cuda)

    def _train_kernels(self, x: torch.Tensor, path: str, width: int, weights: tuple) -> torch.Tensor:
        """The FFN of ``x [..., d]`` by twell's training ops, with the L1 term and the statistics
        from the same kernels: ``path`` "sparse", the sparse training kernels at ELL width
        ``width`` (:func:`twell.training.ops.sparse_gated_ffn`); "dense", every row dense in fused
        passes (:func:`twell.training.ops.dense_gated_ffn`); "layer" (under ``torch.compile``),
        either, as the layer chooses at run time (:func:`twell.training.ops.layer_ffn`).
        ``weights``: (first, up, down) gated, (up, down) non-gated. Under autocast the input and
        the weights are cast to its dtype here (differentiably: gradients reach fp32 weights in
        fp32)."""
        shape = x.shape
        x2 = x if x.dim() == 2 else _token_rows(x)
        dev = x.device.type
        if torch.is_autocast_enabled(dev):
            dt = torch.get_autocast_dtype(dev)
            x2, weights = x2.to(dt), tuple(w.to(dt) for w in weights)
        trial = self._twell_train.trial if path != "layer" else None  # a timed call of twell.training.path_timing
        if trial is not None:
            trial.forward_started()
        with autocast_off(dev):
            if path == "layer":
                first, down, up = weights[0], weights[-1], (weights[1] if len(weights) == 3 else None)
                out = layer_ffn(x2.contiguous(), first, down, up, owner=self._first_projection().weight)
            elif path == "sparse":
                out = (sparse_gated_ffn if len(weights) == 3 else sparse_ffn)(x2.contiguous(), *weights, width)
            else:
                out = (dense_gated_ffn if len(weights) == 3 else dense_ffn)(x2.contiguous(), *weights)
        if trial is not None:
            trial.forward_done(out.y)
        self._set_l1(out.l1 if self.training else None)
        if self._tracking():
            self._record_counts(out.row_counts, out.unit_counts)
        if path != "layer":  # (the layer's op notes its own choice)
            self._twell_train.note_call(path, out.row_counts, self.intermediate_size)
        return out.y if x.dim() == 2 else out.y.reshape(shape)

    def _train_dense_done(self, first: torch.Tensor) -> None:
        """After a dense training call that made a path choice: note it, and publish the row
        counts on probe calls (one pass over ``first`` every ``TrainPath.PROBE_EVERY`` calls)."""
        state = self._twell_train
        state.last_path = "dense"
        if state.want_probe() and not (first.is_cuda and torch.cuda.is_current_stream_capturing()):
            with torch.no_grad():
                state.publish((first > 0).sum(dim=1), self.intermediate_size)

    def _infer(self, x: torch.Tensor, w_first: torch.Tensor, w_down: torch.Tensor, w_up: Optional[torch.Tensor]) -> torch.Tensor:
        # kept lean: at one token per call this Python is most of the call's cost
        shape = x.shape
        x2 = x if x.dim() == 2 else _token_rows(x)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        if torch.compiler.is_compiling():
            # the same LayerState.run, behind a custom op the compiled graph calls per call
            from .inference import custom_op  # noqa: F401  (registers torch.ops.twell)

            y = torch.ops.twell.ffn_infer(x2, w_first, w_down, w_up)
        else:
            if self.__dict__["l1"] is not None:  # a plain attribute: skip nn.Module.__setattr__
                self.__dict__["l1"] = None
            y = self._twell_layer.call(x2, w_first, w_down, w_up)
        return y if x.dim() == 2 else y.reshape(shape)

    def _record(self, first: torch.Tensor, h: Optional[torch.Tensor]) -> None:
        """first: ``[M, f]`` output of the ReLU, or its pre-activation (``first > 0`` is the call's pattern);
        h: ``[M, f]`` hidden (for the L1 term)."""
        if h is not None and self.training and torch.is_grad_enabled():
            # no tokens: 0 (and its gradient), as the training ops give it; the mean over no
            # tokens would be NaN and turn the whole loss NaN through l1_loss
            self._set_l1(reference.l1_penalty(h) if h.shape[0] else h.abs().sum())
        else:
            self._set_l1(None)
        if not self._tracking():
            return  # no pass over [M, f] for statistics nobody asked for
        with torch.no_grad():
            active = first > 0
            self._record_counts(active.sum(dim=1), active.sum(dim=0, dtype=torch.int64))

    def _set_l1(self, value: Optional[torch.Tensor]) -> None:
        """``self.l1 = value``: through ``__dict__`` in eager calls (a plain attribute; nn.Module's
        ``__setattr__`` costs microseconds a call), as an attribute write a compiled graph records
        while tracing."""
        if torch.compiler.is_compiling():
            self.l1 = value
        else:
            self.__dict__["l1"] = value

    def _record_counts(self, per_token: torch.Tensor, unit_counts: torch.Tensor) -> None:
        """per_token: ``[M]`` active units of each token; unit_counts: ``[f]`` tokens each unit fired for."""
        M = per_token.shape[0]
        unit_counts = unit_counts.long()
        # mean and max computed when read (SparsityStats); the buffers added to in place; in eager
        # calls the plain attributes set through __dict__ (nn.Module.__setattr__ costs
        # microseconds a call; a compiled graph records the attribute writes it traces instead)
        stats = SparsityStats(unit_counts=unit_counts, tokens=M, per_token=per_token)
        if self.fire_counts is None:  # dropped in eval mode (see _keep_stat_buffers)
            self._make_stat_buffers(unit_counts.device)
        self.fire_counts.add_(unit_counts)
        self.tokens_seen.add_(M)
        if torch.compiler.is_compiling():
            self.stats, self._stats_recorded = stats, True
        else:
            self.__dict__["stats"], self.__dict__["_stats_recorded"] = stats, True

    def reset_fire_counts(self) -> None:
        """Start a new window for dead-unit tracking."""
        if self.fire_counts is not None:
            self.fire_counts.zero_()
            self.tokens_seen.zero_()
        self._stats_recorded = False

    def dead_units(self) -> torch.Tensor:
        """``[f]`` bool: units that did not fire for any token since the last reset."""
        if self.fire_counts is None:  # nothing recorded: every unit
            return torch.ones(self.intermediate_size, dtype=torch.bool, device=self._first_projection().weight.device)
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

        Under FSDP2 the weight is a sharded DTensor: the noise is drawn for the whole ``[f, d]``
        matrix, as without sharding, and each rank applies its own rows of it, so that every
        rank must call this with the same ``generator`` state and the same ``mask`` (the
        trainer sums the firings over ranks for it; a rank's own fire counts are not that), and
        the result is the unsharded model's.
        """
        w = self._first_projection().weight
        if mask is not None and mask.shape != (w.shape[0],):
            raise ValueError(f"mask must be [{w.shape[0]}] (one entry per unit), got {tuple(mask.shape)}")
        dead = self.dead_units() if mask is None else mask.to(w.device, torch.bool)
        noise = torch.randn(w.shape, generator=generator, device=w.device, dtype=torch.float32).to(w.dtype) * std
        # under FSDP2, this rank's rows of the same whole-matrix draw
        noise, dead_rows = laid_out_like(noise, w), laid_out_like(dead.unsqueeze(1).expand(w.shape), w)
        w.copy_(torch.where(dead_rows, keep * w + (1.0 - keep) * noise, w))
        return dead

    def _first_projection(self) -> nn.Linear:
        raise NotImplementedError


def laid_out_like(full: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``full``, a whole tensor of ``target``'s shape and the same on every rank, laid out as
    ``target`` is: for a DTensor (FSDP2's sharded parameters) this rank's shard of it, sliced
    from the rank's own copy (``src_data_rank=None``: no communication); else ``full`` itself."""
    try:
        from torch.distributed.tensor import DTensor, distribute_tensor
    except ImportError:  # a build without torch.distributed
        return full
    if not isinstance(target, DTensor):
        return full
    return distribute_tensor(full.contiguous(), target.device_mesh, target.placements, src_data_rank=None)


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

    def _weights_require_grad(self) -> bool:
        return self.gate_proj.weight.requires_grad or self.up_proj.weight.requires_grad or self.down_proj.weight.requires_grad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., d] -> [..., d]``. On CUDA, when no gradient is needed and there is no bias,
        takes the inference path: decode kernels for small batches, TwELL prefill kernels where
        this layer's measured sparsity makes them pay, else dense cuBLAS (:mod:`twell.inference.dispatch`;
        ``self.kernel_mode``). In training on CUDA, the path :mod:`twell.training.path` chooses (sparse
        kernels or twell's fused dense op); otherwise the dense PyTorch math, with the L1 term and
        statistics."""
        linear = self._modules
        w_down = _param(linear["down_proj"])
        self._check_input(x, w_down)
        if self._inference_ok(x, w_down):
            return self._infer(x, _param(linear["gate_proj"]), w_down, _param(linear["up_proj"]))
        choice = self._train_choice(x)
        if choice is not None and (choice[0] != "dense" or train_path.FUSED_DENSE):
            return self._train_kernels(x, *choice, (self.gate_proj.weight, self.up_proj.weight, w_down))
        shape = x.shape
        x2 = _token_rows(x)
        g = torch.relu(self.gate_proj(x2))
        h = g * self.up_proj(x2)
        y = self.down_proj(h)
        self._record(g, h)
        if choice is not None:
            self._train_dense_done(g)
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

    def _weights_require_grad(self) -> bool:
        return self.up_proj.weight.requires_grad or self.down_proj.weight.requires_grad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., d] -> [..., d]``; picks its path as :meth:`SparseGatedMLP.forward` does."""
        linear = self._modules
        w_down = _param(linear["down_proj"])
        self._check_input(x, w_down)
        if self._inference_ok(x, w_down):
            return self._infer(x, _param(linear["up_proj"]), w_down, None)
        choice = self._train_choice(x)
        if choice is not None and (choice[0] != "dense" or train_path.FUSED_DENSE):
            return self._train_kernels(x, *choice, (self.up_proj.weight, w_down))
        shape = x.shape
        x2 = _token_rows(x)
        h = torch.relu(self.up_proj(x2))
        y = self.down_proj(h)
        self._record(h, h)
        if choice is not None:
            self._train_dense_done(h)
        return y.reshape(shape)

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, act=relu"


def use_kernel_layout(model: nn.Module) -> int:
    """Lay out every twell FFN of ``model`` for the inference kernels now (``down_proj.weight``
    as the transpose of a contiguous ``[f, d]`` tensor; same values, one copy), and return how
    many were laid out anew.

    ``eval()`` does this by itself, except where a ``torch.distributed`` process group is up:
    there it leaves the layout alone, so that FSDP2's ``fully_shard`` (which refuses
    non-contiguous parameters) can still wrap a model loaded in eval mode, and inference runs
    dense. Call this for per-rank inference under a process group (each rank with its whole
    model, no FSDP or DDP wrapper), after ``eval()``. Not for models that FSDP or DDP wrap or
    will wrap. Weights that are not plain local tensors (FSDP's DTensors, views into a larger
    buffer, parametrized weights) are left as they are."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    return sum(m._set_kernel_layout(True) for m in sparse_modules(model))


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

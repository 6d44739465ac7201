"""Public functional ops on the Triton kernels (inference only: they carry no gradient).

Data flow of one gated FFN::

    x [M, d] --gate_to_twell--> TwELL g [M, f] (+ dense pre-activation, cuBLAS method)
             --ffn_from_twell-> y [M, d]

:func:`twell_gated_mlp` and :func:`twell_mlp` do the whole FFN; they return what
:func:`twell.reference.gated_mlp` / :func:`twell.reference.mlp` return, up to rounding, for every
input: tiles with more active units than TwELL slots go through an exact path whose use is
counted in an :class:`OverflowCounters` you may pass.

Example (on a CUDA machine)::

    y = twell_gated_mlp(x, w_gate, w_up, w_down)              # x [M, d] bf16 -> y [M, d]
    w = prepare_gated_weights(w_up, w_down)                    # once per layer
    y = twell_gated_mlp(x, w_gate, w_up, w_down, weights=w)   # no per-call weight copy
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from ..checks import KERNEL_DTYPES, check_mlp_args, check_tensor
from ..format import TwELL
from ..kernels import OverflowCounters, ffn_from_twell, gate_pack_fused, gate_pack_persistent, pack_relu

__all__ = [
    "GatedWeights",
    "prepare_gated_weights",
    "gate_to_twell",
    "twell_gated_mlp",
    "twell_mlp",
    "OverflowCounters",
    "default_tile",
    "DEFAULT_COMPRESSION",
]

# TwELL geometry of the cuBLAS + pack path: one tile per row (tile = next power of two >= f,
# up to 32768) with tile / 8 - 1 slots, so a row overflows only past about 1/8 of its units.
# One tile lets the up/down kernel take each row's entries as one contiguous list and work on
# token blocks with tensor cores; 256-column tiles cost 35% more in the up/down step on the
# H200.
DEFAULT_COMPRESSION = 8


def default_tile(f: int) -> int:
    """TwELL tile width used by the ops and modules: one tile per row where possible."""
    t = 16
    while t < f and t < 32768:
        t *= 2
    return t


@dataclass
class GatedWeights:
    """Up and down weights laid out for the TwELL kernels, built once per layer.

    ``fused [f, 2d]``: row ``j`` holds ``w_up[j]`` then ``w_down[:, j]``, so one active unit's
    up row and down column are one contiguous ``4 d``-byte span (bf16). ``up`` and ``down_t``
    are its two ``[f, d]`` halves (views).
    """

    fused: torch.Tensor

    @property
    def d(self) -> int:
        return self.fused.shape[1] // 2

    @property
    def up(self) -> torch.Tensor:
        return self.fused[:, : self.d]

    @property
    def down_t(self) -> torch.Tensor:
        return self.fused[:, self.d :]


def prepare_gated_weights(w_up: torch.Tensor, w_down: torch.Tensor) -> GatedWeights:
    """Lay out ``w_up [f, d]`` and ``w_down [d, f]`` as one ``[f, 2d]`` matrix (a copy).

    Both of one kernel dtype (fp16, bf16 or fp32) and one device: a copy never casts one of them
    silently."""
    check_tensor(w_up, "w_up", dim=2, dtypes=KERNEL_DTYPES)
    check_tensor(w_down, "w_down", dim=2, dtypes=KERNEL_DTYPES)
    f, d = w_up.shape
    if tuple(w_down.shape) != (d, f):
        raise ValueError(f"w_down must be [d, f] = [{d}, {f}] for w_up [{f}, {d}], got {list(w_down.shape)}")
    if w_down.dtype != w_up.dtype or w_down.device != w_up.device:
        raise TypeError(f"w_down ({w_down.dtype}, {w_down.device}) must match w_up ({w_up.dtype}, {w_up.device})")
    fused = torch.empty(f, 2 * d, dtype=w_up.dtype, device=w_up.device)
    fused[:, :d].copy_(w_up)
    fused[:, d:].copy_(w_down.T)
    return GatedWeights(fused)


def _inference_only(*tensors) -> None:
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        raise RuntimeError(
            "twell.inference.ops are inference only (no gradient); call them under torch.no_grad() / "
            "torch.inference_mode(), or use twell.SparseGatedMLP / SparseMLP for training"
        )


def gate_to_twell(
    x: torch.Tensor,
    w: torch.Tensor,
    tile: Optional[int] = None,
    compression: int = DEFAULT_COMPRESSION,
    method: str = "cublas",
) -> tuple[TwELL, Optional[torch.Tensor]]:
    """``relu(x w^T)`` in TwELL form.

    Args:
        x: ``[M, d]``; w: ``[f, d]``; fp16, bf16 (or fp32).
        method: ``"cublas"``: ``torch.mm`` then one light Triton pack pass; the dense
            pre-activation ``[M, f]`` is returned too, for the exact path. ``"fused"``: a Triton
            matmul that packs in its epilogue (tile <= 256); returns ``(twell, None)``.
            ``"persistent"``: the same epilogue on a persistent matmul with tensor-descriptor
            (TMA) loads (:func:`twell.kernels.gate_pack_persistent`); ``(twell, None)``.

        tile: TwELL tile width (default :func:`default_tile`, or 128 for ``"fused"``).

    Returns:
        ``(g, pre)``: g a kernel-written TwELL ``[M, f]``; pre ``[M, f]`` or None.
    """
    check_tensor(x, "x", dim=2, dtypes=(torch.float16, torch.bfloat16, torch.float32))
    check_tensor(w, "w", dim=2, dtypes=(torch.float16, torch.bfloat16, torch.float32))
    if w.shape[1] != x.shape[1] or w.dtype != x.dtype or w.device != x.device:
        raise ValueError(
            f"w must be [f, {x.shape[1]}] {x.dtype} on {x.device} for x {list(x.shape)}, "
            f"got {list(w.shape)} {w.dtype} on {w.device}"
        )
    if tile is None:
        tile = 128 if method in ("fused", "persistent") else default_tile(w.shape[0])
    if method == "cublas":
        pre = torch.mm(x, w.T)
        return pack_relu(pre, tile, compression), pre
    if method == "fused":
        return gate_pack_fused(x, w, tile=tile, compression=compression), None
    if method == "persistent":
        return gate_pack_persistent(x, w, tile=tile, compression=compression), None
    raise ValueError(f"method must be 'cublas', 'fused' or 'persistent', got {method!r}")


def twell_gated_mlp(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    *,
    weights: Optional[GatedWeights] = None,
    tile: Optional[int] = None,
    compression: int = DEFAULT_COMPRESSION,
    method: str = "cublas",
    counters: Optional[OverflowCounters] = None,
) -> torch.Tensor:
    """ReLU-gated MLP through TwELL: ``y = (relu(x w_gate^T) * (x w_up^T)) w_down^T``.

    Args:
        x: ``[..., d]``; w_gate, w_up: ``[f, d]``; w_down: ``[d, f]`` (nn.Linear layouts), one
            dtype (bf16 or fp16 on a GPU) and one device.
        weights: :func:`prepare_gated_weights` of ``(w_up, w_down)``, to skip the per-call copy.
        tile, compression: TwELL geometry (default: one tile per row, see :func:`default_tile`);
            method: gate kernel (see :func:`gate_to_twell`).
        counters: optional :class:`OverflowCounters`, incremented by the exact path.

    Returns:
        ``y [..., d]``, x's dtype.
    """
    shape = x.shape
    x2 = x.reshape(math.prod(shape[:-1]), shape[-1]) if x.dim() != 2 else x
    check_mlp_args(x2, w_up, w_down, w_gate)
    _inference_only(x, w_gate, w_up, w_down)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    w_gate = w_gate if w_gate.stride(-1) == 1 else w_gate.contiguous()
    if weights is None:
        weights = prepare_gated_weights(w_up, w_down)
    elif not isinstance(weights, GatedWeights):
        raise TypeError(f"weights must be a GatedWeights from prepare_gated_weights(w_up, w_down), got {type(weights).__name__}")
    g, pre = gate_to_twell(x2, w_gate, tile, compression, method)
    y = ffn_from_twell(
        x2, g, weights.down_t, w_up=weights.up, pre=pre, w_first=None if pre is not None else w_gate, counters=counters,
        pre_writable=True,  # our own pre-activation: overflowed rows may go dense over it
    )
    return y.reshape(shape)


def twell_mlp(
    x: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    *,
    w_down_t: Optional[torch.Tensor] = None,
    tile: Optional[int] = None,
    compression: int = DEFAULT_COMPRESSION,
    method: str = "cublas",
    counters: Optional[OverflowCounters] = None,
) -> torch.Tensor:
    """Non-gated ReLU MLP through TwELL: ``h = relu(x w_up^T)`` packed, then ``y = h w_down^T``.

    Args:
        x: ``[..., d]``; w_up: ``[f, d]``; w_down: ``[d, f]``.
        w_down_t: ``w_down.T.contiguous()`` prepared once, to skip the per-call copy.
        tile, compression, method, counters: as :func:`twell_gated_mlp`.

    Returns:
        ``y [..., d]``.
    """
    shape = x.shape
    x2 = x.reshape(math.prod(shape[:-1]), shape[-1]) if x.dim() != 2 else x
    check_mlp_args(x2, w_up, w_down)
    _inference_only(x, w_up, w_down)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    w_up = w_up if w_up.stride(-1) == 1 else w_up.contiguous()
    if w_down_t is None:
        w_down_t = w_down.T.contiguous()
    h, pre = gate_to_twell(x2, w_up, tile, compression, method)
    y = ffn_from_twell(x2, h, w_down_t, pre=pre, w_first=None if pre is not None else w_up, counters=counters,
                       pre_writable=True)
    return y.reshape(shape)

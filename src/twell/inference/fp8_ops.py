"""The gated FFN on FP8 weights (:mod:`twell.fp8`): twell's sparse path and the dense FP8 one.

:func:`twell_gated_mlp_fp8` is twell's prefill path with e4m3 weights: x quantised per token
(:func:`twell.kernels.quantize.quantize_rows_fp8`), the gate as one rowwise-scaled FP8 product
(``torch._scaled_mm``, the dense FP8 computation of the gate itself, so the active set is dense
FP8's), packed into TwELL by the same pass as in bf16, then the up and down rows of each token's
active units gathered from FP8 with their per-unit scales (:func:`twell.kernels.ffn_from_twell`
with ``w_scales``), products and sums in fp32, x unquantised for the up product and h never
quantised. Rows with an overflowed tile are recomputed exactly from the gate's output.

:func:`dense_fp8_ffn` is the dense FP8 baseline as FP8 serving runs it (torchao's rowwise
float8 inference, vLLM's FP8 Llama): gate and up as rowwise-scaled FP8 products, ``relu(g) * u``
in one pass, h quantised per token, and the down product rowwise-scaled; the activation casts
take the same one-pass kernel as twell's.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional

import torch

from ..checks import check_tensor
from ..fp8 import Fp8GatedWeights, Fp8Rows, quantize_rows, quantize_tokens
from ..format import TwELL
from ..kernels import OverflowCounters, ffn_from_twell, pack_relu
from ..kernels.updown import default_config, splits
from .fp8_owners import module_of_gate
from .op_library import inference_op, off_default_stream
from .ops import DEFAULT_COMPRESSION, default_tile

__all__ = ["twell_fp8_ffn", "twell_gated_mlp_fp8", "DenseFp8Weights", "dense_fp8_weights", "dense_fp8_ffn", "quantize_activations"]


def quantize_activations(x: torch.Tensor) -> Fp8Rows:
    """Per-token e4m3 of ``x [M, d]``: the one-pass Triton kernel on CUDA (bit for bit
    :func:`twell.fp8.quantize_tokens`, which the CPU uses)."""
    if x.is_cuda:
        from ..kernels.quantize import quantize_rows_fp8

        return Fp8Rows(*quantize_rows_fp8(x))
    return quantize_tokens(x)


def _scaled_mm(a: Fp8Rows, b: Fp8Rows, out_dtype: torch.dtype) -> torch.Tensor:
    return torch._scaled_mm(a.q, b.q.t(), scale_a=a.scale[:, None], scale_b=b.scale[None, :], out_dtype=out_dtype)


def _check(x: torch.Tensor, d: int) -> torch.Tensor:
    check_tensor(x, "x", dim=2, dtypes=(torch.float16, torch.bfloat16, torch.float32))
    if x.shape[1] != d:
        raise ValueError(f"x must be [M, {d}], got {list(x.shape)}")
    if torch.is_grad_enabled() and x.requires_grad:
        raise RuntimeError("the FP8 FFN is inference only: call it under torch.no_grad() / torch.inference_mode()")
    return x if x.stride(1) == 1 else x.contiguous()


def twell_gated_mlp_fp8(x: torch.Tensor, w: Fp8GatedWeights, *, tile: Optional[int] = None,
                        counters: Optional[OverflowCounters] = None, k_est: Optional[float] = None,
                        kernel: str = "auto") -> torch.Tensor:
    """``y [M, d]`` (x's dtype) of twell's FP8 FFN (see the module's text) for ``x [M, d]``
    (bf16 on a GPU) and ``w`` from :func:`twell.fp8.fp8_gated_weights`. ``counters``: the exact
    path's counts, as for bf16; ``k_est``: the expected active units per token (picks the
    up/down kernels' shape); ``kernel``: as :func:`twell.kernels.ffn_from_twell`."""
    if not isinstance(w, Fp8GatedWeights):
        raise TypeError(f"w must be twell.fp8.Fp8GatedWeights (fp8_gated_weights), got {type(w).__name__}")
    return prefill_fp8(_check(x, w.gate.shape[1]), w, tile=tile, counters=counters, k_est=k_est, kernel=kernel)[0]


def prefill_fp8(x: torch.Tensor, w: Fp8GatedWeights, tile: Optional[int] = None, counters: Optional[OverflowCounters] = None,
                k_est: Optional[float] = None, kernel: str = "auto") -> tuple[torch.Tensor, TwELL]:
    """:func:`twell_gated_mlp_fp8` without its checks, for callers that made them: ``(y, g)``,
    ``g`` the call's TwELL (its counts are the active units per token and tile)."""
    f, d = w.gate.shape
    pre = _scaled_mm(quantize_activations(x), w.gate, x.dtype)
    g = pack_relu(pre, tile or default_tile(f), DEFAULT_COMPRESSION)
    be, nw = default_config(d, k_est, split=splits(x.shape[0], True, kernel, d))
    y = ffn_from_twell(x, g, w.down_t.q, w_up=w.up.q, pre=pre, counters=counters, kernel=kernel,
                       block_e=be, num_warps=nw, w_scales=(w.up.scale, w.down_t.scale),
                       pre_writable=True)  # our own gate output: heavy and overflowed rows whole, on tensor cores
    return y, g


def dense_fp8_down_per_unit(x: torch.Tensor, w: Fp8GatedWeights, down_cm: Optional[torch.Tensor] = None,
                            up_down_scale: Optional[torch.Tensor] = None,
                            ones: Optional[torch.Tensor] = None, return_gate: bool = False):
    """The dense FP8 computation of twell's FP8 weights (down scaled per unit): gate and up
    rowwise-scaled FP8 products, ``relu(g) * u`` with each unit's down scale folded in, quantised
    per token, and the down product against the e4m3 down rows (unit scale 1 per output). What
    an FP8 layer too dense for the sparse path computes. ``x [M, d]`` -> ``y [M, d]``.

    The down scale is folded into the up product's per-unit scale (``_scaled_mm`` applies it in
    its epilogue), so that the element-wise work is the dense FP8 layer's: one ``relu(g) * u``
    pass in x's dtype and one quantisation. ``down_cm``: the down rows as ``torch._scaled_mm``
    reads its second operand, ``w.down_t.q.t().contiguous().t()``; ``up_down_scale``: ``[f]``
    fp32, ``w.up.scale * w.down_t.scale``; ``ones``: ``[1, d]`` fp32 ones, the down product's
    output scales (a caller's kept copies; else made per call: one more launch).
    ``return_gate``: return ``(y, gate)``, ``gate [M, f]`` the gate product (x's dtype), for a
    caller that measures the layer's sparsity on it."""
    from ..kernels.elementwise import relu_mul_

    xq = quantize_activations(x)
    if up_down_scale is None:
        up_down_scale = w.up.scale * w.down_t.scale
    u = _scaled_mm(xq, Fp8Rows(w.up.q, up_down_scale), x.dtype)
    g = _scaled_mm(xq, w.gate, x.dtype)
    h = relu_mul_(u, g) if x.is_cuda else torch.relu(g.float()).mul_(u.float()).to(x.dtype)
    hq = quantize_activations(h)
    if down_cm is None:  # the down rows as a [f, d] column-major operand
        down_cm = w.down_t.q.t().contiguous().t()
    if ones is None:  # (the down rows' scales are folded in above)
        ones = hq.scale.new_ones(1, down_cm.shape[1])
    y = torch._scaled_mm(hq.q, down_cm, scale_a=hq.scale[:, None], scale_b=ones, out_dtype=x.dtype)
    return (y, g) if return_gate else y


_SCRATCH: dict = {}  # (device, d) -> DecodeScratch for the custom op's decode calls


def _ffn_fp8_fake(x, gate_q, gate_scale, up_q, up_scale, down_t_q, down_scale):
    return x.new_empty(x.shape[0], x.shape[1])


@inference_op("ffn_fp8", "(Tensor x, Tensor gate_q, Tensor gate_scale, Tensor up_q, Tensor up_scale, "
                         "Tensor down_t_q, Tensor down_scale) -> Tensor", _ffn_fp8_fake)
def ffn_fp8(x: torch.Tensor, gate_q: torch.Tensor, gate_scale: torch.Tensor, up_q: torch.Tensor, up_scale: torch.Tensor,
            down_t_q: torch.Tensor, down_scale: torch.Tensor) -> torch.Tensor:
    """twell's FP8 FFN as a custom op, for :class:`twell.fp8_nn.Fp8SparseGatedMLP` under
    ``torch.compile``: the call of the module that owns ``gate_q``
    (:func:`twell.inference.fp8_owners.module_of_gate`), the same per-call choice as in eager mode. Off the
    device's default stream (the warm-up of inductor's CUDA graphs, and their captures) the call
    keeps no buffer: there allocations come from the graphs' memory pool. Rows no live module
    owns (a compiler that copied them) take :func:`twell_fp8_ffn`, by the call's size alone."""
    off_default = x.is_cuda and off_default_stream(x.get_device())  # (a capture is never on the default stream)
    m = module_of_gate(gate_q)
    if m is not None:
        return m.call(x if x.stride(1) == 1 else x.contiguous(), keep=not off_default)
    warnings.warn("twell::ffn_fp8: no twell module owns these gate rows (copied by a compiler?); choosing the "
                  "path by the call's size alone", RuntimeWarning, stacklevel=2)
    from ..kernels.decode_fused import DecodeScratch

    w = Fp8GatedWeights(Fp8Rows(gate_q, gate_scale), Fp8Rows(up_q, up_scale), Fp8Rows(down_t_q, down_scale))
    scratch = None
    if x.is_cuda and not off_default:
        key = (x.device, x.shape[1])
        scratch = _SCRATCH.get(key)
        if scratch is None:
            scratch = _SCRATCH[key] = DecodeScratch(x.shape[1], x.device)
    return twell_fp8_ffn(x, w, scratch)


def twell_fp8_ffn(x: torch.Tensor, w: Fp8GatedWeights, scratch=None, counters: Optional[OverflowCounters] = None,
                  k_est: Optional[float] = None) -> torch.Tensor:
    """twell's FP8 FFN at any batch: up to :data:`twell.kernels.decode_fp8.FP8_DECODE_MAX_M`
    tokens the fused decode kernel (:func:`twell.kernels.decode_fp8.ffn_decode_fp8`, ``scratch``
    a kept :class:`twell.kernels.decode_fused.DecodeScratch`), else :func:`twell_gated_mlp_fp8`.
    ``x [M, d]`` -> ``y [M, d]``."""
    from ..kernels.decode_fp8 import FP8_DECODE_MAX_M, ffn_decode_fp8

    if not isinstance(w, Fp8GatedWeights):
        raise TypeError(f"w must be twell.fp8.Fp8GatedWeights (fp8_gated_weights), got {type(w).__name__}")
    x = _check(x, w.gate.shape[1])
    if x.shape[0] <= FP8_DECODE_MAX_M:
        return ffn_decode_fp8(x, w, scratch)[0]
    return twell_gated_mlp_fp8(x, w, counters=counters, k_est=k_est)


@dataclass
class DenseFp8Weights:
    """The dense FP8 baseline's weights: ``gate`` and ``up`` ``[f, d]`` and ``down [d, f]``,
    each e4m3 with one scale per output row."""

    gate: Fp8Rows
    up: Fp8Rows
    down: Fp8Rows


def dense_fp8_weights(w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> DenseFp8Weights:
    """:class:`DenseFp8Weights` from ``w_gate, w_up [f, d]`` and ``w_down [d, f]``."""
    return DenseFp8Weights(quantize_rows(w_gate), quantize_rows(w_up), quantize_rows(w_down))


def dense_fp8_ffn(x: torch.Tensor, w: DenseFp8Weights) -> torch.Tensor:
    """The dense FP8 FFN (see the module's text): ``x [M, d]`` -> ``y [M, d]`` in x's dtype.
    The same math as :func:`twell.fp8.dense_fp8_gated_mlp`."""
    from ..kernels.elementwise import relu_mul_

    x = _check(x, w.down.shape[0])
    xq = quantize_activations(x)
    h = relu_mul_(_scaled_mm(xq, w.up, x.dtype), _scaled_mm(xq, w.gate, x.dtype))
    return _scaled_mm(quantize_activations(h), w.down, x.dtype)

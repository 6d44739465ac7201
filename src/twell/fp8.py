"""FP8 weights for inference: e4m3 values with one float32 scale per row, and the math on them.

A matrix ``W`` is stored as ``q = round_e4m3(W / s)`` with one scale per row,
``s[r] = max_c |W[r, c]| / 448`` (448 is e4m3's largest finite value), so that every row uses
the format's whole range; ``W ~ s[:, None] * q``. Activations (the tokens ``x`` and, in the
dense FP8 baseline, the hidden ``h``) are quantised the same way per token, at run time. This is
the per-row ("rowwise") recipe of torchao's float8 inference (dynamic activations, per-row
weights) and of vLLM's FP8 serving; its products run on FP8 tensor cores through
``torch._scaled_mm`` with the two scale vectors.

Which rows each of the FFN's matrices is scaled by (``[f, d]`` unless said; ``j`` a unit):

- ``w_gate [f, d]`` and ``w_up [f, d]``: per unit (their output rows), as ``torch._scaled_mm``
  wants them for ``x w^T``;
- the down projection: in the dense FP8 baseline per output row of ``w_down [d, f]`` (the
  ``_scaled_mm`` layout); in twell's kernels per unit, i.e. per row of ``w_down^T [f, d]``, the
  rows the kernels gather, so that a unit's scale folds into its hidden value ``h_j``.

twell's FP8 FFN (:func:`twell_fp8_reference` is its math) computes

    xq, sx = quantise(x) per token
    a = (xq wq_gate^T) * sx s_gate          the dense FP8 gate product, as dense FP8 computes it
    g = relu(a)                              its active set is dense FP8's
    u_j = s_up[j] (x . wq_up[j])             x itself, not xq: the gathered rows meet bf16 x
    y = sum_j (g_j u_j s_down[j]) wq_down[j] h in fp32, never quantised

so its error against an fp32 computation with the dequantised weights is at most dense FP8's,
which also rounds x for the up product and h for the down product (:func:`dense_fp8_gated_mlp`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["E4M3", "E4M3_MAX", "Fp8Rows", "quantize_rows", "dense_fp8_gated_mlp", "twell_fp8_reference",
           "Fp8GatedWeights", "fp8_gated_weights", "scaled_mm_rows"]

E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)  # 448
# smallest amax a row is scaled by: an all-zero row gets scale EPS / 448 and stays zero
EPS = 1e-12


@dataclass
class Fp8Rows:
    """A matrix ``[R, C]`` as e4m3 values ``q`` and one float32 scale per row ``scale [R]``:
    ``W ~ scale[:, None] * q.float()``."""

    q: torch.Tensor
    scale: torch.Tensor

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``[R, C]`` in ``dtype``: ``scale[:, None] * q``."""
        return (self.q.float() * self.scale[:, None]).to(dtype)

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def to(self, device) -> "Fp8Rows":
        return Fp8Rows(self.q.to(device), self.scale.to(device))


def quantize_rows(w: torch.Tensor) -> Fp8Rows:
    """``w [R, C]`` (any float dtype) -> :class:`Fp8Rows`, one scale per row (see the module's
    text). Computed in float32; values are rounded to nearest e4m3 and saturate at +-448 (only
    rounding can reach it: the row's largest magnitude maps to 448 exactly). NaN or inf in ``w``
    raise: no scale represents them."""
    if w.dim() != 2:
        raise ValueError(f"quantize_rows takes a 2-D tensor, got shape {list(w.shape)}")
    if not w.is_floating_point():
        raise TypeError(f"quantize_rows takes a floating tensor, got {w.dtype}")
    w32 = w.float().contiguous()  # (q comes out row-major whatever w's strides: the kernels read its rows)
    if w.numel() and not bool(torch.isfinite(w32).all()):
        raise ValueError("quantize_rows: the tensor holds NaN or inf, which no FP8 scale represents")
    amax = w32.abs().amax(dim=1) if w.shape[1] else w32.new_zeros(w.shape[0])
    scale = amax.clamp(min=EPS) / E4M3_MAX
    q = (w32 / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return Fp8Rows(q, scale)


def quantize_tokens(x: torch.Tensor) -> Fp8Rows:
    """Run-time per-token quantisation of activations ``x [M, d]``, as :func:`quantize_rows`
    without the finiteness check (a NaN token stays NaN in its row, as in bf16)."""
    x32 = x.float()
    amax = x32.abs().amax(dim=1) if x.shape[1] else x32.new_zeros(x.shape[0])
    scale = amax.clamp(min=EPS) / E4M3_MAX
    return Fp8Rows((x32 / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale)


def scaled_mm_rows(a: Fp8Rows, b: Fp8Rows, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``a [M, K] b [N, K]^T`` with per-row scales on both sides, ``[M, N]`` in ``out_dtype``:
    one ``torch._scaled_mm`` (FP8 tensor cores on CUDA), products and sums in fp32."""
    return torch._scaled_mm(a.q, b.q.t(), scale_a=a.scale[:, None].contiguous(), scale_b=b.scale[None, :].contiguous(),
                            out_dtype=out_dtype)


def dense_fp8_gated_mlp(x: torch.Tensor, w_gate: Fp8Rows, w_up: Fp8Rows, w_down: Fp8Rows) -> torch.Tensor:
    """The dense FP8 baseline: all three products rowwise-scaled FP8 (``torch._scaled_mm``), x
    quantised per token for gate and up, h per token for down. ``x [M, d]`` (bf16), ``w_gate``
    and ``w_up`` ``[f, d]``, ``w_down [d, f]`` (per output row) -> ``y [M, d]`` in x's dtype."""
    xq = quantize_tokens(x)
    h = torch.relu(scaled_mm_rows(xq, w_gate, x.dtype)) * scaled_mm_rows(xq, w_up, x.dtype)
    return scaled_mm_rows(quantize_tokens(h), w_down, x.dtype)


@dataclass
class Fp8GatedWeights:
    """A gated FFN's weights as twell's FP8 kernels read them: ``gate`` and ``up`` ``[f, d]``
    per unit, ``down_t [f, d]`` (row j = the down matrix's column j) per unit."""

    gate: Fp8Rows
    up: Fp8Rows
    down_t: Fp8Rows


def fp8_gated_weights(w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> Fp8GatedWeights:
    """:class:`Fp8GatedWeights` from bf16 (or any float) ``w_gate [f, d]``, ``w_up [f, d]``,
    ``w_down [d, f]`` (``nn.Linear`` layouts)."""
    if w_gate.shape != w_up.shape or w_down.shape != w_up.shape[::-1]:
        raise ValueError(f"expected w_gate and w_up [f, d] and w_down [d, f], got {list(w_gate.shape)}, "
                         f"{list(w_up.shape)}, {list(w_down.shape)}")
    return Fp8GatedWeights(quantize_rows(w_gate), quantize_rows(w_up), quantize_rows(w_down.t()))


def twell_fp8_reference(x: torch.Tensor, w: Fp8GatedWeights) -> torch.Tensor:
    """twell's FP8 FFN in plain PyTorch (fp32), the math its kernels must reproduce (see the
    module's text): ``x [M, d]`` -> ``y [M, d]`` float32. The gate is :func:`scaled_mm_rows`
    itself (the active set is dense FP8's by construction), rounded to x's dtype as the kernels
    store it."""
    a = scaled_mm_rows(quantize_tokens(x), w.gate, x.dtype).float()
    u = x.float() @ w.up.dequantize().t()
    h = torch.relu(a) * u
    return h @ w.down_t.dequantize()

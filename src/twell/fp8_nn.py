"""An inference module of twell's gated FFN on FP8 weights: :class:`Fp8SparseGatedMLP`.

Made from a ReLU-gated MLP (``twell.sparsify(model, fp8=True)``, or
:meth:`Fp8SparseGatedMLP.from_mlp`), it holds the three matrices as e4m3 rows with one float32
scale per row (:mod:`twell.fp8`; gate and up per unit, the down matrix per unit as the kernels
gather it) and no bf16 copy: a third of the bf16 module's weight bytes plus the scales.

Per call of ``M`` tokens:

- ``M <= FP8_DECODE_MAX_M`` (8): the fused FP8 decode kernel
  (:func:`twell.kernels.decode_fp8.ffn_decode_fp8`), which reads the gate whole and the up and
  down rows of the batch's active units only; never more weight bytes than dense FP8.
- larger calls: twell's FP8 prefill path (:func:`twell.inference.fp8_ops.twell_gated_mlp_fp8`)
  while the layer's measured active units per token are at most ``MAX_DENSITY`` of f, else the
  dense FP8 computation of the same weights (``torch._scaled_mm`` for the three products).

The measurement costs no synchronisation: every ``PROBE_EVERY`` calls of the prefill path the
mean active units per token of the call's TwELL are copied to pinned host memory, read at a
later call once their event completed; inside a CUDA graph capture nothing is measured. A layer
that goes dense stays dense (its dense calls measure nothing: a model's layers keep their
sparsity from one call to the next) and keeps a column-major copy of its down rows for
``torch._scaled_mm``. Under
``torch.compile`` the module calls the custom op ``twell::ffn_fp8`` (inference only,
:func:`twell.inference.fp8_ops.ffn_fp8`), whose fake implementation gives the output's shape: no
graph break; there the path follows the call's size alone.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .fp8 import Fp8GatedWeights, Fp8Rows, fp8_gated_weights

__all__ = ["Fp8SparseGatedMLP", "MAX_DENSITY", "PROBE_EVERY"]

# Largest mean share of active units per token for which calls above the decode kernel's take
# the FP8 prefill path; denser layers compute dense FP8. Measured (H100, d 2048, f 5632, evenly
# spread units): k 29 (0.5% of f) ran 1.20x dense FP8 at 4096 tokens and 1.47x at 131072 in CUDA
# graphs, k 280 0.27x and 0.33x; the break-even between them is not measured, and 0.6% of f (34
# units) is the bf16 training path's bar.
MAX_DENSITY = 0.006
PROBE_EVERY = 16

class Fp8SparseGatedMLP(nn.Module):
    """``y = (relu(x W_gate^T) * (x W_up^T)) W_down^T`` on FP8 weights, inference only (see the
    module's text). ``x [..., d]`` (bf16 or fp16 on a GPU) -> ``y [..., d]``.

    Buffers (saved in ``state_dict``): ``gate_q``, ``up_q``, ``down_t_q`` (``[f, d]``
    ``float8_e4m3fn``) and ``gate_scale``, ``up_scale``, ``down_scale`` (``[f]`` float32).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, device=None) -> None:
        super().__init__()
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        f, d = intermediate_size, hidden_size
        for name in ("gate", "up", "down_t"):
            self.register_buffer(f"{name}_q", torch.zeros(f, d, dtype=torch.float8_e4m3fn, device=device))
        for name in ("gate", "up", "down"):
            self.register_buffer(f"{name}_scale", torch.ones(f, dtype=torch.float32, device=device))
        self.k_est: Optional[float] = None  # measured mean active units per token (None before)
        self.last_path: Optional[str] = None
        self._calls = 0
        self._host: Optional[torch.Tensor] = None
        self._event = None
        self._scratch = None
        self._down_cm: Optional[torch.Tensor] = None
        self._up_down_scale: Optional[torch.Tensor] = None

    @classmethod
    def from_weights(cls, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> "Fp8SparseGatedMLP":
        """From ``w_gate, w_up [f, d]`` and ``w_down [d, f]`` (``nn.Linear`` layouts)."""
        f, d = w_gate.shape
        m = cls(d, f, device=w_gate.device)
        w = fp8_gated_weights(w_gate.detach(), w_up.detach(), w_down.detach())
        with torch.no_grad():
            for name, rows in (("gate", w.gate), ("up", w.up), ("down_t", w.down_t)):
                getattr(m, f"{name}_q").copy_(rows.q)
                getattr(m, f"{'down' if name == 'down_t' else name}_scale").copy_(rows.scale)
        return m

    @classmethod
    def from_mlp(cls, mlp: nn.Module) -> "Fp8SparseGatedMLP":
        """From a gated MLP with ``gate_proj``, ``up_proj``, ``down_proj`` Linears without bias
        (a :class:`twell.SparseGatedMLP`, or a Hugging Face MLP run with ReLU)."""
        lins = [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        if not all(isinstance(lin, nn.Linear) for lin in lins) or any(lin.bias is not None for lin in lins):
            raise ValueError(f"from_mlp needs gate_proj, up_proj and down_proj nn.Linear without bias, got {type(mlp).__name__}")
        return cls.from_weights(*(lin.weight for lin in lins))

    def weights(self) -> Fp8GatedWeights:
        return Fp8GatedWeights(Fp8Rows(self.gate_q, self.gate_scale), Fp8Rows(self.up_q, self.up_scale),
                               Fp8Rows(self.down_t_q, self.down_scale))

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        # the dense path's kept copies were made from the old weights
        self._down_cm = self._up_down_scale = None

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, weights=float8_e4m3fn per-row"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"x must be [..., {self.hidden_size}], got {list(x.shape)}")
        if torch.is_grad_enabled() and x.requires_grad:
            raise RuntimeError("Fp8SparseGatedMLP is inference only: call it under torch.no_grad() / torch.inference_mode()")
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        if torch.compiler.is_compiling():
            from .inference import fp8_ops  # noqa: F401  (registers torch.ops.twell.ffn_fp8)

            y = torch.ops.twell.ffn_fp8(x2, self.gate_q, self.gate_scale, self.up_q, self.up_scale, self.down_t_q,
                                        self.down_scale)
        else:
            y = self.call(x2)
        return y.reshape(shape)

    def call(self, x: torch.Tensor) -> torch.Tensor:
        """One eager call on ``x [M, d]`` (the path of the module's text)."""
        from .inference.fp8_ops import dense_fp8_down_per_unit, prefill_fp8
        from .kernels.decode_fp8 import FP8_DECODE_MAX_M, ffn_decode_fp8
        from .kernels.decode_fused import DecodeScratch

        M = x.shape[0]
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        w = self.weights()
        if M <= FP8_DECODE_MAX_M:
            if self._scratch is None and x.is_cuda and not capturing:
                self._scratch = DecodeScratch(self.hidden_size, x.device)
            self.last_path = "decode"
            return ffn_decode_fp8(x, w, self._scratch)[0]
        if not capturing:
            self._calls += 1
            if self._event is not None and self._event.query():
                self.k_est, self._event = float(self._host[0]), None
        if self.k_est is not None and self.k_est > MAX_DENSITY * self.intermediate_size:
            self.last_path = "dense"
            if (self._down_cm is None or self._down_cm.device != x.device) and not capturing:
                # the down rows as _scaled_mm's column-major operand, kept: a dense layer's extra
                # third; and the up rows' scales times the down rows' (f floats)
                self._down_cm = self.down_t_q.t().contiguous().t()
                self._up_down_scale = self.up_scale * self.down_scale
            kept = self._down_cm is not None and self._down_cm.device == x.device
            return dense_fp8_down_per_unit(x, w, self._down_cm if kept else None, self._up_down_scale if kept else None)
        self.last_path = "prefill"
        y, g = prefill_fp8(x, w, k_est=self.k_est)
        if x.is_cuda and not capturing and self._event is None and (self.k_est is None or self._calls % PROBE_EVERY == 1):
            with torch.no_grad():
                mean = g.counts.sum(dim=1, dtype=torch.float32).mean().reshape(1)
                if self._host is None:
                    self._host = torch.empty(1, dtype=torch.float32, pin_memory=True)
                self._host.copy_(mean, non_blocking=True)
                self._event = torch.cuda.Event()
                self._event.record()
        return y

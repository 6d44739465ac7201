"""An inference module of twell's gated FFN on FP8 weights: :class:`Fp8SparseGatedMLP`.

Made from a ReLU-gated MLP (``twell.sparsify(model, fp8=True)``, or
:meth:`Fp8SparseGatedMLP.from_mlp`), it holds the three matrices as e4m3 rows with one float32
scale per row (:mod:`twell.fp8`; gate and up per unit, the down matrix per unit as the kernels
gather it) and no bf16 copy: a third of the bf16 module's weight bytes plus the scales.

Per call of ``M`` tokens:

- ``M <= FP8_DECODE_MAX_M`` (8): the fused FP8 decode kernel
  (:func:`twell.kernels.decode_fp8.ffn_decode_fp8`), which reads the gate whole and the up and
  down rows of the batch's active units only; never more weight bytes than dense FP8.
- ``M >= PREFILL_MIN_M`` (4096) inside a CUDA graph capture, ``M >= EAGER_PREFILL_MIN_M`` (8192)
  outside one, where the host must also issue the path's launches: twell's FP8 prefill path
  (:func:`twell.inference.fp8_ops.twell_gated_mlp_fp8`) while the layer's measured active units
  per token are at most ``MAX_DENSITY`` of f and, below ``HEAVY_PREFILL_MIN_M`` tokens, at most
  ``MAX_WHOLE_ROWS`` of its rows are computed whole (heavy or overflowed rows); else the dense
  FP8 computation of the same weights (``torch._scaled_mm`` for the three products).
- between the two: the dense FP8 computation, where the prefill path's fixed costs (the
  packing pass, three launches, the heavy rows' tensor-core pass) outweigh the rows it skips.

The measurement costs no synchronisation but the layer's first: every ``PROBE_EVERY`` calls of
the prefill path (and of dense calls of at least ``PREFILL_MIN_M`` tokens, on their gate product)
the mean active units per token and the share of rows computed whole are copied to pinned host
memory, read at a later call once their event completed; inside a CUDA graph capture nothing is
measured, and a capture of a layer never measured records the dense path. A layer on the dense
path keeps a column-major copy of its down rows for ``torch._scaled_mm``.

Under ``torch.compile`` the module calls the custom op ``twell::ffn_fp8`` (inference only,
:func:`twell.inference.fp8_ops.ffn_fp8`), whose fake implementation gives the output's shape: no
graph break. The op finds the module from its gate rows (:func:`module_of_gate`) and makes the
same per-call choice as an eager call. Off the device's default stream (inductor's CUDA graphs
warm up and capture there, allocating from their own memory pool) a call keeps nothing: a model
compiled with ``mode="reduce-overhead"`` before any eager call then captures, on its dense
path, the column-major copy of the down rows made per call, and on the decode path an
accumulator per graph. One eager call of each kind before compiling makes them once.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .fp8 import Fp8GatedWeights, Fp8Rows, fp8_gated_weights
from .inference.fp8_owners import module_of_gate, register

__all__ = ["Fp8SparseGatedMLP", "module_of_gate", "MAX_DENSITY", "MAX_WHOLE_ROWS", "PREFILL_MIN_M", "EAGER_PREFILL_MIN_M",
           "HEAVY_PREFILL_MIN_M", "PROBE_EVERY"]

# Largest mean share of active units per token for which calls above the decode kernel's take
# the FP8 prefill path; denser layers compute dense FP8. Measured (H100, d 2048, f 5632, evenly
# spread units): k 29 (0.5% of f) ran 1.20x dense FP8 at 4096 tokens and 1.47x at 131072 in CUDA
# graphs, k 280 0.27x and 0.33x; the break-even between them is not measured, and 0.6% of f (34
# units) is the bf16 training path's bar.
MAX_DENSITY = 0.006
# Smallest call that takes the FP8 prefill path. Measured (H100, k 29, CUDA graphs): at 16 and 256
# tokens the prefill path ran 0.62x and 0.69x dense FP8 with units spread evenly, 0.13x and 0.09x
# with heavy-tailed rows, where the dense computation of the same weights ran 0.97x to 1.01x; at
# 4096 tokens 1.23x (even).
PREFILL_MIN_M = 4096
# The same outside CUDA graphs: there the host issues the path's quantisation, cuBLAS product,
# packing pass and up/down launches on every call, and at 4096 tokens that took longer than the
# GPU's work on a busy host (H100 machine, k 29 even: 0.53 ms eager against 0.27 ms in a CUDA
# graph; dense FP8 0.33 ms), as for the bf16 modules (twell.inference.dispatch.EAGER_PREFILL_MIN_M).
EAGER_PREFILL_MIN_M = 8192
# Below HEAVY_PREFILL_MIN_M tokens, the largest share of a call's rows computed whole (more than
# twell.kernels.updown.DENSE_ROW_MIN active units, or an overflowed tile) for which the prefill
# path is taken. Measured (H100, k 29, heavy-tailed rows with 6.6% of rows over 128 units): 0.90x
# dense FP8 at 4096 tokens, 1.35x at 16384; with even rows (none whole) 1.23x at 4096. Between
# 0 and 6.6% the break-even is not measured.
MAX_WHOLE_ROWS = 0.02
HEAVY_PREFILL_MIN_M = 16384
PROBE_EVERY = 16

def _rows_of_gate(gate: torch.Tensor, dense_row_min: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(active units per row [M], rows the prefill path would compute whole [M] bool)`` of a
    dense call's gate product ``gate [M, f]``: rows of more than ``dense_row_min`` active units,
    or with a tile of TwELL's default tiling (``default_tile(f)``, ``DEFAULT_COMPRESSION``) over
    its slots, as :func:`twell.kernels.pack_relu` would pack them."""
    from .format import twell_slots
    from .inference.ops import DEFAULT_COMPRESSION, default_tile

    M, f = gate.shape
    active = gate > 0
    per_row = active.sum(dim=1)
    tile = default_tile(f)
    slots = twell_slots(tile, DEFAULT_COMPRESSION)
    full = f // tile * tile
    whole = per_row > dense_row_min
    if full:
        whole |= (active[:, :full].reshape(M, full // tile, tile).sum(dim=2) > slots).any(dim=1)
    if full < f:  # the last, partial tile
        whole |= active[:, full:].sum(dim=1) > slots
    return per_row, whole


_PATHS: tuple = ()  # what call() runs, imported at its first call (twell loads kernels on first use)


def _load_paths() -> tuple:
    global _PATHS
    from .inference.fp8_ops import dense_fp8_down_per_unit, prefill_fp8
    from .kernels.decode_fp8 import FP8_DECODE_MAX_M, ffn_decode_fp8
    from .kernels.decode_fused import DecodeScratch
    from .kernels.updown import DENSE_ROW_MIN

    _PATHS = (dense_fp8_down_per_unit, prefill_fp8, FP8_DECODE_MAX_M, ffn_decode_fp8, DecodeScratch, DENSE_ROW_MIN)
    return _PATHS


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
        self.whole_rows: Optional[float] = None  # measured share of rows computed whole
        self.last_path: Optional[str] = None
        self._calls = 0
        self._host: Optional[torch.Tensor] = None
        self._event = None
        self._scratch = None
        self._down_cm: Optional[torch.Tensor] = None
        self._up_down_scale: Optional[torch.Tensor] = None
        self._ones: Optional[torch.Tensor] = None
        self._weights: Optional[Fp8GatedWeights] = None
        self._register()

    def _register(self) -> None:
        register(self)

    # what a call keeps between calls, made again from the buffers: the weights' view, the dense
    # path's copies, the decode kernel's accumulator; and the measurement in flight
    _KEPT = ("_weights", "_down_cm", "_up_down_scale", "_ones", "_scratch", "_event")

    def _drop_kept(self) -> None:
        for name in self._KEPT:
            self.__dict__[name] = None

    def __getstate__(self):  # (copy.deepcopy, pickling: no CUDA event, no copies of the buffers)
        state = dict(super().__getstate__())
        state.update(dict.fromkeys(self._KEPT), _host=None)
        return state

    def __setstate__(self, state):  # (copy.deepcopy, unpickling: new storage, as _apply)
        super().__setstate__(state)
        for name, value in (("whole_rows", None), ("_host", None), *((n, None) for n in self._KEPT)):
            self.__dict__.setdefault(name, value)  # (a module pickled by an older version)
        self._register()

    def _apply(self, fn, recurse=True):
        # .to() / .cuda() give the buffers new storage: the op finds the module by the new one,
        # and what was kept from the old buffers (on their device) goes
        out = super()._apply(fn, recurse)
        self._drop_kept()
        self._register()
        return out

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
        """The module's buffers as :class:`twell.fp8.Fp8GatedWeights` (kept while the buffers are
        the same tensors: an eager call of a few tokens is bound by the host's time)."""
        b, w = self._buffers, self.__dict__.get("_weights")
        if w is None or w.gate.q is not b["gate_q"] or w.gate.scale is not b["gate_scale"] or w.up.q is not b["up_q"] \
                or w.up.scale is not b["up_scale"] or w.down_t.q is not b["down_t_q"] or w.down_t.scale is not b["down_scale"]:
            # a buffer replaced: the copies kept from the old ones go, and the op finds the module
            # by its gate rows as they are now
            self._drop_kept()
            self._register()
            w = self.__dict__["_weights"] = Fp8GatedWeights(
                Fp8Rows(b["gate_q"], b["gate_scale"]), Fp8Rows(b["up_q"], b["up_scale"]), Fp8Rows(b["down_t_q"], b["down_scale"]))
        return w

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        # the kept copies were made from the old weights (assign=True: new buffers as well)
        self._drop_kept()
        self._register()

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, weights=float8_e4m3fn per-row"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"x must be [..., {self.hidden_size}], got {list(x.shape)}")
        if torch.is_grad_enabled() and x.requires_grad:
            raise RuntimeError("Fp8SparseGatedMLP is inference only: call it under torch.no_grad() / torch.inference_mode()")
        shape = x.shape
        x2 = x if x.dim() == 2 else x.reshape(-1, shape[-1])
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        if torch.compiler.is_compiling():
            from .inference import fp8_ops  # noqa: F401  (registers torch.ops.twell.ffn_fp8)

            y = torch.ops.twell.ffn_fp8(x2, self.gate_q, self.gate_scale, self.up_q, self.up_scale, self.down_t_q,
                                        self.down_scale)
        else:
            y = self.call(x2)
        return y if x2 is x else y.reshape(shape)

    def _prefill_pays(self, M: int, capturing: bool = False) -> bool:
        """Whether a call of ``M`` tokens (more than the decode kernel's) takes the prefill path."""
        if M < (PREFILL_MIN_M if capturing else EAGER_PREFILL_MIN_M):
            return False
        if self.k_est is None:
            # an eager call measures the layer; a capture measures nothing and would record the
            # prefill path blind (a layer's first calls outside the capture measure it)
            return not capturing
        if self.k_est > MAX_DENSITY * self.intermediate_size:
            return False
        return M >= HEAVY_PREFILL_MIN_M or self.whole_rows is None or self.whole_rows <= MAX_WHOLE_ROWS

    def call(self, x: torch.Tensor, keep: bool = True) -> torch.Tensor:
        """One eager call on ``x [M, d]`` (the path of the module's text). ``keep`` False: make
        no buffer that outlives the call (the compiled op's calls in the warm-up of inductor's
        CUDA graphs, whose allocations belong to the graphs' memory pool)."""
        dense_fp8_down_per_unit, prefill_fp8, FP8_DECODE_MAX_M, ffn_decode_fp8, DecodeScratch, DENSE_ROW_MIN = \
            _PATHS or _load_paths()
        # plain attributes through __dict__: nn.Module.__setattr__ costs microseconds a call
        state = self.__dict__
        M = x.shape[0]
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        w = self.weights()
        if M <= FP8_DECODE_MAX_M:
            if self._scratch is None and x.is_cuda and not capturing and keep:
                self._scratch = DecodeScratch(self.hidden_size, x.device)
            state["last_path"] = "decode"
            return ffn_decode_fp8(x, w, self._scratch)[0]
        if not capturing:
            if M >= PREFILL_MIN_M:  # the calls that measure the layer, one in PROBE_EVERY
                state["_calls"] += 1
            if self._event is not None and self._event.query():
                self._poll()
        if not self._prefill_pays(M, capturing):
            state["last_path"] = "dense"
            if (self._down_cm is None or self._down_cm.device != x.device) and not capturing and keep:
                # the down rows as _scaled_mm's column-major operand, kept: a dense layer's extra
                # third; the up rows' scales times the down rows' (f floats); the down product's
                # unit output scales (d floats)
                self._down_cm = self.down_t_q.t().contiguous().t()
                self._up_down_scale = self.up_scale * self.down_scale
                self._ones = torch.ones(1, self.hidden_size, dtype=torch.float32, device=x.device)
            kept = self._down_cm is not None and self._down_cm.device == x.device
            # calls that could take the prefill path in a capture measure the layer as its
            # prefill calls do: a layer whose eager calls stay under EAGER_PREFILL_MIN_M tokens
            # then captures the prefill path where it pays
            probe = M >= PREFILL_MIN_M and self._wants_probe(x, capturing)
            out = dense_fp8_down_per_unit(x, w, *((self._down_cm, self._up_down_scale, self._ones) if kept else ()),
                                          return_gate=probe)
            if not probe:
                return out
            y, gate = out
            with torch.no_grad():  # (on its first PREFILL_MIN_M rows: a bounded pass, however large the call)
                self._publish(*_rows_of_gate(gate[:PREFILL_MIN_M], DENSE_ROW_MIN))
            return y
        state["last_path"] = "prefill"
        y, g = prefill_fp8(x, w, k_est=self.k_est)
        if self._wants_probe(x, capturing):
            with torch.no_grad():
                per_row = g.counts.sum(dim=1)
                self._publish(per_row, (g.counts > g.values.shape[2]).any(dim=1) | (per_row > DENSE_ROW_MIN))
        return y

    def _wants_probe(self, x: torch.Tensor, capturing: bool) -> bool:
        return x.is_cuda and not capturing and self._event is None and (self.k_est is None or self._calls % PROBE_EVERY == 1)

    def _publish(self, per_row: torch.Tensor, whole: torch.Tensor) -> None:
        """Copy the call's mean active units per token (``per_row [M]``) and share of rows
        computed whole (``whole [M]`` bool) to pinned host memory without blocking; the layer's
        first measurement is waited for."""
        first = self.k_est is None
        stats = torch.stack([per_row.float().mean(), whole.float().mean()])
        if self._host is None or self._host.numel() != 2:
            with torch.inference_mode(False):  # (made in inference mode it could not be written outside it)
                self._host = torch.empty(2, dtype=torch.float32, pin_memory=True)
        self._host.copy_(stats, non_blocking=True)
        self._event = torch.cuda.Event()
        # on the stream the copy went to: the call's device's, which need not be the current device
        self._event.record(torch.cuda.current_stream(per_row.device))
        if first:
            # (once) a model compiled in mode="reduce-overhead" captures its graphs at its next
            # call, where nothing is polled, and would capture without the measurement
            self._event.synchronize()
            self._poll()

    def _poll(self) -> None:
        self.k_est, self.whole_rows, self._event = float(self._host[0]), float(self._host[1]), None

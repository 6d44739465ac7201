"""Triton kernels, one file per op family: TwELL inference, and training on ELL rows.

- :mod:`.gate_pack`: ``relu(x w^T)`` into TwELL. Two ways: a light pack pass over a dense
  pre-activation that cuBLAS computed (:func:`pack_relu`), or a Triton matmul whose epilogue
  packs (:func:`gate_pack_fused`; :func:`gate_pack_persistent` the same on a persistent,
  tensor-descriptor matmul; slower than cuBLAS + pack from M 16384 on the H200).
- :mod:`.updown`: the FFN from TwELL (:func:`ffn_from_twell`): gated up/down (nothing
  ``[M, f]``-sized is written) or the non-gated down projection, with the exact path for
  overflowed tiles and its counters.
- :mod:`.decode_fused` and :mod:`.decode`: small batches (the gate read whole, up and down rows
  of the batch's active units only): up to 64 tokens one fused kernel (a CUDA-core GEMV up to 5
  tokens, tensor-core tiles above) and its write-out; any number of tokens in three launches.
  :mod:`.decode_split`: up to 16 tokens in three launches that spread up and down over many
  programs (measured faster from 6 to 16 tokens at low union shares; dispatched only with
  ``twell.inference.dispatch.DECODE_SPLIT`` on).
- :mod:`.elementwise`: ``relu(g) * u`` in one pass, for the modules' dense inference branch.
- :mod:`.dense_rows`: the element-wise passes (forward and backward) of the training rows held
  dense: every row of the dense training op, and the heavy rows' backward.
- :mod:`.train_ffn`: training forward and backward of the FFN on ELL rows (pack, rows forward,
  rows backward, per-unit weight gradients); :mod:`twell.training.ops` wraps them in autograd.
- :mod:`.heavy_rows`: the training forward of the rows heavier than the ELL width, over a row list
  whose length stays on the GPU (no host synchronisation).

Every kernel decides activity with :func:`._activity.fires` (``a > 0``, or ``a`` NaN: where
``relu(a)`` is not zero), so a NaN gate gives the NaN the dense MLP gives.

The launchers validate their arguments, accept any ``M``, ``d`` and ``f``, and launch on the
caller's current CUDA stream (Triton's default). They keep no state between calls.
"""

from .gate_pack import gate_pack_fused, gate_pack_persistent, pack_relu
from .updown import OverflowCounters, ffn_from_twell

__all__ = ["pack_relu", "gate_pack_fused", "gate_pack_persistent", "ffn_from_twell", "OverflowCounters"]

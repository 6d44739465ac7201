"""twell's inference FFN as a PyTorch custom op, so that ``torch.compile`` keeps it in its graph.

``torch.ops.twell.ffn_infer(x, w_first, w_down, w_up) -> y``:

- ``x [M, d]`` (unit-stride rows), ``w_first [f, d]`` (gate, or up for the non-gated MLP),
  ``w_down [d, f]`` (nn.Linear layout, as the module stores it), ``w_up [f, d]`` or None
  (non-gated);
- returns ``y [M, d]``, computed as an eager call of the module that owns ``w_first``
  (:func:`twell.inference.dispatch.layer_of_weight`, then
  :meth:`twell.inference.dispatch.LayerState.call`): the same per-call choice of decode kernels,
  prefill kernels or dense as in eager mode, small calls replayed from the layer's own CUDA
  graphs (:mod:`twell.inference.eager_graphs`) as in eager mode, and the same probes of the
  layer's sparsity. The layer is found from its weight, not passed as an integer, so that
  per-layer compilation shares one graph across layers. Weights no live module owns (a compiler
  that copied them) get the dense computation, with a warning.

Under ``mode="reduce-overhead"`` inductor captures the compiled graph in CUDA graphs of its own
(cudagraph trees), warming each up first on a side stream with its allocations routed to the
graphs' memory pool. A call on a stream other than the device's default one (that warm-up, or a
caller's own stream) and a call inside a capture run :meth:`LayerState.run` directly: no eager
graph of twell's nested in inductor's, no buffer kept from the graphs' pool (the decode kernels
take buffers of the call's own there). The capture then records the path the layer's measured
sparsity picks, as twell's own graphs do: the layer's first estimate is waited for at its first
call (:meth:`LayerState.run`), so a model compiled before it ever ran eagerly captures the decode
or prefill kernels where they pay, not a blind dense path.

The fake (meta) implementation gives the output's shape, so ``torch.compile(fullgraph=True)``
traces a twell model without a graph break in the MLP, and inductor calls the op at run time.
The op is inference only (no autograd formula): the modules call it only when no gradient is
needed. It is registered through :func:`twell.inference.op_library.inference_op`, whose calls cost
the dispatcher a fraction of what ``torch.library.custom_op``'s do.
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch

from .dispatch import layer_of_weight
from .op_library import inference_op, off_default_stream

__all__ = ["ffn_infer"]


def _ffn_infer_fake(x, w_first, w_down, w_up):
    if x.dim() != 2 or w_first.dim() != 2 or w_down.dim() != 2 or w_down.shape[0] != x.shape[1]:
        raise ValueError(
            f"twell::ffn_infer: x [M, d], w_first [f, d], w_down [d, f]; got {list(x.shape)}, "
            f"{list(w_first.shape)}, {list(w_down.shape)}"
        )
    return x.new_empty(x.shape[0], x.shape[1])


@inference_op("ffn_infer", "(Tensor x, Tensor w_first, Tensor w_down, Tensor? w_up) -> Tensor", _ffn_infer_fake)
def ffn_infer(x: torch.Tensor, w_first: torch.Tensor, w_down: torch.Tensor, w_up: Optional[torch.Tensor]) -> torch.Tensor:
    """One FFN call of the layer that owns ``w_first`` (see the module docstring)."""
    # Only what every path needs here: the kernel paths check the rest in LayerState.run
    # (check_decode_args) before any kernel, and the dense path's matmuls raise torch's errors.
    # A full check on every call would cost a compiled model's host 7 us per layer.
    if x.dim() != 2:
        raise ValueError(f"twell::ffn_infer: x must be 2-D [M, d], got shape {list(x.shape)}")
    state = layer_of_weight(w_first)
    if state is not None:
        if x.is_cuda and off_default_stream(x.get_device()):  # (a capture is never on the default stream)
            return state.run(x, w_first, w_down, w_up, make_scratch=False)
        return state.call(x, w_first, w_down, w_up, fresh_output=True)
    warnings.warn("twell::ffn_infer: no twell module owns these weights (copied by a compiler?); "
                  "computing the FFN densely", RuntimeWarning, stacklevel=2)
    a = torch.mm(x, w_first.t())
    h = torch.relu(a) if w_up is None else torch.relu(a) * torch.mm(x, w_up.t())
    return torch.mm(h, w_down.t())


"""twell's inference FFN as a PyTorch custom op, so that ``torch.compile`` keeps it in its graph.

``torch.ops.twell.ffn_infer(x, w_first, w_down, w_up) -> y``:

- ``x [M, d]`` (unit-stride rows), ``w_first [f, d]`` (gate, or up for the non-gated MLP),
  ``w_down [d, f]`` (nn.Linear layout, as the module stores it), ``w_up [f, d]`` or None
  (non-gated);
- returns ``y [M, d]``, computed by :meth:`twell.inference.dispatch.LayerState.run` of the module that
  owns ``w_first`` (:func:`twell.inference.dispatch.layer_of_weight`): the same per-call choice of decode
  kernels, prefill kernels or dense as in eager mode. The layer is found from its weight, not
  passed as an integer, so that per-layer compilation shares one graph across layers. Weights
  no live module owns (a compiler that copied them) get the dense computation, with a warning.

The fake (meta) implementation gives the output's shape, so ``torch.compile(fullgraph=True)``
traces a twell model without a graph break in the MLP, and inductor calls the op at run time.
The op is inference only (no autograd formula): the modules call it only when no gradient is
needed.
"""

from __future__ import annotations

from typing import Optional

import torch

import warnings

from .dispatch import layer_of_weight

__all__ = ["ffn_infer"]


@torch.library.custom_op("twell::ffn_infer", mutates_args=())
def ffn_infer(x: torch.Tensor, w_first: torch.Tensor, w_down: torch.Tensor, w_up: Optional[torch.Tensor]) -> torch.Tensor:
    """One FFN call of the layer that owns ``w_first`` (see the module docstring)."""
    # Only what every path needs here: the kernel paths check the rest in LayerState.run
    # (check_decode_args) before any kernel, and the dense path's matmuls raise torch's errors.
    # A full check on every call would cost a compiled model's host 7 us per layer.
    if x.dim() != 2:
        raise ValueError(f"twell::ffn_infer: x must be 2-D [M, d], got shape {list(x.shape)}")
    state = layer_of_weight(w_first)
    if state is not None:
        return state.run(x, w_first, w_down, w_up, make_scratch=False)
    warnings.warn("twell::ffn_infer: no twell module owns these weights (copied by a compiler?); "
                  "computing the FFN densely", RuntimeWarning, stacklevel=2)
    a = torch.mm(x, w_first.t())
    h = torch.relu(a) if w_up is None else torch.relu(a) * torch.mm(x, w_up.t())
    return torch.mm(h, w_down.t())


@ffn_infer.register_fake
def _ffn_infer_fake(x, w_first, w_down, w_up):
    if x.dim() != 2 or w_first.dim() != 2 or w_down.dim() != 2 or w_down.shape[0] != x.shape[1]:
        raise ValueError(
            f"twell::ffn_infer: x [M, d], w_first [f, d], w_down [d, f]; got {list(x.shape)}, "
            f"{list(w_first.shape)}, {list(w_down.shape)}"
        )
    return x.new_empty(x.shape[0], x.shape[1])

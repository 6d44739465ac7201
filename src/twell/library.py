"""twell's inference FFN as a PyTorch custom op, so that ``torch.compile`` keeps it in its graph.

``torch.ops.twell.ffn_infer(x, w_first, w_down, w_up, layer) -> y``:

- ``x [M, d]`` (unit-stride rows), ``w_first [f, d]`` (gate, or up for the non-gated MLP),
  ``w_down [d, f]`` (nn.Linear layout, as the module stores it), ``w_up [f, d]`` or None
  (non-gated), ``layer`` the module's key (``module._twell_key``);
- returns ``y [M, d]``, computed by that layer's :meth:`twell.dispatch.LayerState.run`: the
  same per-call choice of decode kernels, prefill kernels or dense as in eager mode.

The fake (meta) implementation gives the output's shape, so ``torch.compile(fullgraph=True)``
traces a twell model without a graph break in the MLP, and inductor calls the op at run time.
The op is inference only (no autograd formula): the modules call it only when no gradient is
needed.
"""

from __future__ import annotations

from typing import Optional

import torch

from .dispatch import layer_state

__all__ = ["ffn_infer"]


@torch.library.custom_op("twell::ffn_infer", mutates_args=())
def ffn_infer(x: torch.Tensor, w_first: torch.Tensor, w_down: torch.Tensor, w_up: Optional[torch.Tensor], layer: int) -> torch.Tensor:
    """One FFN call of layer ``layer`` (see the module docstring)."""
    return layer_state(layer).run(x, w_first, w_down, w_up)


@ffn_infer.register_fake
def _ffn_infer_fake(x, w_first, w_down, w_up, layer):
    if x.dim() != 2 or w_first.dim() != 2 or w_down.dim() != 2 or w_down.shape[0] != x.shape[1]:
        raise ValueError(
            f"twell::ffn_infer: x [M, d], w_first [f, d], w_down [d, f]; got {list(x.shape)}, "
            f"{list(w_first.shape)}, {list(w_down.shape)}"
        )
    return x.new_empty(x.shape[0], x.shape[1])

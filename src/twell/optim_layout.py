"""Optimizer state that follows a weight's layout.

The sparse modules keep ``down_proj.weight`` as the transpose of a contiguous ``[f, d]`` matrix
in eval mode, and in training on CUDA (``twell.training.path.KERNEL_LAYOUT``): same values, same
``[d, f]`` shape, strides ``(1, d)``. An optimizer state made or loaded in the other layout (an
``exp_avg`` created in the ``nn.Linear`` layout, a checkpoint written in it, a step taken after
``eval()``) then has other strides than its parameter. Fused AdamW reads parameter, gradient
and state as flat memory, so it pairs each element with another element's moments: on the CPU
(torch 2.13) it does so silently; on CUDA (torch 2.11, H200) it raises "params, grads, exp_avgs,
and exp_avg_sqs must have same dtype, device, and layout".

So every sparse module registers itself here (:func:`follow_layout`; a weak set of modules,
not of tensors: a weak reference to a tensor would stop ``torch.utils.swap_tensors``), and one
global optimizer step pre-hook (``torch.optim.optimizer.register_optimizer_step_pre_hook``,
registered with the first module) copies, before each step of any optimizer, every plain state
tensor of a parameter's shape whose strides differ from the parameter's into the parameter's
layout (on the state's own device and dtype). It walks the registered modules' ``down_proj``
weights, or the optimizer's state where that is shorter (one optimizer per parameter); there it
applies the same rule to every parameter. After the copy the strides match, so later steps only
compare them. Not covered: state held as tensor subclasses (quantised optimizers), and an
optimizer step captured in a CUDA graph (the graph would keep the old state tensors).
"""

from __future__ import annotations

import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

__all__ = ["follow_layout"]

_MODULES: "weakref.WeakSet" = weakref.WeakSet()
_HOOK = None


def follow_layout(module: torch.nn.Module) -> None:
    """From now on, optimizer state of ``module.down_proj.weight`` is laid out as that weight is
    before each step."""
    global _HOOK
    _MODULES.add(module)
    if _HOOK is None:
        _HOOK = register_optimizer_step_pre_hook(_match_state_layout)


def _weights():
    # A snapshot of the weak references, taken without running Python code: iterating the
    # WeakSet itself is a generator, during which another thread could build a module (which
    # registers itself), and the set would change size mid-iteration.
    for ref in list(_MODULES.data):
        m = ref()
        # the stored weight (None under a parametrization, whose weight attribute recomputes it:
        # spectral_norm's power iteration would advance at every optimizer step)
        w = None if m is None else m._stored_down_weight()
        if w is not None:
            yield w


@torch.compiler.disable  # a compiled step would otherwise guard on (and recompile with) the registry
def _match_state_layout(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    state = optimizer.state
    if not state:
        return
    if len(state) <= len(_MODULES):
        items = list(state.items())
    else:
        items = [(p, state.get(p)) for p in _weights()]  # state.get: the defaultdict would add entries
    for p, st in items:
        # Other optimizers may keep per-parameter state that is not a dict (a tensor, a list).
        if isinstance(st, dict) and st and isinstance(p, torch.Tensor) and type(p.data) is torch.Tensor:
            for name, v in st.items():
                if type(v) is torch.Tensor and v.dim() >= 2 and v.shape == p.shape and v.stride() != p.stride():
                    st[name] = torch.empty_strided(p.shape, p.stride(), dtype=v.dtype, device=v.device).copy_(v)

"""Optimizer state that follows a weight's layout.

The sparse modules keep ``down_proj.weight`` as the transpose of a contiguous ``[f, d]`` matrix
in eval mode, and in training on CUDA (``twell.train_path.KERNEL_LAYOUT``): same values, same
``[d, f]`` shape, strides ``(1, d)``. An optimizer state made or loaded in the other layout (an
``exp_avg`` created in the ``nn.Linear`` layout, a checkpoint written in it, a step taken after
``eval()``) then has other strides than its parameter. Fused AdamW reads parameter, gradient
and state as flat memory, so it pairs each element with another element's moments: on the CPU
(torch 2.13) it does so silently.

So every parameter whose layout twell changes is registered here (:func:`follow_layout`), and
one global optimizer step pre-hook (``torch.optim.optimizer.register_optimizer_step_pre_hook``,
registered at the first such change) copies, before each step of any optimizer, each state
tensor of such a parameter's shape whose strides differ from the parameter's into the
parameter's layout (on the state's own device and dtype). Once per change: the copy then has the
parameter's strides, so later steps only compare strides (a few microseconds for a whole model).
"""

from __future__ import annotations

import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

__all__ = ["follow_layout"]

_FOLLOWED: "dict[int, weakref.ref]" = {}  # id(parameter) -> weak reference to it
_HOOK = None


def follow_layout(param: torch.Tensor) -> None:
    """From now on, optimizer state of ``param`` is laid out as ``param`` is before each step."""
    global _HOOK
    key = id(param)
    _FOLLOWED[key] = weakref.ref(param, lambda _ref, key=key: _FOLLOWED.pop(key, None))
    if _HOOK is None:
        _HOOK = register_optimizer_step_pre_hook(_match_state_layout)


def _match_state_layout(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    state = optimizer.state
    for ref in list(_FOLLOWED.values()):
        p = ref()
        if p is None:
            continue
        st = state.get(p)  # not state[p]: the defaultdict would add an entry
        if not st:
            continue
        for name, v in st.items():
            if isinstance(v, torch.Tensor) and v.shape == p.shape and v.stride() != p.stride():
                st[name] = torch.empty_strided(p.shape, p.stride(), dtype=v.dtype, device=v.device).copy_(v)

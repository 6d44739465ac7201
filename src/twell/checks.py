"""Argument checks shared by the references, the kernels' launchers and the modules.

Every public entry point validates its tensors here *before* any kernel runs, so that a bad
call fails with a message that names what was expected and what came.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what the Triton kernels take


def check_tensor(t, name: str, dim: Optional[int] = None, dtypes=FLOAT_DTYPES) -> None:
    """Raise TypeError/ValueError unless ``t`` is a tensor of one of ``dtypes`` with ``dim`` dims."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({names}), got {t.dtype}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(t.shape)}")


def check_weight_rows(w: Optional[torch.Tensor], name: str, f: int, d: int, x: torch.Tensor,
                      dtype: Optional[torch.dtype] = None) -> None:
    """Unless ``w`` is None: raise unless it is an ``[f, d]`` kernel-dtype tensor with unit-stride
    rows (any row stride), on ``x``'s device with ``x``'s dtype (``dtype`` instead where given:
    FP8 rows). The kernels read one unit's row of ``w`` as a contiguous run of ``d`` values."""
    if w is None:
        return
    check_tensor(w, name, dim=2, dtypes=KERNEL_DTYPES if dtype is None else (dtype,))
    if tuple(w.shape) != (f, d):
        raise ValueError(f"{name} must be [f, d] = [{f}, {d}], got {list(w.shape)}")
    if w.stride(1) != 1 and d > 1:  # (rows of one value have no column stride: [f, 1] views of [1, f])
        raise ValueError(f"{name} must have unit-stride rows (stride(1) == 1), got strides {w.stride()}")
    if w.device != x.device or (dtype is None and w.dtype != x.dtype):
        raise TypeError(f"{name} ({w.dtype}, {w.device}) must match x ({x.dtype if dtype is None else dtype}, {x.device})")


def check_mlp_args(
    x: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    w_gate: Optional[torch.Tensor] = None,
) -> tuple[int, int]:
    """Validate ``x [M, d]``, ``w_gate [f, d]`` (gated only), ``w_up [f, d]``, ``w_down [d, f]``.

    All must be floating tensors of one dtype on one device. Returns ``(d, f)``.
    """
    check_tensor(x, "x", dim=2)
    d = x.shape[1]
    check_tensor(w_up, "w_up", dim=2)
    f = w_up.shape[0]
    named = [("w_up", w_up, (f, d)), ("w_down", w_down, (d, f))]
    if w_gate is not None:
        named.insert(0, ("w_gate", w_gate, (f, d)))
    for name, w, shape in named:
        check_tensor(w, name, dim=2)
        if tuple(w.shape) != shape:
            raise ValueError(
                f"{name} must be {list(shape)} (nn.Linear layout: [out_features, in_features]) "
                f"for x [M, {d}] and f = {f}, got {list(w.shape)}"
            )
        if w.dtype != x.dtype:
            raise TypeError(f"{name} has dtype {w.dtype} but x has {x.dtype}; they must match")
        if w.device != x.device:
            raise ValueError(f"{name} is on {w.device} but x is on {x.device}; they must match")
    return d, f


def triton_interpreting() -> bool:
    """True when Triton kernels run in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_launchable(t: torch.Tensor, name: str) -> None:
    """Raise ValueError unless a Triton kernel can run on ``t``: a CUDA tensor, or under the
    interpreter any tensor with data (not on the meta device)."""
    if not t.is_cuda and not triton_interpreting():
        raise ValueError(f"{name} must be a CUDA tensor (or run under TRITON_INTERPRET=1), got {t.device}")
    if t.is_meta:
        raise ValueError(f"{name} is on the meta device (shapes only, no data): a Triton kernel cannot run on it")


def width_key(d: int) -> int:
    """The key of the per-width tuning tables (``twell.kernels.updown``'s shapes and split
    threshold, ``twell.inference.dispatch.LayerState.MAX_UNITS_BY_D``): the model width ``d`` rounded up
    to a power of two (at least 1), as the kernels pad it."""
    return 1 << (max(d, 1) - 1).bit_length()


def check_pow2(value: int, name: str, lo: int = 1, hi: int = 1024) -> None:
    """A clear error unless ``value`` (a kernel's launch knob) is an int power of two in
    ``[lo, hi]``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or value > hi or value & (value - 1):
        raise ValueError(f"{name} must be a power of two in [{lo}, {hi}], got {value!r}")


def check_count(value: int, name: str, lo: int = 1, hi: int = 1 << 20) -> None:
    """A clear error unless ``value`` (a count such as pipeline stages or programs) is an int
    in ``[lo, hi]``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or value > hi:
        raise ValueError(f"{name} must be an int in [{lo}, {hi}], got {value!r}")


def check_config(config, knobs: tuple, name: str = "config") -> None:
    """A clear error unless ``config`` is a tuple (or list, or NamedTuple) with one entry per
    knob in ``knobs``: ``(knob name, lo, hi, power of two)`` each, checked by :func:`check_pow2`
    or :func:`check_count`. Launch shapes reach ``tl.arange`` and block loops: anything else
    would fail inside Triton's compiler, or cover the data wrongly."""
    names = ", ".join(k[0] for k in knobs)
    if not isinstance(config, (tuple, list)) or len(config) != len(knobs):
        raise ValueError(f"{name} must be a tuple ({names}), got {config!r}")
    for value, (knob, lo, hi, pow2) in zip(config, knobs):
        (check_pow2 if pow2 else check_count)(value, f"{name}'s {knob}", lo, hi)

"""Registering twell's inference ops with the PyTorch dispatcher at the lowest cost per call.

An op made with ``torch.library.custom_op`` is called through a Python autograd wrapper that
redispatches and checks that the output aliases no input, on every call: on a 2-core CPU here
28 us per call of an op whose body returns at once, against 5 us for the same body registered
with ``torch.library.Library`` (``torch.mm`` of one row: 10 us). A compiled model calls the
inference op once per layer per forward, and at a few tokens per call that is most of the
call's time. The inference ops take no gradient (the modules call them only where none is
needed), so they need none of the wrapper: :func:`inference_op` defines the schema and one
``CompositeExplicitAutograd`` kernel (every device) with a fake implementation for
``torch.compile``. Outputs must still be fresh tensors (the ops' own contract: nothing checks it
per call).
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["inference_op", "off_default_stream"]

_LIB = torch.library.Library("twell", "FRAGMENT")  # kept alive: the registrations live as long as it
_DEFAULT_STREAM: dict = {}  # CUDA device index -> its default stream's handle


def inference_op(name: str, schema: str, fake: Callable) -> Callable:
    """Decorator: register ``fn`` as ``torch.ops.twell.<name>`` with ``schema`` (the argument
    list and return, e.g. ``"(Tensor x, Tensor? w) -> Tensor"``) and ``fake`` as its fake
    implementation; returns the op's ``OpOverload`` (``torch.ops.twell.<name>.default``), which
    calls ``fn`` eagerly and appears as one node in a compiled graph."""

    def register(fn: Callable):
        _LIB.define(name + schema)
        _LIB.impl(name, fn, "CompositeExplicitAutograd")
        torch.library.register_fake(f"twell::{name}", fake, lib=_LIB)
        return getattr(torch.ops.twell, name).default

    return register


def off_default_stream(index: int) -> bool:
    """Whether the current stream of CUDA device ``index`` is not its default stream (inductor's
    warm-up of its CUDA graphs, a caller's own stream, any capture): compared by handle, as
    inductor's generated code reads it, without making two ``torch.cuda.Stream`` objects a call."""
    default = _DEFAULT_STREAM.get(index)
    if default is None:
        default = _DEFAULT_STREAM[index] = torch.cuda.default_stream(index).cuda_stream
    return torch._C._cuda_getCurrentRawStream(index) != default

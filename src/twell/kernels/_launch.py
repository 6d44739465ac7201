"""What every launcher needs before it starts a kernel."""

from __future__ import annotations

import contextlib

import torch


def on_device_of(t: torch.Tensor):
    """Make ``t``'s GPU the current device for the launch.

    Triton launches on the *current* device's current stream. A layer on ``cuda:1`` called while
    ``cuda:0`` is current (``device_map="auto"`` spreads layers so) would otherwise run on the
    wrong device's stream, unordered with the cuBLAS work that produced its inputs.
    """
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()

"""What every launcher needs before it starts a kernel."""

from __future__ import annotations

import contextlib
import os

import torch


def on_device_of(t: torch.Tensor):
    """Make ``t``'s GPU the current device for the launch.

    Triton launches on the *current* device's current stream. A layer on ``cuda:1`` called while
    ``cuda:0`` is current (``device_map="auto"`` spreads layers so) would otherwise run on the
    wrong device's stream, unordered with the cuBLAS work that produced its inputs.
    """
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


_PDL: dict = {}

# Programmatic dependent launch (Hopper and later) for a kernel that only finishes what the
# kernel before it in the stream did (twell.kernels.decode_fused's write-out): it may start while
# that one runs and waits in `griddepcontrol.wait` for its completion and memory flush, which
# hides its launch latency (about a microsecond in a CUDA graph). Off switch for debugging.
USE_PDL = True


def pdl_ok(t: torch.Tensor) -> bool:
    """Whether kernels on ``t``'s device may use programmatic dependent launch (NVIDIA CUDA,
    compute capability 9.0 or later, not the Triton interpreter)."""
    if not (USE_PDL and t.is_cuda):
        return False
    idx = t.device.index if t.device.index is not None else torch.cuda.current_device()
    ok = _PDL.get(idx)
    if ok is None:  # asked on every small call: decided once per device
        ok = _PDL[idx] = (torch.version.hip is None and os.environ.get("TRITON_INTERPRET") != "1"
                          and torch.cuda.get_device_capability(idx)[0] >= 9)
    return ok

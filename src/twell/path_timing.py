"""A layer's own timing of the prefill kernels against dense near its break-even (opt-in:
``twell.dispatch.TIMED_CHOICE``).

The static rule (:meth:`twell.dispatch.LayerState.limit`) was measured on the H200 at two
shapes. Another GPU or shape moves the break-even: on an H100 at d 4096, f 11008 it fell at 52
active units per token against 68 on the H200 (benchmarks/NOTES_inference.md, thirtieth
session). Both paths are exact, so which one runs changes only the time. Near the limit a
layer with this on times both on its own calls and takes the faster.

- **Size classes.** Calls are grouped by ``M.bit_length()`` (a power of two of tokens).
- **Trials.** While the layer's estimate lies within ``BAND`` times the limit and its class has
  no verdict for about this estimate, the class's calls alternate between the paths. A pair of
  CUDA events times each call.
- **Warm-up.** The first call of each path in a class is not timed: it can include Triton's
  compilation or cuBLAS's heuristics.
- **No sync.** The events are read once complete (``Event.query``), as the sparsity probe is.
- **Verdict.** After ``SAMPLES`` timings of each path, the class takes the path with the lower
  median. The verdict holds while the estimate stays within ``COST_TOLERANCE`` of its median
  over the trial calls; past that the class measures again.

A trial or verdict never runs inside a CUDA graph capture (the layer's path is fixed there),
nor for a layer whose ``kernel_max_density`` is set (its owner chose the limit).
"""

from __future__ import annotations

import statistics
from typing import Callable, Optional

import torch

__all__ = ["PathTimer", "SAMPLES", "BAND", "COST_TOLERANCE"]

PATHS = ("prefill", "dense")
SAMPLES = 3
# estimates from BAND[0] to BAND[1] times the limit are timed: the measured break-evens lay
# between 0.84 (H100, d 4096, M 16384) and 1.56 (H200, d 4096, M 65536) times the 62-unit limit
BAND = (0.7, 1.7)
COST_TOLERANCE = 0.1


class _SizeClass:
    """Timings and verdict of one size class."""

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = {p: [] for p in PATHS}  # ms, completed
        self.pending: list[tuple[str, object, object]] = []  # (path, start event, end event)
        self.warmed = {p: False for p in PATHS}
        self.verdict: Optional[str] = None
        self.verdict_cost = 0.0  # the median estimate over the trial calls
        self.trial_costs: list[float] = []

    def started(self, path: str) -> int:
        return len(self.times[path]) + sum(1 for p, _, _ in self.pending if p == path)


class PathTimer:
    """Per-layer trials and verdicts (see the module docstring). ``event`` makes a timing event
    (default ``torch.cuda.Event(enable_timing=True)``; tests pass a fake)."""

    def __init__(self, event: Optional[Callable[[], object]] = None) -> None:
        self._classes: dict[int, _SizeClass] = {}
        self._event = event or (lambda: torch.cuda.Event(enable_timing=True))
        self._timing: Optional[tuple[_SizeClass, str]] = None  # the call choose() asked to time

    def choose(self, M: int, cost: float, limit: float) -> Optional[str]:
        """The path for an eager call of ``M`` tokens whose estimate is ``cost`` against the
        static ``limit`` (both in active units per token): the class's verdict, or the path to
        try next. None leaves the choice to the static rule: the estimate is outside the band,
        or every timing is in flight."""
        self._timing = None
        if not BAND[0] * limit <= cost <= BAND[1] * limit:
            return None
        c = self._classes.setdefault(max(M, 1).bit_length(), _SizeClass())
        self._collect(c)
        if c.verdict is not None:
            if abs(cost - c.verdict_cost) <= COST_TOLERANCE * max(c.verdict_cost, 1e-9):
                return c.verdict
            # the sparsity moved: measure again
            c.verdict, c.times, c.trial_costs = None, {p: [] for p in PATHS}, []
        started = {p: c.started(p) for p in PATHS}
        if min(started.values()) >= SAMPLES:
            return None
        path = "prefill" if started["prefill"] <= started["dense"] else "dense"
        self._timing = (c, path)
        c.trial_costs.append(cost)
        return path

    def start(self, path: str, device: Optional[torch.device] = None) -> Optional[tuple]:
        """Before ``path`` runs on ``device``: a token for :meth:`stop` if this call is a trial.
        The events go on the device's current stream, where the path's work goes (not the current
        device's: a layer on cuda:1 may run while cuda:0 is current). A call whose caller ran
        another path than the one :meth:`choose` gave (a weight that cannot take the kernels) is
        not timed."""
        if self._timing is None:
            return None
        c, chosen = self._timing
        self._timing = None
        if path != chosen:
            return None
        if not c.warmed[path]:
            c.warmed[path] = True
            return None
        stream = torch.cuda.current_stream(device) if device is not None and device.type == "cuda" else None
        ev = self._event()
        ev.record(stream)
        return c, path, ev, stream

    def stop(self, token: Optional[tuple]) -> None:
        """After the path was issued: its end event."""
        if token is None:
            return
        c, path, start, stream = token
        end = self._event()
        end.record(stream)
        c.pending.append((path, start, end))

    def _collect(self, c: _SizeClass) -> None:
        """Move completed timings into ``times``; give the verdict once each path has SAMPLES."""
        still = []
        for path, start, end in c.pending:
            if end.query():
                c.times[path].append(start.elapsed_time(end))
            else:
                still.append((path, start, end))
        c.pending = still
        if c.verdict is None and all(len(c.times[p]) >= SAMPLES for p in PATHS):
            med = {p: statistics.median(c.times[p][:SAMPLES]) for p in PATHS}
            c.verdict = "prefill" if med["prefill"] < med["dense"] else "dense"
            c.verdict_cost = statistics.median(c.trial_costs)

    def verdicts(self) -> dict[int, tuple[str, float, dict[str, list[float]]]]:
        """``{size class: (path, estimate it was made at, timings in ms)}`` of the classes
        that have one (for benchmarks and curious users)."""
        return {k: (c.verdict, c.verdict_cost, {p: list(v) for p, v in c.times.items()})
                for k, c in self._classes.items() if c.verdict is not None}

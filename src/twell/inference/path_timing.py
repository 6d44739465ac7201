"""A layer's own timing of the prefill kernels against dense near its break-even (opt-in:
``twell.inference.dispatch.TIMED_CHOICE``).

The static rule (:meth:`twell.inference.dispatch.LayerState.limit`) was measured at two shapes.
Another GPU or shape moves the break-even: at d 4096, f 11008 with the fused up/down it fell at 52
active units per token on an H100 against 68 on the H200; that shape takes the split path and its
own cap (96, H100). Both paths are exact, so which one runs changes only the time. Near the limit a
layer with this on times both on its own calls and takes the faster.

- **Size classes.** Calls are grouped by ``M.bit_length()`` (a power of two of tokens). Times
  are compared per token, since one class spans calls of up to twice as many tokens.
- **Trials.** While the layer's estimate lies within ``BAND`` times the limit and its class has
  no verdict for about this estimate, the class's calls alternate between the paths. A pair of
  CUDA events times each call.
- **Warm-up.** The first call of each path in a class is not timed: it can include Triton's
  compilation or cuBLAS's heuristics.
- **No sync.** The events are read once complete (``Event.query``), as the sparsity probe is.
- **Verdict.** After ``SAMPLES`` timings of each path, the class takes the path with the lower
  median. The verdict holds while the layer's estimate without its tail term (the part that
  does not depend on M) stays within ``COST_TOLERANCE`` of its median over the timed calls.
  Past that, the class measures again.
- **No trials where a path cannot run.** If the caller ran another path than the trial's (a
  down weight that cannot take the kernels), the class stops timing and leaves the choice to
  the static rule.

A trial or verdict never runs inside a CUDA graph capture (the layer's path is fixed there),
nor for a layer whose ``kernel_max_density`` is set (its owner chose the limit). Like the rest
of a layer's inference state, a timer is not made for one layer called from several threads at
once.
"""

from __future__ import annotations

import statistics
from typing import Callable, NamedTuple, Optional

import torch

__all__ = ["PathTimer", "Trial", "SAMPLES", "BAND", "COST_TOLERANCE"]

PATHS = ("prefill", "dense")
SAMPLES = 3
# estimates from BAND[0] to BAND[1] times the limit are timed: with the fused up/down the
# measured break-evens lay between 0.84 (H100, d 4096, M 16384) and 1.56 (H200, d 4096, M 65536)
# times the 62-unit limit; with the split path and d 4096's cap of 96, 1.05 to 1.14 (H100)
BAND = (0.7, 1.7)
COST_TOLERANCE = 0.1


class _SizeClass:
    """Timings and verdict of one size class."""

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = {p: [] for p in PATHS}  # ms per token, completed
        self.pending: list[tuple[str, int, object, object]] = []  # (path, tokens, start event, end event)
        self.warmed = {p: False for p in PATHS}
        self.verdict: Optional[str] = None
        self.verdict_base = 0.0  # the median M-independent estimate over the timed calls
        self.bases: list[float] = []
        self.disabled = False  # a path of a trial did not run: the static rule decides

    def started(self, path: str) -> int:
        return len(self.times[path]) + sum(1 for p, *_ in self.pending if p == path)


class Trial(NamedTuple):
    """One call :meth:`PathTimer.choose` asked to time: hand it to :meth:`PathTimer.start`."""

    cls: _SizeClass
    path: str
    M: int
    base: float


class PathTimer:
    """Per-layer trials and verdicts (see the module docstring). ``event`` makes a timing event
    (default ``torch.cuda.Event(enable_timing=True)``; tests pass a fake)."""

    def __init__(self, event: Optional[Callable[[], object]] = None) -> None:
        self._classes: dict[int, _SizeClass] = {}
        self._event = event or (lambda: torch.cuda.Event(enable_timing=True))

    def choose(self, M: int, cost: float, base: float, limit: float) -> tuple[Optional[str], Optional[Trial]]:
        """The path for an eager call of ``M`` tokens whose estimate is ``cost`` (``base``: its
        part that does not depend on M) against the static ``limit``, all in active units per
        token, and the trial to time when the path is one. ``(None, None)`` leaves the choice to
        the static rule: the estimate is outside the band, every timing is in flight, or the
        class stopped timing."""
        if not BAND[0] * limit <= cost <= BAND[1] * limit:
            return None, None
        c = self._classes.setdefault(max(M, 1).bit_length(), _SizeClass())
        if c.disabled:
            return None, None
        self._collect(c)
        if c.verdict is not None:
            if abs(base - c.verdict_base) <= COST_TOLERANCE * max(c.verdict_base, 1e-9):
                return c.verdict, None
            # the sparsity moved: measure again
            c.verdict, c.times, c.bases = None, {p: [] for p in PATHS}, []
        started = {p: c.started(p) for p in PATHS}
        if min(started.values()) >= SAMPLES:
            return None, None
        path = "prefill" if started["prefill"] <= started["dense"] else "dense"
        return path, Trial(c, path, M, base)

    def start(self, trial: Optional[Trial], path: str, device: Optional[torch.device] = None) -> Optional[tuple]:
        """Before ``path`` runs on ``device`` for ``trial``: a token for :meth:`stop`, or None
        where the call is not timed (its path's first call in the class, or another path than
        the trial's, which stops the class's timing). The events go on the device's current
        stream, where the path's work goes (not the current device's: a layer on cuda:1 may run
        while cuda:0 is current)."""
        if trial is None:
            return None
        c = trial.cls
        if path != trial.path:
            c.disabled = True
            return None
        if not c.warmed[path]:
            c.warmed[path] = True
            return None
        c.bases.append(trial.base)
        stream = torch.cuda.current_stream(device) if device is not None and device.type == "cuda" else None
        ev = self._event()
        ev.record(stream)
        return c, path, trial.M, ev, stream

    def stop(self, token: Optional[tuple]) -> None:
        """After the path was issued: its end event."""
        if token is None:
            return
        c, path, M, start, stream = token
        end = self._event()
        end.record(stream)
        c.pending.append((path, M, start, end))

    def _collect(self, c: _SizeClass) -> None:
        """Move completed timings into ``times``; give the verdict once each path has SAMPLES."""
        still = []
        for path, M, start, end in c.pending:
            if end.query():
                c.times[path].append(start.elapsed_time(end) / max(M, 1))
            else:
                still.append((path, M, start, end))
        c.pending = still
        if c.verdict is None and all(len(c.times[p]) >= SAMPLES for p in PATHS):
            med = {p: statistics.median(c.times[p][:SAMPLES]) for p in PATHS}
            c.verdict = "prefill" if med["prefill"] < med["dense"] else "dense"
            c.verdict_base = statistics.median(c.bases)

    def verdicts(self) -> dict[int, tuple[str, float, dict[str, list[float]]]]:
        """``{size class: (path, M-independent estimate it was made at, timings in ms per
        token)}`` of the classes that have one (for benchmarks and curious users)."""
        return {k: (c.verdict, c.verdict_base, {p: list(v) for p, v in c.times.items()})
                for k, c in self._classes.items() if c.verdict is not None}

"""A layer's own timing of its two training paths where the static rule cannot tell which is faster.

Below ``twell.training.path.MIN_SPARSE_TOKENS`` tokens per call the sparse training op is bound
by the host, and how fast the host is decides it: at 4096 tokens (k 29, even rows, d 2048, f
5632) the forced sparse op read 1.14x to 1.19x dense PyTorch on one H100 machine and 0.49x to
0.52x on an H200 machine the same day. A fixed floor leaves speed unused on the first kind of
machine or loses it on the second. So a layer that the static rule (:func:`twell.training.path.choose_path`)
would train sparse, in calls of ``TIMED_TOKENS`` tokens, can time both paths on its own calls and
keep the faster (opt-in: ``TIMED_CHOICE``, see there):

- **Size classes.** Calls are grouped by ``M.bit_length()`` (a power of two of tokens); times are
  compared per token, since one class spans calls of up to twice as many tokens.
- **Trials.** Until a class has a verdict its calls alternate between the paths. A call is timed
  around its forward and around its backward (hooks on the op's autograd node, its first
  backward only) twice: by CUDA events on the GPU's stream and by the host's clock (less the
  time the host spent waiting for the GPU inside the op), and counts the larger. The events
  alone read only kernel time when the GPU is behind the host (its queue hides the host's work
  inside the window); the host's clock alone would miss the kernels. The first call of each
  path in a class is not timed (Triton's compilation, cuBLAS's heuristics).
  A layer called twice at one size before either backward (one backward over several forwards)
  gets the two paths in turn, and a checkpointed recomputation takes the later one's path: with
  activation checkpointing, run one backward per forward while this timing is on.
- **No sync.** The events are read once complete (``Event.query``), as the sparsity probe is.
  A trial whose backward never ran (a forward whose result was dropped) is forgotten after
  ``STALE_CALLS`` later calls; a class that has made ``MAX_TRIALS`` trial calls without enough
  completed timings takes the static rule's path as its verdict.
- **Verdict.** After ``SAMPLES`` timings of each path the class takes the path with the lower
  median. It holds while the layer's measured mean of active units stays within ``DRIFT`` of the
  mean it was timed at, and for at most ``RETIME_CALLS`` calls of the class; then the class
  times again (training changes the layer's sparsity, and with it the sparse op's speed).
- **Where it does not run.** Inside a CUDA graph capture (the dense path is taken there),
  while ``torch.compile`` traces or runs the module's training op (which uses a verdict the layer
  already has, else the static rule), while autograd recomputes a checkpointed forward (which
  takes the path of the forward it recomputes), for forced ``train_kernels``, and with
  ``TIMED_CHOICE`` off (the default), where the static rule alone decides.

Both paths are exact: the choice changes only the time.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Optional

import torch

__all__ = ["TrainTimer", "TrainTrial", "TIMED_CHOICE", "TIMED_TOKENS", "SAMPLES", "DRIFT", "RETIME_CALLS", "STALE_CALLS",
           "MAX_TRIALS"]

PATHS = ("sparse", "dense")
# Whether layers time their paths at all (see the module's text). Off by default: on one H100
# machine (d 2048, f 5632, 4096 tokens, eager, each module warmed for 20 calls, then timed call by
# call in turn with dense PyTorch; benchmarks/results/training_timed_choice_h100.json) the timed
# layers settled on the sparse kernels at k 8 and k 29 with even rows and on the dense path for
# every skewed, heavy-tailed and denser layer. At k 8 that read 1.24x dense where the static floor
# reads 0.99x; at k 29 0.91x, although the forced sparse op read 1.25x and the dense path 0.93x in
# the same timing: what the trials timed then (the op's forward and backward on the GPU's stream
# alone) missed what made the module's sparse calls slower there. The trials now also count the
# host's time issuing the op where it is the longer, which that timing could not see; whether
# that accounts for k 29 has not been measured.
TIMED_CHOICE = False
# Calls of TIMED_TOKENS[0] <= M < TIMED_TOKENS[1] tokens are timed: around the static floor of
# 8192, from where the sparse op's GPU work may pay for its host work (4096 on the H100 machine
# above) to where it does on every machine measured (16384: 1.42x to 2.2x dense at k 29).
TIMED_TOKENS = (2048, 16384)
SAMPLES = 3
DRIFT = 0.1
RETIME_CALLS = 2000
STALE_CALLS = 8
# Trial calls of a class (warm-ups included) after which, still without SAMPLES completed timings
# of each path (backwards that never run, say), the class stops timing and takes the static
# rule's path as its verdict, so that a layer never alternates for good.
MAX_TRIALS = 4 * (SAMPLES + 1)


_host_wait_s = 0.0


def add_host_wait(seconds: float) -> None:
    """Count ``seconds`` the host spent waiting for the GPU inside a training op (the sparse
    backward waiting for its forward's counts): a trial's host time leaves them out, since the
    host was not working then, and a GPU that is behind would otherwise make them look like the
    op's own cost."""
    global _host_wait_s
    _host_wait_s += seconds


def host_waited() -> float:
    """Seconds counted by :func:`add_host_wait` in this process so far."""
    return _host_wait_s


class TrainTrial:
    """One timed training call: :meth:`forward_started` before the op, :meth:`forward_done`
    with its output ``y`` after it (which hooks the backward's events on ``y``'s autograd node,
    for the node's first backward only). Each of the four points also reads the host's clock."""

    def __init__(self, cls: "_SizeClass", path: str, tokens: int, event: Callable[[], object],
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.cls, self.path, self.tokens = cls, path, tokens
        self._event, self._clock = event, clock
        self.events: list = []
        self.host: list[float] = []  # the host's clock (seconds) at each event, less its waits so far
        self.age = 0
        self._handles: list = []

    def _record(self) -> None:
        e = self._event()
        e.record()
        self.events.append(e)
        self.host.append(self._clock() - host_waited())

    def _backward_started(self) -> None:
        if len(self.events) == 2:
            self._record()

    def _backward_done(self) -> None:
        if len(self.events) == 3:
            self._record()
            for h in self._handles:  # a second backward through the node (retain_graph) is not timed
                h.remove()

    def forward_started(self) -> None:
        self._record()

    def forward_done(self, y: torch.Tensor) -> None:
        self._record()
        node = y.grad_fn
        if node is None or len(self.events) != 2:  # nothing to time the backward by: not a trial
            if self in self.cls.pending:
                self.cls.pending.remove(self)
            return
        self._handles = [node.register_prehook(lambda grad_outputs: self._backward_started()),
                         node.register_hook(lambda grad_inputs, grad_outputs: self._backward_done())]

    def ms_per_token(self) -> Optional[float]:
        """The call's forward + backward milliseconds per token once all four events have
        completed, else None: the larger of the GPU stream's time (the events) and the host's
        time issuing the op's forward and backward. The GPU's alone would miss the host's work
        where the GPU is behind (its queue then hides that work inside the window, and the cost
        shows later as idle time); the host's alone would miss the kernels."""
        if len(self.events) != 4 or not self.events[3].query():
            return None
        f0, f1, b0, b1 = self.events
        gpu = f0.elapsed_time(f1) + b0.elapsed_time(b1)
        h0, h1, h2, h3 = self.host
        host = 1e3 * ((h1 - h0) + (h3 - h2))
        return max(gpu, host) / max(self.tokens, 1)


class _SizeClass:
    def __init__(self) -> None:
        self.times: dict[str, list[float]] = {p: [] for p in PATHS}
        self.pending: list[TrainTrial] = []
        self.warmed = {p: False for p in PATHS}
        self.verdict: Optional[str] = None
        self.verdict_mean = 0.0
        self.verdict_calls = 0
        self.trials = 0

    def collect(self) -> None:
        for trial in list(self.pending):
            t = trial.ms_per_token()
            if t is not None:
                self.times[trial.path].append(t)
                self.pending.remove(trial)
            else:
                trial.age += 1
                if trial.age > STALE_CALLS:
                    self.pending.remove(trial)

    def started(self, path: str) -> int:
        return len(self.times[path]) + sum(1 for t in self.pending if t.path == path)


class TrainTimer:
    """Per-layer trials and verdicts of the training path (see the module's text). ``event``
    makes a timing event (default ``torch.cuda.Event(enable_timing=True)``), ``clock`` reads the
    host's time in seconds (default ``time.perf_counter``); tests pass fakes."""

    def __init__(self, event: Optional[Callable[[], object]] = None, clock: Optional[Callable[[], float]] = None) -> None:
        self._classes: dict[int, _SizeClass] = {}
        self._event = event or (lambda: torch.cuda.Event(enable_timing=True))
        self._clock = clock or time.perf_counter

    def verdict(self, tokens: int) -> Optional[str]:
        """The path the size class of ``tokens`` settled on, or None."""
        cls = self._classes.get(int(tokens).bit_length())
        return None if cls is None else cls.verdict

    def choose(self, tokens: int, k_mean: float, static: str, trials: bool = True) -> tuple[str, Optional[TrainTrial]]:
        """``(path, trial)`` of a call of ``tokens`` tokens of a layer measured at ``k_mean``
        active units per token, the static rule saying ``static``: the class's verdict while it
        holds; else, with ``trials``, the next path to time and its :class:`TrainTrial` (None
        for an untimed warm-up call); without, ``static``."""
        cls = self._classes.setdefault(int(tokens).bit_length(), _SizeClass())
        if cls.verdict is not None:
            cls.verdict_calls += 1
            if abs(k_mean - cls.verdict_mean) <= DRIFT * cls.verdict_mean and cls.verdict_calls <= RETIME_CALLS:
                return cls.verdict, None
            if not trials:
                return cls.verdict, None
            self._classes[int(tokens).bit_length()] = cls = _SizeClass()  # time again
        cls.collect()
        if all(len(cls.times[p]) >= SAMPLES for p in PATHS):
            cls.verdict = min(PATHS, key=lambda p: statistics.median(cls.times[p]))
            cls.verdict_mean, cls.verdict_calls = k_mean, 0
            return cls.verdict, None
        if not trials:
            return static, None
        if cls.trials >= MAX_TRIALS:  # timings that never complete (see MAX_TRIALS): the static rule holds
            cls.verdict, cls.verdict_mean, cls.verdict_calls = static, k_mean, 0
            return static, None
        for path in (PATHS[cls.trials % 2], PATHS[(cls.trials + 1) % 2]):  # the paths in turn
            if not cls.warmed[path]:
                cls.warmed[path] = True
                cls.trials += 1
                return path, None
            if cls.started(path) < SAMPLES:
                cls.trials += 1
                return path, self._trial(cls, path, tokens)
        return static, None  # every timing still in flight

    def _trial(self, cls: _SizeClass, path: str, tokens: int) -> TrainTrial:
        trial = TrainTrial(cls, path, tokens, self._event, self._clock)
        cls.pending.append(trial)
        return trial

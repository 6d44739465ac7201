"""Which kernels a sparse FFN trains with: twell's dense path or its sparse training kernels.

A module in training (gradients wanted) on CUDA calls :meth:`TrainPath.choose` once per
forward. With ``train_kernels = "auto"`` (the default) the sparse kernels
(:mod:`twell.training.ops`) run while the call has at least ``MIN_SPARSE_TOKENS`` tokens, the
layer's measured mean of active units per token is at
most ``MAX_DENSITY * f`` (:func:`use_sparse`), at most ``HEAVY_SHARE_MAX`` of its tokens have more
active units than the ELL width that mean gives (:func:`choose_width`, about
twice the mean: the rows the sparse op computes dense), and ``AUTO_SPARSE`` is on (the
default), with that width. A layer with a heavy tail (a few rows with hundreds of units that raise
the mean) goes sparse too where its light rows are light enough and its heavy rows few enough, at
the width that costs least (:func:`light_rule_width`, ``PROBE_WIDTHS``). Else the dense path.
``"dense"`` and
``"sparse"`` force one. The dense path is :func:`twell.training.ops.dense_gated_ffn` (cuBLAS
products, the relu, product, L1 term and statistics in one fused pass each way) while
``FUSED_DENSE`` is on, as by default; else the module's plain PyTorch math. Calls below
``MIN_SPARSE_TOKENS`` are bound by the host: the sparse op's Python and launches cost more than
the GPU work it saves, on some hosts and not on others. Near that floor (``TIMED_TOKENS``) a
layer the rule would train sparse can time both paths on its own calls and keep the faster
(:mod:`twell.training.path_timing`; opt-in, ``TIMED_CHOICE``).

The measurement costs no host synchronisation: every ``PROBE_EVERY`` calls the layer copies the
mean and max of its row counts, the share of rows above the width, and the share and light units
at each probe width to pinned host memory without blocking, and a later call reads
them once their CUDA event has completed (the first calls run dense until then).

Inside a CUDA graph capture nothing is measured or read, and ``"auto"`` trains on the dense
path (the sparse ops refuse a capture: their backward sizes products from counts the forward
copies to the host); ``"sparse"`` forced raises there.

The choice changes only in a forward that runs outside a backward pass: the recomputation of
an activation-checkpointed forward (which runs inside the backward) takes the same path, with
the same width, as the forward it recomputes, so its saved tensors match.

Under ``torch.compile`` the choice cannot be made while tracing (it reads the measurement on the
host, and a choice fixed in the graph would make one graph per layer and per width): a traced
module calls the custom op ``twell::train_ffn_fwd`` with ``LAYER_CHOICE``, and the op makes the
same choice (:func:`call_choice`) at run time, for each call, and notes it
(:meth:`TrainPath.note_call`); its dense path there is always the fused dense op.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import path_timing
from .path_timing import TrainTimer, TrainTrial

__all__ = ["TrainPath", "use_sparse", "light_rule_width", "choose_path", "probe_values", "read_probe", "large_enough", "device_width", "TRAIN_MODES",
           "call_choice", "LAYER_CHOICE", "MAX_DENSITY", "HEAVY_SHARE_MAX", "MIN_SPARSE_TOKENS", "PROBE_WIDTHS", "HEAVY_FIXED", "HEAVY_COST"]

TRAIN_MODES = ("auto", "dense", "sparse")

# The width argument of the training custom op (twell.training.ops.train_ffn_fwd) that leaves the
# path and width to the layer, at run time (see the module's text).
LAYER_CHOICE = -1

# Break-even share of active units per token: the sparse kernels' forward + backward beat dense
# below it (H200, bf16, d 2048, f 5632, M 16384: at k = 29 of 5632 even / skewed / heavy 1.31x /
# 1.07x / 1.31x, at k = 56 0.87x / 0.78x / 1.35x; M 65536: k = 29 1.54x / 1.56x / 2.27x, k = 56
# 0.89x / 0.95x / 1.60x). 0.006 f = 34 units. Timed call by call in turn with dense
# (benchmarks/results/training_mlp_h200.json) the sparse op reads less at M 16384
# (k 29 even / skewed / heavy 1.20x / 1.01x / 1.44x), so there this rule keeps skewed k 29 sparse
# at 0.98x of dense; at M 65536 1.46x / 1.40x / 2.32x.
MAX_DENSITY = 0.006


# Whether "auto" may take the sparse kernels at all. On: in a whole training step of the 0.5b
# preset (8 x 2048 tokens, 29.5 active units per layer by construction, lr 0 so that it holds)
# the sparse kernels gave 1.14x dense's tokens/s (110.0k against 96.6k) with 0.92x the peak
# memory (benchmarks/results/training_mlp_h200.json). (At lr 3e-4 the constructed sparsity does
# not hold, most rows going heavier than the width: 0.86x.)
AUTO_SPARSE = True


# Whether a layer's dense training path runs twell.training.ops.dense_gated_ffn (True) or the
# module's PyTorch ops (relu, product, |h| and the active mask as separate passes over [M, f]).
# Measured in `twell bench training` (dense_path_ms and twell_ms against plain_module_ms, at
# M 16384: 4.70 against 6.43 ms, k 8 even).
FUSED_DENSE = True


# Fewest tokens per call (the module's input, all leading dimensions together) for which "auto"
# takes the sparse kernels. Below it a call is bound by the host: on the H200 machine here the
# sparse op's Python and its 63 CUDA launches took about 3.3 ms per forward + backward (an upper
# bound: its backward waits until the GPU has passed the forward's pack), dense PyTorch's 0.4 ms. In
# whole 0.5b training steps (k 29 constructed, lr 0) the sparse kernels read 0.77x to 0.96x of the
# fused dense path at 1 and 2 x 2048 tokens per call and 1.02x to 1.06x at 4 x 2048. At 8192 tokens,
# k 29, one layer read 1.00x and 1.35x in two runs: the floor sits near the break-even on this host.
# Measured at d 2048, f 5632 only; at larger d and f the GPU work per token grows and the break-even
# falls. With the op's bookkeeping in three Triton kernels (twell.kernels.train_index) the forced
# sparse op read 0.67x of dense PyTorch at 4096 tokens and 1.33x at 8192 (k 29, one layer): the
# floor stays. The host sets it: at 4096 tokens the forced sparse op read 1.14x to 1.19x dense on
# the H100 machine (k 8 and 29, even rows; benchmarks/results/training_mlp_h100.json) and 0.49x to
# 0.52x on the H200 machine the same day (k 29, even rows; 0.32x to 0.46x on skewed and
# heavy-tailed layers; timed call by call against dense PyTorch), where the fused dense path read
# 0.84x to 1.05x.
MIN_SPARSE_TOKENS = 8192


# Whether a module in training on CUDA keeps ``down_proj.weight`` as the transpose of a contiguous
# ``[f, d]`` matrix, the layout eval mode keeps for the inference kernels (see
# ``SparseGatedMLP.train``). The sparse training op then reads a unit's down column with no
# ``w_down^T`` copy in each forward and each backward (0.08 ms each at d 2048, f 5632, M 16384),
# and the training ops' ``[f, d]`` weight gradient is the parameter's own layout (no copy into
# it either). On the H200 (bf16, d 2048, f 5632, forward + backward) it is faster in every
# like-for-like timing: M 16384 k 8 2.06 against 2.14 ms, k 29 3.27 to 3.29 against 3.50 to 3.52,
# M 65536 k 29 12.85 to 12.93 against 13.06 to 13.25. (An apparent loss at k 8 in another timing was
# the timing order: the variant timed right after another sparse call read 0.9 ms slower,
# whichever layout it was.) Optimizer state made in the other layout follows the parameter's
# (twell.optim_layout).
KERNEL_LAYOUT = True


# Most share of a layer's tokens with more active units than the ELL width its mean gives (about
# twice the mean) for which "auto" still takes the sparse kernels. Those rows are the sparse
# op's heavy rows, computed dense: a Triton product each in the forward, their pre-activation
# recomputed by cuBLAS in the backward, plus the gathers, on top of the sparse bookkeeping that
# the dense path does not pay. The
# synthetic "heavy" layers of `twell bench training` have about 0.10 (k 29) and 0.12 (k 56).
HEAVY_SHARE_MAX = 0.3


# The light-row rule, for layers the mean rule above trains dense: a few very heavy rows raise the
# mean past MAX_DENSITY f while the ELL rows stay light (heavy-tailed layers). At each width W of
# PROBE_WIDTHS the probe measures the light rows' entries per token (light_W: units of rows with
# at most W, over all tokens) and the share of rows above W (share_W). On the H200 (bf16, d 2048,
# f 5632, M 16384, forward + backward) the sparse op's time over dense PyTorch's fitted
#     r = 0.25 + 0.0155 light_W + (0.06 + 1.2 share_W if any row is heavy)
# within 0.02 on 15 layers (even k 8 to 48; light k 29 with 1% to 20% of the rows at about 600
# units; synthetic heavy k 29 to 160 at W 32 to 128). Written in units of f, as MAX_DENSITY is:
# a layer goes sparse at the W of least cost light_W + HEAVY_FIXED f [share_W > 0] +
# HEAVY_COST f share_W when that cost is at most MAX_DENSITY f and share_W at most
# HEAVY_SHARE_MAX (at the bar the fit gives r 0.77, 1.3x). Measured there: heavy k 56 1.78x, heavy
# k 100 1.39x, light k 29 with 1% heavy rows 1.29x, each of which the mean rule trains dense
# (1.01x); the fit keeps light k 29 with 3% to 20% heavy rows (1.08x to 1.27x) and heavy k 160
# (share 0.39 at W 64, 1.17x) dense.
PROBE_WIDTHS = (16, 32, 64, 128)
HEAVY_FIXED = 0.0007
HEAVY_COST = 0.0137


def choose_width(active_mean: float, active_max: Optional[int] = None, f: Optional[int] = None) -> int:
    """ELL width W for a layer whose tokens have ``active_mean`` active units on average.

    Rule: the multiple of 16 at or above twice the mean, clamped to [16, 512]; narrower when
    ``active_max`` says every row fits in less (rounded up to 16); at most ``f``. Rows heavier
    than W are exact anyway (dense backup): W trades the ELL buffers' size (and the row kernels'
    padding) against how many rows go dense. At the paper's 29 of 5632 units: W = 64.

    >>> choose_width(29.0), choose_width(29.0, active_max=40), choose_width(3.0, f=10)
    (64, 48, 10)
    """
    if active_mean < 0 or active_mean != active_mean:
        raise ValueError(f"active_mean must be a number >= 0, got {active_mean}")
    w = min(max(16, 16 * -(-int(2 * active_mean + 0.999999) // 16)), 512)
    if active_max is not None:
        w = min(w, max(16, 16 * -(-int(active_max) // 16)))
    if f is not None:
        w = min(w, max(1, int(f)))
    return w


def device_width(mean: torch.Tensor, f: int) -> torch.Tensor:
    """:func:`choose_width` of ``mean`` (a float32 scalar on the device; no
    ``active_max``), computed on the device: the multiple of 16 at or above twice the mean,
    clamped to [16, 512], at most f."""
    t = torch.floor(2 * mean.double() + 0.999999)  # in float64, as Python computes it (fp32 rounds 48.999999 up)
    w = 16 * torch.ceil(t / 16)
    return torch.clamp(w, 16, 512).clamp(max=float(max(f, 1)))


def use_sparse(active_mean: float, f: int, max_density: Optional[float] = None, heavy_share: float = 0.0) -> bool:
    """Whether ``"auto"`` trains a layer with ``active_mean`` active units per token (of f), a
    share ``heavy_share`` of its tokens above the width of that mean, sparse."""
    return active_mean <= (MAX_DENSITY if max_density is None else max_density) * f and heavy_share <= HEAVY_SHARE_MAX


def light_rule_width(shares, lights, f: int, max_density: Optional[float] = None) -> Optional[int]:
    """The ELL width at which ``"auto"`` trains a layer sparse by the light-row rule (see
    ``PROBE_WIDTHS``), or None (the rule says dense). ``shares``, ``lights``: the share of tokens
    above each width of ``PROBE_WIDTHS`` and the light rows' units per token at it."""
    limit = (MAX_DENSITY if max_density is None else max_density) * f
    best = None
    for w, share, light in zip(PROBE_WIDTHS, shares, lights):
        if w > f or share > HEAVY_SHARE_MAX:
            continue
        cost = light + (HEAVY_FIXED * f if share > 0 else 0.0) + HEAVY_COST * f * share
        if cost <= limit and (best is None or cost < best[0]):
            best = (cost, w)
    return None if best is None else best[1]


def choose_path(mean: float, heavy_share: float, shares, lights, f: int, max_density: Optional[float] = None) -> tuple[str, int]:
    """``(path, width)`` that ``"auto"`` takes for a layer measured so (before the token floor and
    ``AUTO_SPARSE``): the mean rule (:func:`use_sparse`) at the width of the mean, else the
    light-row rule (:func:`light_rule_width`), else dense at the width of the mean."""

    width = choose_width(mean, None, f)
    if use_sparse(mean, f, max_density, heavy_share):
        return "sparse", width
    w = light_rule_width(shares, lights, f, max_density)
    return ("sparse", w) if w is not None else ("dense", width)


def probe_values(row_counts: torch.Tensor, f: int) -> torch.Tensor:
    """What a layer's probe measures, as one float32 tensor on ``row_counts``' device (no host
    sync): the mean and max of ``row_counts [M]`` (active units per token, of ``f``), the share of
    rows above the ELL width of that mean (:func:`device_width`), then at each width of
    ``PROBE_WIDTHS`` the share of rows above it, then the light rows' units per token at each
    (:func:`read_probe` splits them)."""
    rc = row_counts.float()
    mean = rc.mean()
    # compares with Python scalars: a widths tensor made on the device would be a copy from
    # pageable memory, which waits for the queued work (measured: 0.9 s behind 40 matmuls)
    light = torch.stack([rc <= w for w in PROBE_WIDTHS])  # [widths, M]
    return torch.cat([torch.stack([mean, rc.max(), (rc > device_width(mean, f)).float().mean()]),
                      1 - light.float().mean(1), (rc * light).mean(1)])


def read_probe(values) -> tuple:
    """``(mean, max, heavy_share, shares, lights)`` from :func:`probe_values` read on the host (a
    list). Three values alone (an older probe): shares and lights come out empty, and the
    light-row rule is skipped."""
    values = [float(v) for v in values]
    n = len(PROBE_WIDTHS)
    return values[0], values[1], values[2], values[3:3 + n], values[3 + n:3 + 2 * n]


def large_enough(tokens: Optional[int]) -> bool:
    """Whether a call of ``tokens`` tokens (None: unknown) may take the sparse kernels under
    ``"auto"``: at least ``MIN_SPARSE_TOKENS``."""
    return tokens is None or tokens >= MIN_SPARSE_TOKENS


def call_choice(module, tokens: int, is_cuda: bool, timed: bool = True) -> tuple[str, int]:
    """``(path, width)`` of one training call of ``module`` (a twell FFN) on ``tokens`` tokens:
    its :meth:`TrainPath.choose` for its ``train_kernels`` and ``train_max_density``. Inside a
    CUDA graph capture "auto" takes the dense path (the sparse ops cannot be captured, see
    :mod:`twell.training.ops`; the dense op can). ``timed``: the call may be one of the layer's
    timing trials (:mod:`twell.training.path_timing`; the caller then runs
    ``module._twell_train.trial`` around it)."""
    capturing = is_cuda and torch.cuda.is_current_stream_capturing()
    mode = module.train_kernels
    path, width = module._twell_train.choose(mode, module.intermediate_size, module.train_max_density, capturing, tokens,
                                             timed=timed and is_cuda)
    if capturing and mode == "auto":
        path = "dense"
    return path, width


def _in_backward() -> bool:
    """True inside autograd's backward (where checkpointed forwards are recomputed)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


class TrainPath:
    """Per-layer state of the training path choice (see the module's text).

    Attributes:
        k_mean, k_max: the last measured mean and max of active units per token (None before).
        heavy_share: the last measured share of tokens above the width of the mean.
        path, width: the current choice (``"dense"`` or ``"sparse"``) and ELL width.
        last_path: the path of the last training call.
    """

    PROBE_EVERY = 16

    def __init__(self) -> None:
        self.k_mean: Optional[float] = None
        self.k_max: Optional[int] = None
        self.heavy_share: Optional[float] = None
        self.path = "dense"
        self.width = 16
        self.last_path: Optional[str] = None
        self._calls = 0
        self._host: Optional[torch.Tensor] = None
        self._event = None
        self.timer: Optional[TrainTimer] = None  # made at the first timed call
        self.trial: Optional[TrainTrial] = None  # this call's timing, if it is one
        # the last timed "auto" forward's path per call size, which a recomputation of it takes
        self._timed_paths: dict = {}

    def choose(self, mode: str, f: int, max_density: Optional[float] = None, capturing: bool = False,
               tokens: Optional[int] = None, timed: bool = False) -> tuple[str, int]:
        """``(path, width)`` for this call; ``mode`` one of :data:`TRAIN_MODES`; ``capturing``:
        inside a CUDA graph capture (no measurement is read there); ``tokens``: the call's
        tokens (None: no floor), "auto" trains dense below ``MIN_SPARSE_TOKENS``, except where
        the layer's own timing (``timed``, :mod:`twell.training.path_timing`) says otherwise.
        The measurement is read whatever the size of the call."""
        if mode not in TRAIN_MODES:
            raise ValueError(f"train_kernels must be one of {TRAIN_MODES}, got {mode!r}")
        self.trial = None
        in_backward = _in_backward()
        if not in_backward and not capturing:
            self._calls += 1
            if self._event is not None and self._event.query():
                mean, top, share, shares, lights = read_probe(self._host.tolist())
                self.k_mean, self.k_max, self.heavy_share = mean, int(top), share
                self._event = None
                path, self.width = choose_path(mean, share, shares, lights, f, max_density)
                self.path = "sparse" if AUTO_SPARSE and path == "sparse" else "dense"
        if mode == "dense":
            return "dense", self.width
        if mode == "sparse":
            return "sparse", self.width if self.k_mean is not None else 64
        path = self.path if large_enough(tokens) else "dense"
        if in_backward:  # a checkpointed forward's recomputation: the path of the forward it recomputes
            return self._timed_paths.get(tokens, path), self.width
        if (self.path == "sparse" and not capturing and tokens is not None and self.k_mean is not None
                and FUSED_DENSE and path_timing.TIMED_CHOICE and path_timing.TIMED_TOKENS[0] <= tokens < path_timing.TIMED_TOKENS[1]):
            if self.timer is None:
                self.timer = TrainTimer()
            path, self.trial = self.timer.choose(tokens, self.k_mean, path, trials=timed)
        if self.timer is not None and not capturing:
            # every forward of a layer that has timed its paths (timed or not: its measured path
            # may have changed since): the path its recomputation takes
            if len(self._timed_paths) > 64:
                self._timed_paths.clear()
            self._timed_paths[tokens] = path
        return path, self.width

    def note_call(self, path: str, row_counts: torch.Tensor, f: int) -> None:
        """After a call on the training ops: ``path`` ("sparse" or "dense") becomes the last path,
        and on probe calls ``row_counts [M]`` (of ``f`` units) is published (:meth:`publish`;
        not inside a CUDA graph capture)."""
        if self.want_probe() and not (row_counts.is_cuda and torch.cuda.is_current_stream_capturing()):
            self.publish(row_counts, f)
        self.last_path = path

    def want_probe(self) -> bool:
        """Whether this call should publish its row counts (every ``PROBE_EVERY`` calls, one in flight)."""
        return self._event is None and (self.k_mean is None or self._calls % self.PROBE_EVERY == 1)

    def publish(self, row_counts: torch.Tensor, f: int) -> None:
        """Copy the mean and max of ``row_counts [M]`` (active units per token, of ``f``), the
        share of rows above the ELL width of that mean (:func:`device_width`), and at each width
        of ``PROBE_WIDTHS`` the share of rows above it and the light rows' units per token, to
        pinned host memory without blocking."""
        if not row_counts.is_cuda or row_counts.numel() == 0:
            return
        with torch.no_grad():
            values = probe_values(row_counts, f)
            if self._host is None or self._host.numel() != values.numel():
                self._host = torch.empty(values.numel(), dtype=torch.float32, pin_memory=True)
            with torch.cuda.device(row_counts.device):
                self._host.copy_(values, non_blocking=True)
                self._event = torch.cuda.Event()
                self._event.record(torch.cuda.current_stream(row_counts.device))

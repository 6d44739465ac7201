"""Per-layer choice of the inference path of twell's FFN modules, and the paths themselves.

Three paths compute the same function (up to rounding) for every input:

``"decode"`` (small batches, ``M <= DECODE_MAX_M`` tokens per call)
    The gate read whole, then the up and down rows of the batch's active units only, in one
    fused kernel (:func:`twell.kernels.decode_fused.ffn_decode_fused`), or from ``SPLIT_MIN_M``
    to 64 tokens in three launches that list the batch's fires and do up and down one fire at a
    time (:mod:`twell.kernels.decode_split`, while the expected number of fires is within
    ``SPLIT_MAX_FIRES``, or the width's ``SPLIT_MAX_FIRES_BY_D``); a forced call of more than 64
    tokens takes three launches, :func:`twell.kernels.decode.ffn_decode`. It never reads more weight bytes than dense.
    ``LayerState.last_decode_kernels`` says which kernels the last decode call ran.
``"prefill"`` (large batches)
    cuBLAS gate, one Triton pass packing ``relu`` of it into TwELL, the up/down kernels
    (:func:`twell.kernels.ffn_from_twell`: fused, or up and down in two launches from
    :func:`twell.kernels.updown.split_min_m` tokens, which depends on the width); rows with an overflowed tile or more than
    ``twell.kernels.updown.DENSE_ROW_MIN`` active units are computed whole on tensor cores.
``"dense"``
    cuBLAS gate and up, ``relu(gate) * up`` fused into one Triton pass, cuBLAS down.

How a layer chooses (``module.kernel_mode = "auto"``, the default):

- ``M <= DECODE_MAX_M`` inside a CUDA graph capture: decode, if the layer's measured sparsity
  says that the batch's expected fires (tokens times the mean, and times the root mean square,
  of the active units per token) are within ``SPLIT_MAX_FIRES`` (``SPLIT_MAX_FIRES_BY_D`` for
  wider layers; from ``SPLIT_MIN_M`` tokens, and with its buffers made) or that the share of
  units active for some token of the batch is at most ``FUSED_MAX_UNION``
  (``FUSED_WIDE_MAX_UNION`` above ``FUSED_WIDE_M`` tokens, or the width's ``FUSED_WIDE_M_BY_D``;
  without a measurement yet: only for ``M <= DECODE_BLIND_M``). Outside a
  capture small batches run dense: there the host's time to issue a call (each launch about
  14 us on the H200 machine here) decides, not the GPU's, and dense, whose three cuBLAS calls
  and two element-wise ops need no checks or Triton launcher, issues fastest. But an eager
  call (:meth:`LayerState.call`) of up to ``twell.inference.eager_graphs.MAX_M`` tokens is replayed from
  the layer's own CUDA graph from the third call of its size (:mod:`twell.inference.eager_graphs`), and
  that graph holds the path chosen as inside a capture.
- ``M >= PREFILL_MIN_M`` inside a capture (``M >= EAGER_PREFILL_MIN_M`` outside one, where
  the host's time to issue the path counts) and the layer's measured sparsity makes the prefill
  kernels pay (see :meth:`LayerState.cost`): prefill. With ``TIMED_CHOICE`` on (opt-in), an
  eager call whose estimate lies near the limit takes the path the layer's own timings of both
  found faster for calls of its size (:mod:`twell.inference.path_timing`).
- Otherwise dense.

The sparsity estimate never costs a host synchronisation: every ``PROBE_EVERY`` calls (every
``PROBE_EVERY_SMALL`` calls of fewer than ``PREFILL_MIN_M`` tokens, whose eager path is dense
whatever the estimate and whose host time is what a caller waits for; and at the first small call
of a batch size larger than any measured before) a layer copies a few statistics of the call (row counts on the dense and prefill paths, and on
dense calls of at most ``FUSED_MAX_M`` tokens the share of units active in the batch) to pinned
host memory without blocking, and a later call reads them once their CUDA
event has completed.

Inside a CUDA graph capture (``torch.cuda.graph``, ``torch.compile(mode="reduce-overhead")``)
nothing is probed or polled: each layer's path is the one its state gives at capture time
(decode up to ``DECODE_MAX_M`` tokens where the union estimate allows, see above; above it, prefill only if an estimate taken in eager
calls before the capture says so), and a replay runs that path whatever the data.

``kernel_mode`` may force a path: ``"dense"``, ``"decode"``, ``"prefill"``, or ``"twell"``
(decode or prefill by ``M``, whatever the sparsity).

The modules call :meth:`LayerState.run` directly in eager mode. Under ``torch.compile`` they
call the custom op ``torch.ops.twell.ffn_infer`` (registered in :mod:`twell.inference.custom_op`), whose
implementation finds the layer from its gate weight (:func:`layer_of_weight`) and runs the same
:meth:`LayerState.run`, so the choice stays per call there too.
"""

from __future__ import annotations

import functools
import itertools
import warnings
import weakref
from typing import Optional

import torch
import torch.nn.functional as F

from . import eager_graphs
from ..checks import triton_interpreting, width_key

__all__ = ["LayerState", "layer_state", "layer_of_weight", "DECODE_MAX_M", "DECODE_BLIND_M", "FUSED_MAX_UNION",
           "FUSED_WIDE_M", "FUSED_WIDE_MAX_UNION", "PREFILL_MIN_M", "EAGER_PREFILL_MIN_M", "DECODE_SPLIT",
           "SHARE_DECODE_BUFFERS", "SPLIT_MIN_M", "SPLIT_MAX_FIRES", "SPLIT_MAX_FIRES_BY_D", "SPLIT_MAX_ROW_FIRES",
           "FUSED_WIDE_M_BY_D", "MODES"]

MODES = ("auto", "dense", "twell", "decode", "prefill")


def _for_width(table: dict, d: Optional[int], default):
    """``table``'s entry for model width ``d`` (keyed by :func:`width_key`), else ``default``
    (also for ``d`` None: a width not known)."""
    return default if d is None else table.get(width_key(d), default)

# At and below this many tokens per call the fused decode kernel may run
# (twell.kernels.decode_fused, FUSED_MAX_M = DECODE_MAX_M), while the expected share of units
# active for some token of the batch is at most FUSED_MAX_UNION (FUSED_WIDE_MAX_UNION above
# FUSED_WIDE_M tokens, where the kernel's 64-row tiles leave a thin margin); with no estimate
# yet, only up to DECODE_BLIND_M tokens. In CUDA graphs on the H200 (d 2048, f 5632, bf16): 1.37x to
# 1.43x dense at 6 to 16 tokens for shares up to 0.15 (1.49x at 4 tokens with a share of about 0.18:
# k 280), 1.09x to 1.17x at 24 and 32 tokens for shares up to 0.27; at 48 and 64 tokens 1.06x to
# 1.08x for shares up to 0.09, but 0.94x to 1.08x for shares of 0.11 to 0.28 from run to run. (At 17
# to 32 tokens and shares below 0.05 the three-launch path was 1 to 2 us faster still; not worth a
# second rule.)
DECODE_MAX_M = 64
DECODE_BLIND_M = 4
FUSED_MAX_UNION = 0.25
FUSED_WIDE_M = 32
FUSED_WIDE_MAX_UNION = 0.10
# Wider layers, by width_key(d): FUSED_WIDE_M there. At d 4096, f 11008 (H200, bf16, the module
# in graphs) the fused kernel read 1.14x and 1.21x at 16 tokens with a
# share of 0.34, but 0.85x at 32 tokens with 0.21 (and 0.67x to 0.79x at 32 and 64 tokens with
# larger shares).
FUSED_WIDE_M_BY_D: dict[int, int] = {4096: 16}
# Whether the decode kernels keep a zeroed fp32 accumulator between calls ([64, d] with the split
# kernels, [16, d] without: 512 or 128 KB at d 2048; calls of more tokens make a fresh one), saving
# a memset launch per call (the memset and the cast measured 5.9 us together in a graph on the
# H200, of a 25 us call at M = 1). Every call leaves it zeroed (and the split kernels' list empty),
# so one set of these buffers serves every layer of a device (per d; the list also per f and
# dtype: _shared_scratch): calls on one stream run in order. One per layer had cost the 2b shape's
# 38 layers 22.5 MiB, which put its decoding peak above dense's. So calls that
# take the decode kernels from two streams at once (two CUDA graphs replayed concurrently on one
# device, two models served from threads with their own streams) would mix their sums: set
# SHARE_DECODE_BUFFERS = False before their first calls to give each layer its own set again.
# DECODE_SCRATCH False (set it before a layer's first call): nothing is kept between calls;
# every decode call takes its buffers from PyTorch's allocator (inside a CUDA graph, from the
# graph's pool, reused after the call) and zero-fills them, one more launch per call. The shared
# set (560 KiB at d 2048: a 512 KiB accumulator and a 48 KiB list) is what puts a sparsified
# model's decoding peak above dense's, whose MLPs keep nothing; calls from several streams at
# once are then safe too.
DECODE_SCRATCH = True
SHARE_DECODE_BUFFERS = True
# Hot units (twell.kernels.hot_units): on the prefill path, eager calls of at least HOT_MIN_M
# tokens compute the layer's most frequently active units as one dense block, the rest through
# TwELL. Each probe counts how often every unit fires over HOT_SAMPLE rows of the call's gate;
# the units firing for at least HOT_MIN_RATE of them (the most frequent HOT_MAX_UNITS, rounded
# down to a multiple of HOT_UNIT_STEP) become the layer's hot set once the count reaches the
# host, if there are at least HOT_MIN_UNITS. A
# dense column costs about 4 d flops per token, an entry about 1 ns of gathers; HOT_UNIT_COST
# is a hot unit's time in active units per token (H100, d 2048, f 5632, 131072 tokens: 256 hot
# units took 0.9 ms, about 7 units' gathers). Not inside CUDA graph captures: a replay would
# keep the set it was captured with while the layer's set moves on. HOT_MIN_M: the hot block's
# launches cost the host about 0.1 ms (measured with seven launches; the block takes four); at 16384
# tokens, where an eager call's host time is close to its GPU time, it read +10% on one H100
# machine and -10% on another (8192: -20%).
HOT_UNITS = True
HOT_MIN_M = 65536
# The fused up/down in one launch (ffn_from_twell(one_launch=True)) where the layer's last probe
# found every row short (no row computed whole, no overflowed tile: LayerState.rows_short): the
# two-pass path's listing and its launches with nothing to do are skipped. Still exact for any
# row; a long one is then the launch's serial tail until the next probe sees it.
PREFILL_ONE_LAUNCH = True
HOT_SAMPLE = 2048
HOT_MIN_RATE = 0.012
HOT_MAX_UNITS = 512
HOT_MIN_UNITS = 64
HOT_UNIT_STEP = 64
HOT_UNIT_COST = 0.03
# The split decode kernels (twell.kernels.decode_split) instead of the fused kernel, from
# SPLIT_MIN_M to their SPLIT_MAX_M (64) tokens while the batch's expected fires (its tokens times
# the root mean square of the layer's active units per token) are at most SPLIT_MAX_FIRES. In CUDA
# graphs on the H200 (bf16, d 2048, f 5632, L2 flushed) they took about 17 to 21 us plus 4 to 5 ns
# per fire: 18 to 20 us at 8 and 16 tokens for k 8 to 56 (the fused kernel 28.5 to 29.5, dense 40 to
# 41), 35.4 us at 64 tokens and k 56 (3584 fires; dense 42.6); at one token 17.8 against the fused
# CUDA-core kernel's 15.1. At 4096 fires the time is about 0.9 of dense's. Heavy tokens cost more:
# at 64 tokens with a few tokens of about a thousand active units (3649 fires, mean 57 per token)
# they took 51.4 us against dense's 43.0 (fires adding into one accumulator row queue there), so the
# rule counts fires by the root mean square of the active units per token when a probe measured it.
# From how many tokens (the module in graphs, k 8 to 56, two rounds): at 2 tokens 19.0 to 19.6 us
# against the fused kernel's 16.9 to 17.8, at 3 tokens 19.1 to 19.8 against 19.7 to 20.7, at 4
# tokens 19.1 to 20.0 against 21.7 to 22.8.
# DECODE_SPLIT False: the fused kernel everywhere.
DECODE_SPLIT = True
SPLIT_MIN_M = 3
SPLIT_MAX_FIRES = 4096
# Wider layers, by width_key(d): (most expected fires counted by the mean active units per
# token, most counted by their root mean square). d 2048 takes SPLIT_MAX_FIRES for both. At d 4096,
# f 11008 (H200, bf16, module in graphs) the split kernels took about 29 us plus 10 ns a fire
# against dense's 82 to 87: even batches at 1.95x / 1.48x / 1.08x for 1280 / 2560 / 5120 fires
# (break-even near 5800), and 1.17x at 16 tokens of k 280 (4480); heavy batches with a
# root-mean-square count of 4862 to 6748 at 1.37x to 1.74x (where 4096 would send 64 tokens of k 29
# to dense, 1.02x, and 32 tokens of k 80 to the fused kernel, 0.85x), but 0.94x and 1.01x at 10738
# and 14567.
SPLIT_MAX_FIRES_BY_D: dict[int, tuple[int, int]] = {4096: (5400, 7500)}
# ...and while a token's active units (their root mean square over the batch's tokens) are at
# most SPLIT_MAX_ROW_FIRES: a guard against a few tokens of thousands of fires each, whose adds
# would queue on their accumulator rows (not measured at this size; the heavy batches measured,
# with tokens of up to about a thousand, are within it).
SPLIT_MAX_ROW_FIRES = 1024
# Below this many tokens per call, "auto" never takes the prefill kernels: their fixed costs
# (four launches, the pack's scratch) exceed what sparsity saves.
PREFILL_MIN_M = 4096
# The same outside CUDA graphs, where the host must also issue the path's cuBLAS call, three
# Triton launches and their checks: 0.4 to 0.5 ms per call on the H200 machine here in its slow
# phases, as long as the kernels' GPU time at 4096 tokens (0.3 ms at k = 29), so that eager calls
# there read 0.85x to 0.93x dense even at k = 8 while in graphs the same kernels gave 1.22x to
# 1.81x at k <= 29.
EAGER_PREFILL_MIN_M = 8192
# Opt-in: near the prefill limit (eager calls of at least EAGER_PREFILL_MIN_M tokens, default
# kernel_max_density), each layer times the prefill kernels and dense on its own calls and takes
# the faster (twell.inference.path_timing). Off by default until measured on a GPU: the break-even the
# static limit encodes was measured on the H200 only.
TIMED_CHOICE = False



# The decode kernels' buffers by (kind, device, shape...): held by the layers that use them, and
# gone with the last of them
_SCRATCH: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()


def _shared_scratch(key: tuple, make):
    """The decode buffers under ``key``, made by ``make()`` if no layer holds them now."""
    scratch = _SCRATCH.get(key)
    if scratch is None:
        scratch = _SCRATCH[key] = make()
    return scratch


def _rate_of_union(share: float, m: float) -> float:
    """The per-token firing rate p with ``1 - (1 - p)^m = share`` (units firing independently)."""
    share = min(max(share, 0.0), 1.0)
    return 1.0 - (1.0 - share) ** (1.0 / max(m, 1.0)) if share < 1.0 else 1.0


@functools.cache  # asked on every small call: an import statement is host time there
def _fused_max_m() -> int:
    from ..kernels.decode_fused import FUSED_MAX_M

    return FUSED_MAX_M


@functools.cache
def _split_max_m() -> int:
    from ..kernels.decode_split import SPLIT_MAX_M

    return SPLIT_MAX_M


@functools.cache
def _split_max_f() -> int:
    from ..kernels.decode_split import _MAX_F

    return _MAX_F


_LAYERS: "weakref.WeakValueDictionary[int, LayerState]" = weakref.WeakValueDictionary()
_IDS = itertools.count()


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


_WARNED_DISTRIBUTED_LAYOUT = False


def _warn_distributed_layout() -> None:
    """Once per process: an inference call that would take a kernel path runs dense because,
    under a process group, nothing lays the weights out for the kernels (FSDP and DDP own
    their parameters' layout)."""
    global _WARNED_DISTRIBUTED_LAYOUT
    if not _WARNED_DISTRIBUTED_LAYOUT:
        _WARNED_DISTRIBUTED_LAYOUT = True
        warnings.warn(
            "twell: a torch.distributed process group is up and down_proj.weight is in the nn.Linear "
            "layout, so inference runs dense. Expected for models wrapped by FSDP or DDP; for per-rank "
            "inference call twell.use_kernel_layout(model) after model.eval().", stacklevel=3)


def row_stats(per_row: torch.Tensor, over_per_token: Optional[torch.Tensor] = None,
              dense_min: Optional[float] = None) -> torch.Tensor:
    """``[8]`` float32: mean, rms and max of ``per_row`` (``[n]`` float32 active units per row),
    then ``over_per_token`` (or the rms again as a placeholder when None); then the share of rows
    with more than ``dense_min`` active units (default: the up/down kernels' ``DENSE_ROW_MIN``,
    rows they compute whole on tensor cores) and the mean, rms and max of ``per_row`` with those
    rows counted as 0 (what the first up/down launch does). About a dozen launches: a probe runs
    on the caller's time."""
    if dense_min is None:
        from ..kernels.updown import DENSE_ROW_MIN as dense_min
    std, mean = torch.std_mean(per_row, correction=0)
    heavy = per_row > dense_min
    light = per_row.masked_fill(heavy, 0.0)
    light_std, light_mean = torch.std_mean(light, correction=0)
    return torch.stack([mean, torch.hypot(std, mean), per_row.max(),
                        torch.hypot(std, mean) if over_per_token is None else over_per_token.to(mean.dtype),
                        heavy.to(mean.dtype).mean(), light_mean, torch.hypot(light_std, light_mean), light.max()])


_BY_WEIGHT: "dict[int, weakref.ref[LayerState]]" = {}


def layer_of_weight(w_first: torch.Tensor) -> Optional["LayerState"]:
    """The :class:`LayerState` of the live module whose first projection's weight (the gate, or
    up for the non-gated MLP) is ``w_first`` (by storage address), or None.

    This is how the custom op finds its layer: a per-layer integer argument would be a constant
    that ``torch.compile`` specialises on, so compiling each decoder layer separately (regional
    compilation) would compile once per layer and fall back to eager past the recompile limit.
    Weights are graph inputs, so all layers share one compiled graph. The map is rebuilt when an
    address is not found (first call, weights moved or replaced)."""
    ptr = w_first.data_ptr()
    ref = _BY_WEIGHT.get(ptr)
    state = ref() if ref is not None else None
    if state is None or state.first_weight_ptr() != ptr:
        _BY_WEIGHT.clear()
        for other in list(_LAYERS.values()):
            p = other.first_weight_ptr()
            if p is not None:
                _BY_WEIGHT[p] = weakref.ref(other)
        ref = _BY_WEIGHT.get(ptr)
        state = ref() if ref is not None else None
    return state


def layer_state(key: int) -> "LayerState":
    """The :class:`LayerState` registered under ``key`` (the custom op finds its layer so)."""
    try:
        return _LAYERS[key]
    except KeyError:
        raise RuntimeError(f"twell: no layer is registered under key {key}; was its module deleted?") from None


class LayerState:
    """Per-layer state of the inference path: the sparsity estimate and the overflow counters.

    The prefill kernels take a call of ``M`` tokens while ``cost(M) <= limit(f, d)`` (see below;
    5% more once on them: ``HYSTERESIS``), in active units per token::

        cost = mean + 0.1 * (rms - mean) + 850 * max / M + 150 * dense rows per token

    where mean, rms and max are taken over the rows the first up/down launch processes (rows
    with more than ``twell.kernels.updown.DENSE_ROW_MIN`` active units count as 0: they are
    computed whole on tensor cores, priced at :meth:`dense_row_cost`), and dense rows
    per token is the larger of their share and the overflowed tiles per token (whose rows are
    computed whole too; a row that overflows with at most DENSE_ROW_MIN units, possible where a
    tile has fewer slots, is then counted in both). That
    launch runs one program per token, so its time is at least the longest row's (about 1 us
    per entry on the H200, against about 1.2 ns per entry of throughput: the ``850 * max / M``
    term), and a heavy-tailed layer loses more than its mean says (the rms term). The threshold
    and the weights come from the H200 benchmark (break-even at 64 to 70 active units per token
    on evenly spread units).

    The default limit is the lower of ``DEFAULT_MAX_DENSITY * f`` and a cap in units,
    ``MAX_UNITS_BY_D`` for the model widths measured, else ``DEFAULT_MAX_UNITS`` (:meth:`limit`).
    Break-even fell at 63 to 74 units at d 2048, f 5632 (H200 and H100), and at d 4096, f 11008
    at 101 to 109 units on the H100 with the up/down on the split path there (51 to 97 with the
    fused kernel's shape); the
    share alone would allow 121 there, where the kernels ran 0.91x to 0.96x dense at 112 units.
    Widths are padded to a power of two, so d 2049 to 4096 take d 4096's cap. A layer's
    ``kernel_max_density`` replaces both.
    """

    DEFAULT_MAX_DENSITY = 0.011
    DEFAULT_MAX_UNITS = 62.0
    # d 4096 (f 11008), H100, kernels against dense at 96 / 112 units: 1.09 / 0.96x (16384
    # tokens), 1.10 / 0.96x (65536); with HYSTERESIS a layer on the kernels stays to 100.8.
    MAX_UNITS_BY_D: dict[int, float] = {4096: 96.0}
    RMS_WEIGHT = 0.1
    TAIL_WEIGHT = 850.0
    # A row computed whole costs about 2.4 times the default limit: 150 units at d 2048, f 5632
    # (limit 62; H200), and at d 4096, f 11008 (limit 96) 212 to 240 on the H100, where heavy rows
    # at 314 active units per token on average (35% of the rows computed whole) ran 0.83x dense at
    # 4096 tokens and 0.96x at 16384 with 150. A whole row's time and the
    # break-even both grow with f (d cancels against an entry's), so the ratio carries over.
    DENSE_ROW_LIMITS = 2.42
    HYSTERESIS = 1.05
    PROBE_EVERY = 8  # calls between two estimates (each costs a few small launches)
    PROBE_EVERY_SMALL = 64  # the same for calls of fewer than PREFILL_MIN_M tokens
    SMALL_M = 1024  # up to here the dense path multiplies with PyTorch ops, above with relu_mul_
    # The same inside a CUDA graph capture, where issuing time does not count: in graphs on the
    # H200 (bf16, d 2048, f 5632) the whole dense branch
    # took 39.7 to 40.1 us with relu_mul_ against 41.7 to 42.0 with the two PyTorch ops at 64
    # tokens, 46.4 to 46.5 against 48.4 to 49.0 at 256, 111 to 112 against 116 to 117 at 1024
    # (PyTorch's relu(g) * u MLP: 41.8 to 42.1, 48.6 to 49.2, 116 to 117). Below 64 not measured.
    GRAPH_SMALL_M = 63

    def __init__(self, module) -> None:
        self.key = next(_IDS)
        _LAYERS[self.key] = self
        self._module = weakref.ref(module)
        self.estimate: Optional[tuple[float, float]] = None  # prefill: (cost without the tail, max row)
        self.k_est: Optional[float] = None  # mean active units per token, from the last probe
        # their root mean square over the tokens: the split decode kernels' rule counts fires by
        # it, since a heavy token's fires all add into one row of the accumulator and queue there
        self.k_rms: Optional[float] = None
        # the last probe saw no row longer than the up/down's DENSE_ROW_MIN and no overflowed
        # tile: prefill calls then run the fused up/down in one launch (PREFILL_ONE_LAUNCH)
        self.rows_short = False
        # per-token firing rate that reproduces the measured share of units active for some token
        # of a small batch (skewed layers: below k_est / f); decode's choice uses it first
        self.union_rate: Optional[float] = None
        self._union_fit_m = 0  # tokens of the batch union_rate was fitted to
        self._union_m = 0  # tokens of the small dense call whose probe is in flight (0: none)
        self.counters = None  # OverflowCounters of the prefill path, accumulated over calls
        self.last_path: Optional[str] = None
        self._host: Optional[torch.Tensor] = None
        self._event = None
        self._no_overflow = False
        self._calls = 0
        self._on_kernels = False
        # the fused decode kernel's accumulator (twell.kernels.decode_fused.DecodeScratch): one
        # launch fewer per call (no memset); made at the first small CUDA call outside a capture
        self.scratch = None
        # the split decode kernels' buffers (twell.kernels.decode_split.SplitScratch), made with
        # the accumulator when DECODE_SPLIT is on (see _make_scratch)
        self.split_scratch = None
        # which decode kernels the last decode call ran: "split", "fused" (the fused kernel or
        # its CUDA-core variant) or "three-launch" (forced calls of more than 64 tokens)
        self.last_decode_kernels: Optional[str] = None
        # small eager calls replayed from this layer's CUDA graphs (twell.inference.eager_graphs)
        self.graphs = eager_graphs.EagerGraphs()
        # the layer's own timings near the prefill limit (twell.inference.path_timing; TIMED_CHOICE), and
        # the trial choose() gave this call (run() takes it at once)
        self.timer = None
        self._trial = None
        # the prefill path's hot units (twell.kernels.hot_units.HotUnits, HOT_UNITS), and the unit
        # counts of the probe in flight that the next set is taken from
        self.hot = None
        self._unit_freq = None
        self._hot_pending: Optional[int] = None
        self.last_hot_units = 0  # hot units the last call computed as a dense block (0: none)

    @property
    def module(self):
        m = self._module()
        if m is None:
            raise RuntimeError("twell: the module of this layer state was deleted")
        return m

    def first_weight_ptr(self) -> Optional[int]:
        m = self._module()
        return None if m is None else m._first_projection().weight.data_ptr()

    # -- decision -------------------------------------------------------------------------------

    def _poll(self) -> None:
        if self._event is not None and self._event.query():
            # mean, rms, max of active units per row; overflowed tiles per row; then the share
            # of rows computed whole and the mean, rms and max of the others (row_stats)
            vals = [float(v) for v in self._host.tolist()]
            a, b, c, e = vals[:4]
            dense, la, lb, lc = vals[4:8] if len(vals) >= 8 else (0.0, a, b, c)
            # a prefill probe's hot units: its row counts are the cold units' (the pack left the
            # hot ones out), and the hot block's time adds to the call's; then the count of units
            # firing at HOT_MIN_RATE or more, for the next hot set
            n_used, n_fit = (vals[8], vals[9]) if len(vals) >= 10 else (0.0, -1.0)
            if self._union_m:  # a small dense call: e is the share of units active in its batch
                self._fit_union(e, self._union_m)
                e = 0.0
            if self._no_overflow:
                e = 0.0
            self.estimate = (la + self.RMS_WEIGHT * max(0.0, lb - la) + max(dense, e) * self._dense_row_cost()
                             + HOT_UNIT_COST * n_used, lc)
            self.k_est, self.k_rms = a, b
            from ..kernels.updown import DENSE_ROW_MIN

            # (a probe of a call with hot units counted the cold units only: its rows may be longer)
            self.rows_short = dense == 0.0 and e == 0.0 and c <= DENSE_ROW_MIN and n_used == 0
            self._event = None
            if n_fit >= 0:
                self._hot_pending = int(n_fit)  # made by the next eager prefill call (_prefill)

    def _set_hot(self, n: int) -> None:
        """The hot set from the last prefill probe's unit counts: its ``min(n, HOT_MAX_UNITS)``
        most frequent units, rounded down to a multiple of ``HOT_UNIT_STEP`` (device ops only),
        or none below ``HOT_MIN_UNITS``."""
        freq, self._unit_freq = self._unit_freq, None
        # a multiple of HOT_UNIT_STEP: cuBLAS's fast products want rows of 16-byte multiples (on
        # the H100, 317 and 403 hot units made the module 0.3 ms slower at 16384 and 8192 tokens
        # than without hot units, where 256 were 0.1 ms faster)
        n = min(n, HOT_MAX_UNITS) // HOT_UNIT_STEP * HOT_UNIT_STEP
        if freq is None or n < HOT_MIN_UNITS:
            self.hot = None
            return
        from ..kernels.hot_units import hot_units

        self.hot = hot_units(torch.topk(freq, n, sorted=False).indices, freq.shape[0])

    def _fit_union(self, share: float, m: int) -> None:
        """Fit :attr:`union_rate` to ``share`` measured over a batch of ``m`` tokens, unless the
        current fit came from a larger batch: one token says nothing of how a layer's tokens
        share their units (its rate is just k / f), a batch of 16 does."""
        if m >= self._union_fit_m:
            self.union_rate = _rate_of_union(share, m)
            self._union_fit_m = m

    @classmethod
    def limit(cls, f: int, max_density: Optional[float], d: Optional[int] = None) -> float:
        """The prefill kernels' break-even in active units per token (before the hysteresis):
        ``max_density * f`` where the layer sets one (0: only a layer with nothing active), else
        the lower of ``DEFAULT_MAX_DENSITY * f`` and the cap for model width ``d`` (padded to a
        power of two): ``MAX_UNITS_BY_D`` where it lists the width, else ``DEFAULT_MAX_UNITS``."""
        if max_density is not None:
            return max_density * f
        return min(cls.DEFAULT_MAX_DENSITY * f, cls.max_units(d))

    @classmethod
    def dense_row_cost(cls, f: int, d: Optional[int] = None) -> float:
        """What one row computed whole (longer than ``DENSE_ROW_MIN``, or with an overflowed
        tile) costs the prefill kernels, in active units per token: ``DENSE_ROW_LIMITS`` times the
        default limit for ``f`` and ``d`` (a layer's ``kernel_max_density`` does not change what
        the hardware does)."""
        return cls.DENSE_ROW_LIMITS * cls.limit(f, None, d)

    def _dense_row_cost(self) -> float:
        m = self._module()
        if m is None:  # (a state whose module is gone runs no call; tests poll such states)
            return self.DENSE_ROW_LIMITS * self.DEFAULT_MAX_UNITS
        w = m._first_projection().weight
        return self.dense_row_cost(w.shape[0], w.shape[1])

    @classmethod
    def max_units(cls, d: Optional[int] = None) -> float:
        """The default limit's cap in active units per token for model width ``d`` (padded to a
        power of two; None: a width not known)."""
        return _for_width(cls.MAX_UNITS_BY_D, d, cls.DEFAULT_MAX_UNITS)

    def cost(self, M: int) -> Optional[float]:
        """Estimated prefill-kernel cost of a call of ``M`` tokens, in active units per token."""
        if self.estimate is None:
            return None
        base, top = self.estimate
        return base + self.TAIL_WEIGHT * top / max(M, 1)

    def union_share(self, M: int, f: int) -> Optional[float]:
        """Expected share of the units active for some token of a batch of ``M`` tokens: units
        firing independently at :attr:`union_rate` (fitted to a measured batch's share, so it
        carries the layer's skew), else at the measured mean ``k_est / f`` (skewed layers then
        have fewer than this says)."""
        rate = self.union_rate
        if rate is None:
            if self.k_est is None:
                return None
            rate = min(self.k_est / max(f, 1), 1.0)
        return 1.0 - (1.0 - rate) ** M

    def choose(self, M: int, f: int, mode: str, max_density: Optional[float], capturing: bool,
               x: Optional[torch.Tensor] = None) -> str:
        """``"dense"``, ``"decode"`` or ``"prefill"`` for a call of ``M`` tokens (``x``: the call's
        input, to check that the split decode kernels' buffers are there for it and whose width
        sets the prefill cap in units, :meth:`limit`; None: assume the buffers are there and take
        ``DEFAULT_MAX_UNITS``)."""
        self._trial = None  # a trial of the timer (TIMED_CHOICE) is this call's alone
        if mode == "auto":
            if not capturing:
                self._poll()
            if M <= DECODE_MAX_M:
                if not capturing:
                    return "dense"
                u = self.union_share(M, f)
                if u is None:
                    return "decode" if M <= DECODE_BLIND_M else "dense"
                split = self._split_pays(M, f) if x is None else self._split_ok(x, M, f)
                if split:  # (without its buffers the fused kernel would run: the union rule below)
                    return "decode"
                wide_m = _for_width(FUSED_WIDE_M_BY_D, None if x is None else x.shape[-1], FUSED_WIDE_M)
                return "decode" if u <= (FUSED_MAX_UNION if M <= wide_m else FUSED_WIDE_MAX_UNION) else "dense"
            if M < (PREFILL_MIN_M if capturing else EAGER_PREFILL_MIN_M):
                return "dense"
            c = self.cost(M)
            if c is None:
                return "dense"
            d = None if x is None else x.shape[-1]  # the cap in units depends on the model width
            if TIMED_CHOICE and max_density is None and not capturing and (x is None or x.is_cuda):
                if self.timer is None:
                    from .path_timing import PathTimer

                    self.timer = PathTimer()
                timed, self._trial = self.timer.choose(M, c, self.estimate[0], self.limit(f, None, d))
                if timed is not None:
                    self._on_kernels = timed == "prefill"
                    return timed
            limit = self.limit(f, max_density, d) * (self.HYSTERESIS if self._on_kernels else 1.0)
            self._on_kernels = c <= limit
            return "prefill" if self._on_kernels else "dense"
        if mode == "twell":
            return "decode" if M <= DECODE_MAX_M else "prefill"
        if mode in ("dense", "decode", "prefill"):
            return mode
        raise ValueError(f"kernel_mode must be one of {MODES}, got {mode!r}")

    def _want_probe(self, mode: str, capturing: bool, M: int) -> bool:
        """A new estimate is taken every PROBE_EVERY calls of at least PREFILL_MIN_M tokens (the
        calls whose path it decides), every PROBE_EVERY_SMALL calls of fewer (their eager path is
        dense whatever it says, and the probe's launches are host time the caller waits for), and
        at the first call of up to FUSED_MAX_M tokens larger than any whose union was measured
        (decode's choice in a later capture of that size needs it); one in flight at a time,
        never in a capture."""
        if mode != "auto" or capturing or self._event is not None:
            return False
        self._calls += 1
        every = self.PROBE_EVERY if M >= PREFILL_MIN_M else self.PROBE_EVERY_SMALL
        return self._calls % every == 1 or self.k_est is None or self._union_fit_m < M <= _fused_max_m()

    def _publish(self, values: torch.Tensor, no_overflow: bool = False) -> None:
        """Copy ``values`` (:func:`row_stats`' [8] float32 on the GPU, and a prefill probe's two
        hot-unit figures) to pinned host memory without blocking."""
        if not values.is_cuda:
            return
        self._no_overflow = no_overflow
        if self._host is None or self._host.numel() != values.numel():
            with torch.inference_mode(False):  # (made in inference mode it could not be written outside it)
                self._host = torch.empty(values.numel(), dtype=torch.float32, pin_memory=True)
        self._host.copy_(values, non_blocking=True)
        self._event = torch.cuda.Event()
        # on the stream the copy went to: values' device's, which need not be the current device
        self._event.record(torch.cuda.current_stream(values.device))

    def _publish_rows(self, per_row: torch.Tensor, over_per_token: Optional[torch.Tensor],
                      union: Optional[torch.Tensor] = None, union_m: int = 0,
                      hot: Optional[torch.Tensor] = None) -> None:
        """per_row: ``[n]`` active units of (a sample of) the call's rows, float32;
        over_per_token: overflowed tiles per token (None: no overflow on this path); union: the
        share of units active for some token of the call's ``union_m`` tokens (small dense calls;
        it takes the overflow slot); hot: ``[2]`` float32, the hot units the call used and the
        units firing at ``HOT_MIN_RATE`` or more (prefill probes)."""
        if per_row.numel():
            self._union_m = union_m if union is not None else 0
            values = row_stats(per_row, over_per_token if union is None else union)
            self._publish(values if hot is None else torch.cat([values, hot]), no_overflow=over_per_token is None)

    # -- the paths ------------------------------------------------------------------------------

    def call(self, x: torch.Tensor, w_first: torch.Tensor, w_down: torch.Tensor,
             w_up: Optional[torch.Tensor], fresh_output: bool = False) -> torch.Tensor:
        """An eager call of the module (arguments as :meth:`run`): replayed from the layer's own
        CUDA graph where :mod:`twell.inference.eager_graphs` keeps one for this many tokens, else
        :meth:`run`. ``fresh_output``: a replay returns a copy of the graph's output buffer, never
        the buffer itself (the custom op's contract: its output aliases nothing)."""
        graphs = self.graphs
        M = x.shape[0]
        if eager_graphs.ENABLED and x.is_cuda and graphs.disabled is None and (
                0 < M <= eager_graphs.MAX_M or (eager_graphs.PREFILL_BAND and PREFILL_MIN_M <= M < EAGER_PREFILL_MIN_M)):
            m = self.module
            if m.kernel_mode == "auto" and not m._tracking() and not torch.cuda.is_current_stream_capturing() \
                    and not _distributed():
                y = graphs.call(self, x, w_first, w_down, w_up, fresh_output)
                if y is not None:
                    return y
        graphs.last = False
        return self.run(x, w_first, w_down, w_up)

    def run(self, x: torch.Tensor, w_first: torch.Tensor, w_down: torch.Tensor, w_up: Optional[torch.Tensor],
            make_scratch: bool = True, capturing: Optional[bool] = None,
            out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The FFN of ``x [M, d]`` (unit-stride rows) with ``w_first``/``w_up [f, d]``,
        ``w_down [d, f]``: gated (``relu(x w_first^T) * (x w_up^T)``) when ``w_up`` is given.
        Records the module's statistics when it tracks them. Returns ``y [M, d]``. ``capturing``
        (None: whether the current stream is capturing) makes the choices of a capture: no probe,
        no poll, no buffers made (:mod:`twell.inference.eager_graphs` warms a graph's path up so). ``out``
        (``[M, d]``, x's dtype, contiguous; not with gradients): the dense and prefill paths write
        ``y`` there and return it; the decode kernels return their own."""
        m = self.module
        M, f = x.shape[0], w_first.shape[0]
        mode = m.kernel_mode
        if capturing is None:
            capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        path = self.choose(M, f, mode, m.kernel_max_density, capturing, x)
        trial, self._trial = self._trial, None
        if DECODE_SCRATCH and (self.scratch is None or (DECODE_SPLIT and self.split_scratch is None)) and make_scratch \
                and not capturing and not m.training and M <= _fused_max_m():
            # before a capture needs them: a buffer made inside one is the graph's. Not from the
            # compiled op (make_scratch False): cudagraph trees run their warm-up in the graphs'
            # memory pool, and a buffer from there must not outlive it
            self._make_scratch(x, f)
        w_down_t = w_down.t() if path != "dense" else w_down
        if path != "dense" and not w_down_t.is_contiguous():
            # kernels need down columns as contiguous rows: the module keeps w_down so in eval
            # mode (see _SparseFFN.train); a weight replaced since is laid out again here, outside
            # captures, compiled graphs and distributed runs, else this call runs dense rather than
            # copy a weight (FSDP's unsharded parameter is FSDP's buffer: replacing its data here
            # would leave the module reading a stale copy after the next optimizer step)
            if not m.training and not capturing and not torch.compiler.is_compiling() and not _distributed():
                m._set_kernel_layout(True)
                w_down = m.down_proj.weight
                w_down_t = w_down.t()
            if not w_down_t.is_contiguous():
                if _distributed() and not m.training:
                    _warn_distributed_layout()
                path = "dense"
        if path != "dense":
            # the kernels read rows of these weights unchecked: a projection replaced or cast on its
            # own (another f, another dtype) gets a clear error here, not a read past its end
            from ..kernels.decode import check_decode_args

            check_decode_args(x, w_first, w_down_t, w_up)
        self.last_path = path
        self.last_hot_units = 0  # (the prefill path sets it)
        track = m._tracking()
        if path == "decode":
            # no probe: "auto" decodes only inside a capture, where nothing is probed
            return self._decode(m, x, w_first, w_down_t, w_up, track)
        probe = M > 0 and self._want_probe(mode, capturing, M)
        timing = self.timer.start(trial, path, x.device) if trial is not None else None
        if path == "prefill":
            y = self._prefill(m, x, w_first, w_down_t, w_up, track, probe, out, capturing, keep=make_scratch)
        else:
            y = self._dense(m, x, w_first, w_down, w_up, track, probe, capturing, out)
        if timing is not None:
            self.timer.stop(timing)
        if probe and self.k_est is None and self._event is not None:
            # The layer's first estimate, waited for (once per layer): a model compiled before it
            # ever ran eagerly captures its CUDA graphs (mode="reduce-overhead") at its second
            # call, where nothing is polled, and would capture the dense path blind.
            self._event.synchronize()
            self._poll()
        return y

    def _decode(self, m, x, w_first, w_down_t, w_up, track):
        from ..kernels.decode import decode_launch
        from ..kernels.decode_fused import FUSED_MAX_M, decode_fused_launch, fused_config

        M, f = x.shape[0], w_first.shape[0]
        uc = torch.zeros(f, dtype=torch.int32, device=x.device) if track else None
        nnz = torch.zeros(M, dtype=torch.int32, device=x.device) if track else None
        split = self._split_for(x, M, f)
        if split is not None:
            from ..kernels.decode_split import decode_split_launch

            y = decode_split_launch(x, w_first, w_down_t, w_up, uc, nnz, scratch=split)[0]
            self.last_decode_kernels = "split"
        elif M <= FUSED_MAX_M:
            sc = self.scratch if DECODE_SCRATCH else None
            if sc is not None and (sc.acc.device != x.device or sc.acc.shape[1] != x.shape[1]):
                sc = None
            y = decode_fused_launch(x, w_first, w_down_t, w_up, uc, nnz, config=fused_config(M), scratch=sc)[0]
            self.last_decode_kernels = "fused"
        else:
            y = decode_launch(x, w_first, w_down_t, w_up, uc, nnz)
            self.last_decode_kernels = "three-launch"
        if track:
            m._record_counts(nnz, uc)
        return y

    def _split_pays(self, M: int, f: int, d: Optional[int] = None) -> bool:
        """Whether a decode call of ``M`` tokens should take the split kernels: DECODE_SPLIT on,
        SPLIT_MIN_M to SPLIT_MAX_M tokens, and the expected fires within the layer width's
        limits (``SPLIT_MAX_FIRES_BY_D`` for ``d``, else SPLIT_MAX_FIRES for both; d None: the
        default): M times the measured mean of the active units per token, and M times their
        root mean square (heavy tokens count more: their fires queue on one accumulator row;
        also at most SPLIT_MAX_ROW_FIRES); without a probe yet, the fitted rate times f for
        both; with no measurement at all (a forced decode call), yes."""
        if not DECODE_SPLIT or not SPLIT_MIN_M <= M <= _split_max_m() or f >= _split_max_f():
            return False
        mean = self.k_est if self.k_est is not None else (None if self.union_rate is None else self.union_rate * f)
        if mean is None:
            return True
        rms = self.k_rms if self.k_rms is not None else mean
        max_mean, max_rms = _for_width(SPLIT_MAX_FIRES_BY_D, d, (SPLIT_MAX_FIRES, SPLIT_MAX_FIRES))
        return M * mean <= max_mean and M * rms <= max_rms and rms <= SPLIT_MAX_ROW_FIRES

    def _split_ok(self, x: torch.Tensor, M: int, f: int) -> bool:
        """Whether this decode call of ``M`` tokens takes the split kernels: they pay (see
        :meth:`_split_pays`) and there are buffers for it: the layer's (made for x's d, dtype and
        device and ``f``), or where it keeps none that fit, the call's own on CUDA or in the
        interpreter."""
        if self._kept_split(x, f) is None and not (x.is_cuda or triton_interpreting()):
            return False
        return self._split_pays(M, f, x.shape[-1])

    def _kept_split(self, x: torch.Tensor, f: int):
        """The layer's kept SplitScratch when DECODE_SCRATCH is on and it fits ``x`` and ``f``."""
        sc = self.split_scratch if DECODE_SCRATCH else None
        if sc is None or sc.gates.dtype != x.dtype or sc.acc.device != x.device or sc.acc.shape[1] != x.shape[1] \
                or sc.f != f:
            return None
        return sc

    def _split_for(self, x: torch.Tensor, M: int, f: int):
        """The split kernels' buffers for this call when it takes them (:meth:`_split_ok`): the
        layer's kept SplitScratch, or (DECODE_SCRATCH off, or none kept yet, as in a graph
        captured by torch.compile's mode="reduce-overhead") one of the call's own; else None."""
        if not self._split_ok(x, M, f):
            return None
        kept = self._kept_split(x, f)
        if kept is not None:
            return kept
        from ..kernels.decode_split import SplitScratch

        return SplitScratch.for_one_call(M, x.shape[1], f, x.dtype, x.device)

    def _owner(self) -> Optional[int]:
        # whose decode buffers: every layer's (None) or, with SHARE_DECODE_BUFFERS off, this one's
        return None if SHARE_DECODE_BUFFERS else id(self)

    def _make_scratch(self, x: torch.Tensor, f: int) -> None:
        # The decode kernels' kept buffers for x's d, dtype and device, shared with the other
        # layers of the device (see DECODE_SCRATCH): the accumulator (CUDA; 64 rows when the split
        # kernels share it), and with DECODE_SPLIT the split kernels' list (CUDA, or the
        # interpreter for tests). A layer takes them once and never replaces them: a graph
        # captured with them keeps their addresses (a layer whose device or dtype changes later
        # runs the fused kernel, without its accumulator: one memset more per call).
        if not DECODE_SCRATCH:
            return
        d = x.shape[1]
        if self.scratch is None and x.is_cuda:
            from ..kernels.decode_fused import SCRATCH_ROWS, DecodeScratch

            rows = _split_max_m() if DECODE_SPLIT else SCRATCH_ROWS
            self.scratch = _shared_scratch(("acc", x.device, d, rows, self._owner()),
                                           lambda: DecodeScratch(d, x.device, rows=rows))
        if DECODE_SPLIT and self.split_scratch is None and f < _split_max_f() and (x.is_cuda or triton_interpreting()):
            from ..kernels.decode_split import SPLIT_MAX_M, SplitScratch

            sc = self.scratch
            acc = sc.acc if sc is not None and sc.acc.shape == (SPLIT_MAX_M, d) and sc.acc.device == x.device else None
            key = ("list", x.device, d, f, x.dtype, None if acc is None else acc.data_ptr(), self._owner())
            self.split_scratch = _shared_scratch(key, lambda: SplitScratch(d, f, x.dtype, x.device, acc=acc))

    def _hot_for(self, x, w_down_t, w_up, M: int, f: int, capturing: bool):
        """The hot set this prefill call takes (HOT_UNITS), or None."""
        from ..kernels import updown
        from ..kernels.heavy_rows import weights_addressable

        hot = self.hot
        # not in float16: the hot part is rounded to y's dtype before the cold units add to it,
        # which can overflow there where the dense MLP's one rounding would not
        if (hot is None or not HOT_UNITS or capturing or M < max(HOT_MIN_M, updown.TWO_PASS_MIN_M) or hot.f != f
                or hot.units.device != x.device or x.dtype == torch.float16 or not weights_addressable(w_down_t, w_up)):
            return None
        return hot

    def _prefill(self, m, x, w_first, w_down_t, w_up, track, probe, out=None, capturing=False, keep=True):
        from ..kernels import OverflowCounters, ffn_from_twell, pack_relu
        from ..kernels.gate_pack import pack_relu_hot
        from ..kernels.hot_units import hot_up
        from ..kernels.updown import default_config, splits
        from .ops import DEFAULT_COMPRESSION, default_tile

        M, f = x.shape[0], w_first.shape[0]
        counters = self.counters
        if counters is None or counters.buffer.device != x.device:
            counters = OverflowCounters.zeros(x.device)
            if keep:
                self.counters = counters
            # else (the compiled op's calls inside inductor's CUDA graphs, their warm-up included):
            # the call's own counters, which the graphs' memory pool may hold for the call only;
            # the layer keeps counters from its first eager call on
        before = counters.tiles.clone() if probe else None
        pre = torch.mm(x, w_first.t())  # cuBLAS gate (measured faster than a fused Triton gate)
        hot_fit = None
        if keep and not capturing and self._hot_pending is not None:
            # the hot set's tensors are made here, in an eager call: a poll may run inside a
            # compiled call, whose warm-up allocates from a CUDA graph pool (run's make_scratch)
            self._set_hot(self._hot_pending)
            self._hot_pending = None
        if probe and keep and HOT_UNITS and x.is_cuda and M >= HOT_MIN_M:  # (calls that may use a set)
            # how often each unit fires, before the rows computed whole overwrite theirs of pre
            self._unit_freq = (pre[:HOT_SAMPLE] > 0).sum(dim=0, dtype=torch.float32)
            hot_fit = (self._unit_freq >= HOT_MIN_RATE * min(M, HOT_SAMPLE)).sum(dtype=torch.float32)
        tile = default_tile(f)
        hot = self._hot_for(x, w_down_t, w_up, M, f, capturing)
        if hot is None:
            g, hot_args = pack_relu(pre, tile, DEFAULT_COMPRESSION), None
        else:
            # the hot units' up projection, turned into their hidden values in place by the pack
            up = hot_up(x, hot, w_up) if w_up is not None else None
            g, h_hot = pack_relu_hot(pre, hot, tile, DEFAULT_COMPRESSION, up=up)
            hot_args = (h_hot, hot)
            self.last_hot_units = hot.n
        uc = torch.zeros(f, dtype=torch.int32, device=x.device) if track else None
        nnz = torch.empty(M, dtype=torch.int32, device=x.device) if track else None
        split = splits(M, w_up is not None, d=x.shape[1])
        be, nw = default_config(x.shape[1], self.k_est, split=split, rms_k=self.k_rms)
        one_launch = PREFILL_ONE_LAUNCH and self.rows_short and hot is None and not split
        y = ffn_from_twell(x, g, w_down_t, w_up=w_up, pre=pre, counters=counters, unit_counts=uc, row_nnz=nnz,
                           block_e=be, num_warps=nw, out=out, pre_writable=True,  # pre is ours: dense overflowed rows
                           hot=hot_args, one_launch=one_launch)
        if track:
            m._record_counts(nnz, uc)
        if probe:
            # the cold units' counts where a hot block ran (the estimate prices it apart)
            per_row = nnz if track and hot is None else g.counts.sum(dim=1)
            extra = None
            if hot_fit is not None:
                extra = torch.stack([hot_fit.new_full((), 0.0 if hot is None else float(hot.n)), hot_fit])  # (no host copy)
            self._publish_rows(per_row.float(), (counters.tiles - before).float() / M, hot=extra)
        return y

    def _dense(self, m, x, w_first, w_down, w_up, track, probe, capturing=False, out=None):
        # F.linear rather than mm(x, w.t()): one Python-level view fewer per product
        a = F.linear(x, w_first)  # the pre-activation: a > 0 is the ReLU pattern
        if track:
            m._record(a, None)
        if w_up is None:
            h = torch.relu(a)
        elif a.shape[0] <= (self.GRAPH_SMALL_M if capturing else self.SMALL_M):
            # two in-place PyTorch ops issue faster than a Triton launch; the traffic is small here
            h = F.linear(x, w_up).mul_(a.relu_())
        else:
            from ..kernels.elementwise import relu_mul_

            h = relu_mul_(F.linear(x, w_up), a)  # one pass over [M, f] instead of two
        y = F.linear(h, w_down) if out is None else torch.mm(h, w_down.t(), out=out)
        del h
        if probe and a.shape[0]:
            # after h is freed, and in a itself, so that the probe never raises the call's peak: a
            # bool mask costs a byte an element and is summed through a float32 copy (4 more),
            # while a half-precision tensor is summed in float32 without one on CUDA (measured: a
            # bool mask raised the peak by 3 bytes an element at 256 and 1024 tokens)
            # 1 where relu(a) != 0 (a > 0, or NaN as the kernels count it), else 0; a is not used again
            fires = a[:4096].clamp_(min=0).ne_(0)
            M = a.shape[0]
            union = fires.amax(dim=0).sum(dtype=torch.float32) / max(a.shape[1], 1) if M <= _fused_max_m() else None
            self._publish_rows(fires.sum(dim=1, dtype=torch.float32), None, union, M)
        return y

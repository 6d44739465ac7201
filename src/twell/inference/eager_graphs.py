"""Small eager inference calls replayed from CUDA graphs that twell captures itself.

Why. Up to about a thousand tokens per call, an eager FFN call is bound by the host, not the GPU:
the dense PyTorch MLP issues five kernels, 45 to 140 us of CPU time per call on the H200 machine
here, for 31 to 118 us of GPU work, and twell's decode kernels, about 10 us of GPU time at one
token, take longer still to issue (Triton launches: 160 to 250 us). Inside a CUDA graph the same
call is one launch.

What. Each layer (:class:`twell.inference.dispatch.LayerState`) captures its call of ``M`` tokens in a CUDA
graph the ``CAPTURE_AFTER``-th time it sees ``M`` (``1 <= M <= MAX_M``) and later calls of ``M``
copy their input into the graph's input buffer, replay the graph and return its output (see
"Memory"): two host operations, whatever the path inside. The path is chosen as inside a user's
capture (:meth:`twell.inference.dispatch.LayerState.choose`): the decode kernels where the layer's measured
sparsity makes them pay, else dense. A call takes this route in eager mode and from a compiled
graph's custom op on the default stream (:mod:`twell.inference.custom_op`; never inside a
capture, inductor's included), on CUDA, with ``kernel_mode`` "auto", statistics off (the default
outside training steps) and no process group initialised.

When a replay is right. A graph reads the weights at the addresses they had when it was captured,
so it reads in-place updates (``load_state_dict``, an optimizer step) as they are; a layer drops
its graphs when a weight's address, stride or dtype changes (the module moved, a weight replaced
or laid out again by ``train()`` / ``eval()``), and after ``MAX_RECAPTURES`` such changes stops
capturing. A graph replays the path chosen at capture whatever the data: every path is exact, so
only the speed depends on that choice, and the sparsity estimate is not refreshed by replays.

Memory. One input and one output buffer per (device, dtype, M, d) serve every layer, and the
graphs' intermediates come from one memory pool per device: the layers' calls run one after
another. The first capture that calls cuBLAS (the dense path) also makes cuBLAS's workspace for
twell's capture stream in that pool, 32 MiB on the H200, once per device; the eager warm-up
before each capture runs on the caller's stream, so it adds no workspace of its own. The
graph's last kernel writes the output buffer itself (no copy inside the graph), and with
``HAND_OUT`` the call returns that buffer (a view of it) instead of a copy: a decoder layer
adds it into its residual and drops it before the next layer's MLP runs. Before each replay a
layer checks that no caller still holds an earlier output of the buffer (its storage's reference
count: a forward hook that keeps the MLP's outputs, ``mlp(mlp(x))``). If one does, that buffer is
left to the caller, the layer captures again on a new buffer, and outputs of that size are
copies from then on, for the rest of the process (:attr:`EagerGraphs.held_outputs` counts such
calls): one debugging hook that keeps outputs costs that size a copy per call afterwards. A
caller that reads an output on another stream and drops it there (``record_stream``) is not
waited for by the next replay: set ``HAND_OUT = False`` for such use. A call that comes on
another stream than the last replay waits for that stream first, and a lock keeps threads from
interleaving one call's copy in, replay and hand-out, so calls from several threads or streams
are right but run one at a time on the GPU: set ``ENABLED = False`` to let them overlap.

Observability: :attr:`EagerGraphs.replays`, :attr:`EagerGraphs.captures` and
:attr:`EagerGraphs.held_outputs` per layer (``module.eager_graphs``), :attr:`EagerGraphs.last`
(whether the last eager call was a replay), :attr:`EagerGraphs.disabled` (why a layer stopped
capturing, or None).
"""

from __future__ import annotations

import collections
import sys
import threading
import warnings
import weakref
from typing import Optional

import torch

__all__ = ["ENABLED", "HAND_OUT", "MAX_M", "PREFILL_BAND", "CAPTURE_AFTER", "MAX_SIZES", "MAX_BAND_SIZES", "BAND_RETRY",
           "MAX_RECAPTURES", "EagerGraphs"]

# The switch, read at every call.
ENABLED = True
# Whether a replay returns the graph's output buffer itself (safe: see "Memory" above) or a copy.
# The copy is one more pass over [M, d] and one more launch per call.
HAND_OUT = True
# Up to this many tokens per call. On the H200 (bf16, d 2048, f 5632, k 29) replays read 2.56x,
# 1.72x, 1.63x and 1.34x dense's eager call at 1, 4, 16 and 64 tokens (host time 28 to 30 us against
# 68 to 73), but 0.97x and 0.98x at 256 and 1024 tokens, where the call is nearly bound by the GPU:
# the output's two copies (into the shared buffer inside the graph, out of it after) cost more than
# the launches saved. With the output written in place and handed out (k 29 and 280, two rounds):
# 1.01x to 1.11x at 128 to 1024 tokens, against 0.88x to 1.04x eagerly and 0.97x to 1.04x replayed
# with the copy; host time 23 to 28 us against dense's 69 to 77. Memory: the first graph of the
# dense path on a device makes cuBLAS's workspace for the capture stream (32 MiB on the H200) in the
# graphs' pool, kept while the graphs live (one layer's first 128-token capture kept 33 MiB); the 2b
# model's lean batch-1 decoding, whose 128-token prompts are captured, peaked 4.8 MiB above dense's
# (0.7 MiB with MAX_M 64). Set 64 to keep larger calls out of graphs.
MAX_M = 1024
# Eager calls of dispatch.PREFILL_MIN_M to dispatch.EAGER_PREFILL_MIN_M - 1 tokens (4096 to 8191)
# are replayed too, where the path a capture would take there is the prefill kernels. Eagerly
# those sizes run dense, because issuing the prefill kernels took the host about as long as
# they save (0.4 to 0.5 ms against 0.3 ms of GPU time at 4096 tokens, k 29). Replayed, on the H200
# (two rounds): k 29 1.29x to 1.30x dense's eager call at 4096 and 6144 tokens against 1.06x to
# 1.07x with the band off, k 8 1.75x to 1.77x against 1.06x; host time 40 to 68 us against 94 to
# 139, peak memory lower (82 to 90 MiB against 198 to 264). The copies in and out cost the rest of
# the graph's 1.46x.
PREFILL_BAND = True
# Batch sizes of the band kept per layer (their own slots: prompt lengths must not take the decode
# sizes' MAX_SIZES), and after how many more calls a size whose capture would not run the prefill
# kernels is asked again (the sparsity estimate moves).
MAX_BAND_SIZES = 2
BAND_RETRY = 64
# A size is captured at its third eager call: the first one's sparsity probe has usually arrived by
# then (a capture waits for it), and sizes seen once or twice (prompt lengths) are not captured.
CAPTURE_AFTER = 3
# At most this many batch sizes per layer keep a graph; calls of other sizes run eagerly.
MAX_SIZES = 8
# A layer whose weights moved more often than this stops capturing (distributed wrappers or user
# code that allocates weights per call would otherwise capture on every call).
MAX_RECAPTURES = 8

_BUFFERS: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()
_LIVE: dict = {}  # device -> WeakSet of the graphs made here: a live one lends its memory pool
_STREAMS: dict = {}  # device -> capture stream
_BROKEN: dict = {}  # device -> why captures stopped there (a failed capture)
_LAST_STREAM: dict = {}  # device -> (raw id, stream) of the last replay's stream
# device index -> lock: one call's copy in, replay and hand-out at a time (threads)
_LOCKS: "collections.defaultdict[int, threading.RLock]" = collections.defaultdict(threading.RLock)


def _key(kind: str, x: torch.Tensor, inference: bool) -> tuple:
    """The key of the shared input ("x") or output ("y") buffer for ``x``'s device, dtype and
    shape, in or out of inference mode."""
    return (kind, x.device, x.dtype, x.shape[0], x.shape[1], inference)


def _buffer(x: torch.Tensor, inference: bool) -> torch.Tensor:
    """The shared ``[M, d]`` input buffer for ``x``'s device, dtype and shape (made inside
    inference mode when ``inference``: such tensors can only be written there)."""
    key = _key("x", x, inference)
    buf = _BUFFERS.get(key)
    if buf is None:
        buf = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        _BUFFERS[key] = buf
    return buf


# keys of output buffers that a caller kept: every buffer of such a key hands out copies from then on
_COPY_KEYS: set = set()


class _Output:
    """A shared ``[M, d]`` output buffer ``y`` (under ``key``), and whether a caller holds what it
    handed out.

    ``alone``: the reference count of ``y``'s memory (its storage) with no view of it handed out,
    taken when it is made; each tensor viewing it (a returned output, a view a caller made of it)
    adds one."""

    __slots__ = ("y", "key", "_storage", "_alone", "_storage_refs", "__weakref__")

    def __init__(self, y: torch.Tensor, key: tuple) -> None:
        self.y, self.key = y, key
        # y's one Python storage object (every untyped_storage() of y or of a view of it returns
        # it): a caller may keep that alone, which adds to its Python references, not to the
        # storage's count
        self._storage = y.untyped_storage()
        self._alone = torch._C._storage_Use_Count(self._storage._cdata)
        self._storage_refs = sys.getrefcount(self._storage)

    def held(self) -> bool:
        """Whether a caller holds this memory: a tensor other than ``y`` viewing it (an output
        kept, a view of it), or its storage object."""
        return (torch._C._storage_Use_Count(self._storage._cdata) > self._alone
                or sys.getrefcount(self._storage) > self._storage_refs)

    def give_away(self) -> None:
        """Leave this buffer to the caller that holds it: later captures of its size take a new
        buffer, and every buffer of its size hands out copies."""
        _COPY_KEYS.add(self.key)
        if _BUFFERS.get(self.key) is self:
            del _BUFFERS[self.key]


def _output(x: torch.Tensor, inference: bool) -> _Output:
    """The shared output buffer for ``x``'s device, dtype and shape (see :func:`_buffer`)."""
    key = _key("y", x, inference)
    out = _BUFFERS.get(key)
    if out is None:
        out = _Output(torch.empty(x.shape, dtype=x.dtype, device=x.device), key)
        _BUFFERS[key] = out
    return out


def _pool_owner(device: torch.device) -> Optional[torch.cuda.CUDAGraph]:
    """A live graph of ``device`` whose memory pool the next capture shares (None: it makes a new
    pool). A pool lives as long as some graph captured into it, so the caller holds the owner
    until its capture ends: a pool id kept past the last of its graphs names a pool PyTorch has
    released, and a capture into it fails inside the allocator."""
    for graph in _LIVE.get(device, ()):
        return graph
    return None


def _capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream twell's captures on ``device`` run on. cuBLAS keeps a workspace per stream
    (32 MiB on the H200), which PyTorch frees when a graph captured on that stream is destroyed:
    made by eager work on this stream it would lie outside the graphs' pool and could be freed
    under the other graphs, so nothing but captures runs here, and the workspace is made inside
    the first capture that calls cuBLAS, in the pool, alive as long as the graphs that use it.
    The warm-up before a capture runs on the caller's stream instead, whose workspace exists
    wherever the model has run a matmul: a warm-up stream of its own would add a second
    workspace (32 MiB more kept)."""
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream(device)
    return _STREAMS[device]


def _order_streams(device: torch.device) -> None:
    """Calls share the input and output buffers, the graphs' pool and the decode buffers: when a
    call comes on another stream than the last replay, it waits for that stream first."""
    raw = torch._C._cuda_getCurrentRawStream(device.index)
    last = _LAST_STREAM.get(device)
    if last is None or last[0] != raw:
        current = torch.cuda.current_stream(device)
        if last is not None:
            current.wait_stream(last[1])
        _LAST_STREAM[device] = (raw, current)


class _Graph:
    __slots__ = ("graph", "x", "out", "path", "kernels")

    def __init__(self, graph, x, out, path, kernels):
        self.graph, self.x, self.out, self.path, self.kernels = graph, x, out, path, kernels


class EagerGraphs:
    """One layer's captured calls, by (tokens per call, inference mode)."""

    def __init__(self) -> None:
        self._graphs: dict = {}
        self._seen: dict = {}
        self._weights: Optional[tuple] = None  # what the graphs read: addresses, shapes, strides, dtype
        self.recaptures = 0
        self.captures = 0
        self.replays = 0
        self.held_outputs = 0  # calls that found an earlier output of their buffer still held
        self.last = False
        self.disabled: Optional[str] = None

    def __len__(self) -> int:
        return len(self._graphs)

    def clear(self) -> None:
        """Drop every graph (their pool memory is freed with the last graph of the pool)."""
        self._graphs.clear()
        self._seen.clear()

    def call(self, state, x: torch.Tensor, w_first: torch.Tensor, w_down: torch.Tensor,
             w_up: Optional[torch.Tensor], fresh_output: bool = False) -> Optional[torch.Tensor]:
        """``y [M, d]`` from this layer's graph for ``x [M, d]`` (capturing it when its time has
        come), or None: the caller runs the call eagerly. ``fresh_output``: a copy of the graph's
        output buffer even where ``HAND_OUT`` would hand the buffer out."""
        if self.disabled is not None:
            return None
        with _LOCKS[x.get_device()]:
            return self._call(state, x, w_first, w_down, w_up, fresh_output)

    def _call(self, state, x, w_first, w_down, w_up, fresh_output=False) -> Optional[torch.Tensor]:
        weights = (w_first.data_ptr(), w_first.shape, w_first.stride(), w_down.data_ptr(), w_down.shape,
                   w_down.stride(), None if w_up is None else (w_up.data_ptr(), w_up.shape, w_up.stride()), x.dtype)
        if weights != self._weights:
            if self._graphs:
                self.recaptures += 1
                if self.recaptures > MAX_RECAPTURES:
                    self.disabled = f"weights moved {self.recaptures} times"
            self.clear()
            self._weights = weights
            if self.disabled is not None:
                return None
        key = (x.shape[0], torch.is_inference_mode_enabled())
        g = self._graphs.get(key)
        if g is None:
            seen = self._seen.get(key, 0) + 1
            self._seen[key] = seen
            if seen < CAPTURE_AFTER:
                return None
            band = key[0] > MAX_M  # (the prefill band has slots of its own)
            if sum(1 for k in self._graphs if (k[0] > MAX_M) == band) >= (MAX_BAND_SIZES if band else MAX_SIZES):
                return None
        # A caller still holding an output of the buffer this call would write (or x is one): a
        # replay would write over it. The buffer is left to the caller, and this layer captures
        # on a new one. Checked before the streams are ordered: work a caller queued on its
        # stream before dropping an output is then waited for.
        out = g.out if g is not None else _BUFFERS.get(_key("y", x, key[1]))  # (a capture's buffer)
        if out is not None and out.held():
            self.held_outputs += 1
            out.give_away()
            if g is not None:
                del self._graphs[key]
                g = None
        if x.is_cuda:
            _order_streams(x.device)
        if g is None:
            g = self._capture(state, x, w_first, w_down, w_up, key)
            if g is None:
                return None
        g.x.copy_(x)
        g.graph.replay()
        self.replays += 1
        self.last = True
        state.last_path, state.last_decode_kernels = g.path, g.kernels
        return g.out.y.clone() if fresh_output or not HAND_OUT or g.out.key in _COPY_KEYS else g.out.y.detach()

    def _capture(self, state, x, w_first, w_down, w_up, key) -> Optional[_Graph]:
        # a capture's path choices must not move the prefill hysteresis of the layer's eager calls
        on_kernels = state._on_kernels
        try:
            return self._capture_path(state, x, w_first, w_down, w_up, key)
        finally:
            state._on_kernels = on_kernels

    def _capture_path(self, state, x, w_first, w_down, w_up, key) -> Optional[_Graph]:
        from ..kernels.decode_fused import FUSED_MAX_M

        dev = x.device
        if dev in _BROKEN:
            self.disabled = _BROKEN[dev]
            return None
        state._poll()
        if state._event is not None:
            return None  # the first probe has not arrived: capture at a later call
        xs, out = _buffer(x, key[1]), _output(x, key[1])
        ys = out.y
        if x.shape[0] <= FUSED_MAX_M and (state.scratch is None or state.split_scratch is None):
            state._make_scratch(x, w_first.shape[0])  # as an eager call would, before any capture
        current = torch.cuda.current_stream(dev)
        xs.copy_(x)
        side = _capture_stream(dev)
        owner = _pool_owner(dev)  # held until the capture ends: it keeps the pool alive
        graph = torch.cuda.CUDAGraph()
        error, clean = None, False
        with torch.cuda.device(dev):
            # the path as the capture will run it, on the caller's stream (see _capture_stream):
            # its kernels compile outside the capture
            state.run(xs, w_first, w_down, w_up, capturing=True)
            band = x.shape[0] > MAX_M
            if band and state.last_path != "prefill":
                # the prefill band is worth a graph only where a capture takes the kernels: asked
                # again after BAND_RETRY more calls (the estimate moves)
                self._seen[key] = -BAND_RETRY
                return None
            side.wait_stream(current)
            with torch.cuda.stream(side):
                try:
                    graph.capture_begin(**({} if owner is None else {"pool": owner.pool()}),
                                        capture_error_mode="thread_local")
                except Exception as e:  # noqa: BLE001
                    error = e
                else:
                    try:
                        # the dense and prefill paths write ys themselves; the decode kernels'
                        # output (at most 64 rows) is copied in
                        y = state.run(xs, w_first, w_down, w_up, capturing=True, out=ys)
                        if y is not ys:
                            ys.copy_(y)
                        del y
                    except Exception as e:  # noqa: BLE001  (reported below, after the capture is ended)
                        error = e
                    try:
                        graph.capture_end()
                        clean = True  # the capture began and ended: PyTorch's state is whole
                    except Exception as e:  # noqa: BLE001
                        error = error or e
            current.wait_stream(side)
        del owner
        if error is not None:
            reason = f"capture failed: {type(error).__name__}: {error}"
            if band and clean:  # (out of memory, say) the decode sizes' graphs are not at stake
                self._seen[key] = -BAND_RETRY
                warnings.warn(f"twell: a prefill-band capture of {key[0]} tokens failed ({reason}); that size runs "
                              "eagerly", RuntimeWarning, stacklevel=4)
                return None
            # otherwise this call and later ones run eagerly, and no layer of this device tries
            # again: a capture that failed inside PyTorch may have left its state half-reset
            _BROKEN[dev] = self.disabled = reason
            self.clear()
            warnings.warn(f"twell: eager calls on {dev} will not be replayed from CUDA graphs ({reason}); "
                          "set twell.inference.eager_graphs.ENABLED = False to silence this", RuntimeWarning, stacklevel=4)
            return None
        _LIVE.setdefault(dev, weakref.WeakSet()).add(graph)
        g = self._graphs[key] = _Graph(graph, xs, out, state.last_path, state.last_decode_kernels)
        self.captures += 1
        return g

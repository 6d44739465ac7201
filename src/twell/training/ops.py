"""Sparse FFN training ops: forward and exact backward on the hybrid format, with autograd.

One call of :func:`sparse_gated_ffn` (``y = (relu(x w_gate^T) * (x w_up^T)) w_down^T``)::

    a = x w_gate^T                         cuBLAS, the only dense matmul of the light rows
    cols, g, counts = pack_rows(a, W)      ELL rows: the first W positives of each row
    heavy = rows with counts > W           listed on the device (torch.nonzero_static)
    light rows: Triton (twell.kernels.train_ffn), every product restricted to the pattern
    heavy rows: Triton products over the listed rows (twell.kernels.heavy_rows), however many
                there are: nothing is dropped

The forward never waits for the GPU. It cannot know on the host how many rows are heavy, so the
heavy rows' kernels walk a row list whose length stays on the device, and the backward recomputes
their a and u from x with cuBLAS once the count has reached the host: the forward copies it to
pinned memory without blocking, right after the pack, and the backward reads it
(:func:`_to_host`, :func:`_host_counts`), waiting only if the GPU has not yet reached that point of the forward (in
a training step it did long before; right after a lone forward, the forward's row kernels are
still queued behind it, so the GPU keeps working while the host waits). A stream synchronisation
per layer instead would drain the GPU's queue each time: in a whole training step of the 0.5b
preset, the sparse kernels read 1.16x dense's tokens/s without it, 1.14x with it.

In the backward, the weight gradients of the light rows go unit by unit (a per-unit kernel over
the slots sorted by unit, its programs taking the longest units first), except for hot units
(more light slots than max(HOT_MIN, HOT_SHARE M, HOT_FACTOR x the mean): :func:`hot_limit`),
whose share is one cuBLAS product over a dense ``[M, n_hot]`` block. The L1 term ``l1 = mean over tokens of sum over units |h|`` (:func:`twell.reference.l1_penalty`)
is returned beside y, so that ``loss = task_loss(y) + lam * l1`` back-propagates through both.

Saved for backward (no ``[M, f]`` tensor): x, the weights (held by the model anyway), the ELL
rows ``cols [M, W]`` (int16 when f <= 32768), ``g [M, W]``, ``u [M, W]`` (gated), ``counts [M]``
int32, the heavy rows' list ``[M]`` int64, the hot units' mask ``[f]``, the weight gradients'
schedule ``[f]`` int64 and three counts (on the host).
:func:`saved_bytes` measures it.

The results equal dense autograd up to rounding, for every input: any M, d, f, any pattern.

:func:`dense_gated_ffn` / :func:`dense_ffn` are the same FFN with every row dense (cuBLAS and
one fused element-wise pass each way, with the L1 term and the statistics): what a layer trains
with where the sparse kernels would not pay.

Under ``torch.compile`` these functions are the custom ops ``twell::train_ffn_fwd`` and
``twell::train_ffn_bwd`` (:func:`train_ffn_fwd`, :func:`train_ffn_bwd`), one pair for every path:
the forward returns what the backward needs as outputs of its own (a custom op keeps no state
between the two), and the host-side counts stay inside the ops. ``width`` >= 1 is the sparse
path, 0 the dense one, and ``LAYER_CHOICE`` (:func:`layer_ffn`, what a compiled twell module
calls) the path and width its layer picks at run time from its measured sparsity
(:mod:`twell.training.path`), so that one compiled graph serves every layer whatever each
picks. Eager calls run the same forward and backward through an autograd.Function instead,
which costs less host time per call.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from typing import Callable, NamedTuple, Optional

import torch
from torch.autograd.function import once_differentiable

from ..checks import KERNEL_DTYPES, check_launchable, check_mlp_args, check_tensor
from ..kernels.dense_rows import dense_rows_backward, dense_rows_forward
from ..kernels.heavy_rows import heavy_rows_forward, weights_addressable
from ..kernels.train_ffn import col_dtype, ffn_rows_backward, ffn_rows_forward, ffn_weight_grads, pack_rows
from ..kernels.train_index import heavy_and_hot, light_unit_counts, unit_index
from . import path as train_path
from . import path_timing
from .path import LAYER_CHOICE, choose_width  # (choose_width: exported here too)

__all__ = [
    "TrainFFNOutput",
    "TrainFFNFunction",
    "sparse_gated_ffn",
    "sparse_ffn",
    "dense_gated_ffn",
    "dense_ffn",
    "layer_ffn",
    "train_ffn_fwd",
    "train_ffn_bwd",
    "choose_width",
    "saved_bytes",
]


# Tuning knobs of the kernels' launchers (twell.kernels.train_ffn), read at each call: the
# fastest of `twell bench training --variants` on the H200 (d 2048, M 16384, k 29; the row
# kernels' block_e 2 against 4: 0.54 against 0.58 ms forward). The tests shrink them to walk
# every loop of the kernels more than once.
# block_d None: the whole row of d in registers (whole-row kernels) up to FULL_D_MAX columns, else
# d in steps of 512 (row kernels) or 256 (weight gradients).
# The pack: two rows per program in steps of 512 columns, one warp (0.086 ms at M 16384, k 29;
# the fastest of seven shapes in four of five cases, within 5% in the fifth).
PACK_CONFIG: dict = dict(block_m=2, block_f=512, num_warps=1)
ROWS_CONFIG: dict = dict(block_e=2, block_d=None, num_warps=4)
# The weight gradients in two launches (split: one gathering x rows, one dy rows; each gathers from
# 64 MB at M 16384 instead of 128, and L2 holds 50 MB), four warps: 0.75 against 1.08 ms at M
# 16384, k 29 on an H100.
GRADS_CONFIG: dict = dict(block_t=2, block_d=None, num_warps=4, split=True)
# The weight gradients' programs take the units longest first (the schedule of
# twell.kernels.train_index.heavy_and_hot): on an H100 at M 16384 the kernel went from 0.74 to
# 0.64 ms on even k 29 and from 0.72 to 0.49 ms on skewed k 29 (a sort standing in for the
# schedule).
GRADS_LONGEST_FIRST: bool = True
# The heavy rows' tiles (twell.kernels.heavy_rows): rows, columns, reduction step. Not tuned: on
# the sparse path heavy rows are a small share of a call (a layer with many trains dense, see
# twell.training.path).
HEAVY_CONFIG: dict = dict(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=3)


class TrainFFNOutput(NamedTuple):
    """What the training FFN ops (sparse and all-rows-dense) return.

    Attributes:
        y: ``[M, d]`` the FFN output (differentiable).
        l1: fp32 scalar, mean over tokens of the sum over units of ``|h|`` (differentiable).
        row_counts: ``[M]`` int32, active units of each token.
        unit_counts: ``[f]`` int64, tokens each unit fired for.
        n_heavy: int64 scalar tensor, rows that had more than W active units and took the dense
            backup (0 from the all-rows-dense op).
    """

    y: torch.Tensor
    l1: torch.Tensor
    row_counts: torch.Tensor
    unit_counts: torch.Tensor
    n_heavy: torch.Tensor


def _check_args(x, w_up, w_down, w_gate, width, sparse: bool = True) -> int:
    d, f = check_mlp_args(x, w_up, w_down, w_gate)
    check_tensor(x, "x", dim=2, dtypes=KERNEL_DTYPES)
    if not x.is_contiguous():
        raise ValueError(f"x must be a contiguous [M, d] tensor, got strides {x.stride()}")
    for w, name in ((w_gate, "w_gate"), (w_up, "w_up")):
        if w is not None and w.stride(1) != 1:
            raise ValueError(f"{name} must have unit-stride rows (stride(1) == 1), got strides {w.stride()}")
    if sparse and not weights_addressable(w_up, w_down):  # the heavy rows' forward kernels (int32 weight offsets)
        raise ValueError(f"the sparse training ops take weights of fewer than 2^31 elements (d {d}, f {f}); "
                         "use the dense path (train_kernels='dense')")
    check_launchable(x, "x")
    _check_width(width)
    return min(width, max(f, 1))  # a row never has more than f entries


def autocast_off(device_type: str):
    """``torch.autocast(device_type, enabled=False)`` where autocast is on, else a null context:
    entering an autocast context costs host time on every call, which small calls feel."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def _refuse_capture(x: torch.Tensor) -> None:
    """The sparse ops' backward sizes the heavy rows' cuBLAS products from counts its forward
    copied to the host: replayed from a CUDA graph, those would be the capture's, not the
    replay's. Say so (forward and backward alike) instead of recording a graph that replays
    wrong sizes."""
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "the sparse training ops cannot be captured in a CUDA graph (the backward sizes the heavy rows' "
            "products from counts the forward copies to the host); use dense_gated_ffn / dense_ffn, which "
            "can be (SparseGatedMLP / SparseMLP with train_kernels 'auto' take them inside a capture)")


def _heavy_and_hot(counts: torch.Tensor, W: int, per_unit: torch.Tensor, f: int):
    """On the device, no host sync: ``(heavy, n_heavy, hot_mask, info, schedule)``. ``heavy [M]`` int64
    lists the rows with more than W active units first (the rest is padding), ``n_heavy`` (int64
    scalar) counts them; ``hot_mask [f]`` marks the hot units (see HOT_SHARE) of the light rows
    (``per_unit``: their slots per unit); ``info [3]`` int64 = (n_heavy, hot units, light slots
    at hot units), what the backward needs on the host (:func:`_to_host`); ``schedule [f]``
    int64, the units longest first, the order the weight gradients' programs take them. One
    launch (:func:`twell.kernels.train_index.heavy_and_hot`)."""
    return heavy_and_hot(counts, W, per_unit, hot_limit(counts.shape[0]), HOT_FACTOR)


def hot_limit(M: int) -> float:
    """The fewest light-row slots above which a unit may be hot in a call of ``M`` tokens
    (besides ``HOT_FACTOR`` x the mean): ``max(HOT_MIN, HOT_SHARE M)``."""
    return max(float(HOT_MIN), HOT_SHARE * M)


def _to_host(values: torch.Tensor) -> torch.Tensor:
    """``[values..., tag]``: ``values`` (a few int64 counts on the device) copied to pinned host
    memory without blocking, over a -1 sentinel (every count is >= 0, so :func:`_host_counts`
    can tell when they have landed), and a tag (the buffer's address) that the host writes now,
    which any copy a saved-tensor hook makes keeps even if the counts have not landed. On the
    CPU (the Triton interpreter) the copy is immediate.

    The buffer is saved for the backward as a tensor and kept as a ctx attribute: under
    activation checkpointing the backward must read the counts of the recomputed forward (the
    saved tensor), consistent with the recomputed row list and ELL rows it also gets."""
    pinned = values.is_cuda
    host = torch.full((values.numel() + 1,), -1, dtype=torch.int64, pin_memory=pinned)
    host[-1] = host.data_ptr()
    host[:-1].copy_(values, non_blocking=pinned)
    return host


def _host_counts(saved: torch.Tensor, own: torch.Tensor, device: torch.device, limits: tuple) -> list[int]:
    """The counts of :func:`_to_host`, once its copy has landed (polling the pinned memory: a
    stream synchronisation would wait for everything queued after the copy too).

    ``saved``: the buffer as the saved-tensor hooks gave it back; ``own``: this node's forward's
    buffer (a ctx attribute). Same tag: the same forward, so ``own`` is read (a hook such as
    ``save_on_cpu(pin_memory=True)`` copies saved tensors when the forward returns, perhaps
    before the counts landed: its copy could keep the -1s); another tag: an activation
    checkpoint's recomputation, whose buffer (and row list) the checkpoint holds, so ``saved``
    is read. A value outside ``[0, limit]`` (not landed, or in the middle of landing) is read
    again; every 4096 polls the stream is asked (not synchronised) so that a CUDA error raises
    instead of leaving the loop waiting."""
    host = own if int(saved[-1]) == int(own[-1]) else saved

    def landed(values):
        return all(0 <= v <= lim for v, lim in zip(values, limits))

    values, spins = host[:-1].tolist(), 0
    if landed(values):
        return values
    if int(host[-1]) != host.data_ptr():
        # A copy taken before the counts landed (another buffer's tag): they never will in it. A
        # compiled graph under save_on_cpu hands the backward such a copy alone (it keeps no
        # forward buffer of its own to fall back on, as the eager ops do).
        raise RuntimeError("the sparse training op's backward got a copy of its forward's host counts taken before "
                           "they landed (saved-tensor hooks such as save_on_cpu around a compiled model?); "
                           "train such a model on the dense path (train_kernels='dense')")
    start = time.perf_counter()
    while not landed(values):
        spins += 1
        if spins % 4096 == 0 and device.type == "cuda":
            torch.cuda.current_stream(device).query()  # raises a sticky CUDA error instead of spinning forever
        time.sleep(0 if spins < 1000 else 1e-5)
        values = host[:-1].tolist()
    # (a layer timing its paths leaves the wait out of the op's host time: twell.training.path_timing)
    path_timing.add_host_wait(time.perf_counter() - start)
    return values


# Hot units: a unit held by more than max(HOT_MIN, HOT_SHARE x M, HOT_FACTOR x the mean)
# light-row slots gets its weight gradients from cuBLAS over a dense [M, n_hot] block instead of
# the per-unit kernel, whose one program per unit would otherwise walk thousands of tokens
# serially (skewed layers: a few units fire for a large share of the tokens). The column
# counterpart of the heavy rows. A unit's share of the dense block costs about the same at any fill
# (M d flops and a column of M values), its gathers about 1.6 ns per slot (M 16384, k 29 on an
# H100): the block pays from 1% to 2% of the tokens. On the H100 (forward + backward, forced sparse,
# against dense PyTorch; skewed layers, with the longest-first schedule below):
# - max(256, 2% M, 2 x mean) against max(256, 8 x mean): k 29 at M 16384 1.64x
#   against 1.48x (both in unit order), k 56 0.97x against 0.88x, k 29 at M 65536 1.69x
#   against 1.45x;
# - then HOT_SHARE 1/64 against 2%: k 8 2.23x against 2.21x, k 29 1.86x against 1.76x, k 56
#   1.19x against 1.04x, k 29 at M 65536 1.88x against 1.82x. (Part of that may be the count
#   of hot units, not the limit: cuBLAS is slow on [M, n] bf16 blocks whose rows are not
#   16-byte aligned, as the inference hot units found; a block padded to a multiple of 8
#   columns was not measured.)
HOT_MIN = 256
HOT_SHARE = 1 / 64
HOT_FACTOR = 2.0
# The hot units' dense blocks are [M, n] with n = n_hot rounded up to a multiple of HOT_ALIGN
# (zero columns past the hot units). 8 would give bf16 rows cuBLAS's 16-byte alignment, which
# the inference hot units need; not measured in training, so the default is 1 (no padding).
HOT_ALIGN = 1


def _hot_dense(cols, counts, hot, n_slots, f, *slot_values):
    """Dense ``[M, n]`` fp32 blocks of per-slot values (``[M, W]`` each, or None: None out) at
    the hot units' slots of the light rows (``n_slots`` of them, known on the host), column i
    for the unit ``hot[i]``; zero elsewhere, and in the columns past ``n_hot`` (``n`` is n_hot
    rounded up to a multiple of ``HOT_ALIGN``). No host sync."""
    M, W = cols.shape
    pos = torch.full((f,), -1, dtype=torch.int64, device=cols.device)
    pos[hot] = torch.arange(hot.numel(), device=cols.device)
    used = torch.arange(W, device=cols.device) < torch.where(counts > W, 0, counts).unsqueeze(1)
    slot_pos = torch.where(used, pos[cols.long()], -1)
    r, s = torch.nonzero_static(slot_pos >= 0, size=n_slots).unbind(1)
    c = slot_pos[r, s]
    out = []
    for v in slot_values:
        if v is None:
            out.append(None)
            continue
        block = torch.zeros(M, -(-hot.numel() // HOT_ALIGN) * HOT_ALIGN, dtype=torch.float32, device=cols.device)
        block[r, c] = v[r, s].float()
        out.append(block)
    return out


def _light_forward(x, a, W, w_down, w_up=None):
    """The forward from the pre-activation ``a [M, f]``, with no host sync: the ELL pack, the
    light rows' kernel (gated when ``w_up`` is given), the heavy rows and hot units found on the
    device, and the heavy rows' forward (:func:`twell.kernels.heavy_rows.heavy_rows_forward`,
    which writes their h over ``a``). Returns ``(cols, values, counts, y, u, l1, unit_counts,
    heavy, n_heavy, hot_mask, schedule, host)`` (values: g gated, h non-gated; u None non-gated; l1 the
    fp32 scalar L1 term; the rest as :func:`_heavy_and_hot` returns them, ``host`` its ``info``
    on its way to the host, :func:`_to_host`)."""
    M, f = a.shape
    cols, values, counts = pack_rows(a, W, **PACK_CONFIG)
    per_unit = light_unit_counts(cols, counts, f)
    heavy, n_heavy, hot_mask, info, schedule = _heavy_and_hot(counts, W, per_unit, f)
    host = _to_host(info)  # before the row kernels: the backward waits at most for this point
    y, u, l1_rows = ffn_rows_forward(x, cols, values, counts, _rows_of(w_down), w_up, **ROWS_CONFIG)
    # the heavy rows' unit counts are added to the light rows' (read above, in stream order)
    l1_heavy, unit_counts = heavy_rows_forward(x, a, heavy, n_heavy, y, w_down, w_up, unit_counts=per_unit, **HEAVY_CONFIG)
    l1 = (l1_rows + l1_heavy).sum() / max(M, 1)
    return cols, values, counts, y, u, l1, unit_counts, heavy, n_heavy, hot_mask, schedule, host


def kernel_layout(w: torch.Tensor) -> bool:
    """Whether the ``[d, f]`` weight ``w`` is the transpose of a contiguous ``[f, d]`` matrix (the
    layout the modules keep for the kernels): its rows of ``w^T`` are then read with no copy."""
    return w.dim() == 2 and not w.is_contiguous() and w.t().is_contiguous()


def _rows_of(w_down):
    """``w_down^T`` contiguous ``[f, d]``: row j = w_down[:, j], one contiguous read per unit for
    the row kernels."""
    return w_down.t().contiguous()


def _unit_weight_grads(x, dy, cols, counts, values, u, du, da, hot_mask, schedule, n_hot, n_hot_slots, base, f, dtype):
    """``(dw_up, dw_gate or None, dw_down_t)``: the light rows' share added to ``base`` (the heavy
    rows'), by the per-unit kernel over the slots sorted by unit (its programs taking the units in
    the order of ``schedule``, the longest first, while ``GRADS_LONGEST_FIRST``), except the
    ``n_hot`` hot units (``hot_mask``, holding ``n_hot_slots`` light slots), whose share is one
    cuBLAS product over their dense columns. Gated: values g, with u and da; non-gated: values
    h, u and da None."""
    order, offsets = unit_index(cols, counts, f, hot_mask if n_hot else None)
    units = schedule if GRADS_LONGEST_FIRST else None
    grads = ffn_weight_grads(order, offsets, x, dy, values, u, du, da, base=base, dtype=dtype, units=units, **GRADS_CONFIG)
    if n_hot:
        hot = torch.nonzero_static(hot_mask, size=n_hot).flatten()
        h = values if u is None else values.float() * u.float()
        _add_hot(grads, hot, _hot_dense(cols, counts, hot, n_hot_slots, f, du, da, h), (x, x, dy))
    return grads


def _add_hot(grads, hot, blocks, sources):
    """``grads[i][hot] += blocks[i]^T sources[i]`` (cuBLAS in the sources' dtype; None skipped;
    the blocks' columns past ``hot.numel()``, zero padding, dropped)."""
    n = hot.numel()
    for g, b, src in zip(grads, blocks, sources):
        if g is not None and b is not None:
            g[hot] += torch.mm(b.to(src.dtype).t(), src)[:n].to(g.dtype)


def _dense_rows(x_r, a_r, w_up, w_down):
    """The forward of rows held dense (every row of the dense op) from their pre-activation
    ``a_r``: ``(s, u, y, l1_rows, unit_counts, row_counts)``, ``s`` being what
    the backward needs besides u: a_r gated (it recomputes g and h), h non-gated (u None). The
    element-wise work is one pass (:func:`twell.kernels.dense_rows.dense_rows_forward`)."""
    u = None if w_up is None else torch.mm(x_r, w_up.t())
    h, l1_rows, unit_counts, row_counts = dense_rows_forward(a_r, u, check=False)  # (made by torch.mm here)
    y = torch.mm(h, w_down.t())
    return (h if u is None else a_r), u, y, l1_rows, unit_counts, row_counts


def _dense_rows_backward(x_r, dy_r, s, u, c, w_first, w_up, w_down, down_t=True, needs=(True, True, True, True),
                         c_scale=1.0):
    """The backward of rows held dense: ``(dx_r, (dw_up, dw_gate, dw_down))`` gated, ``(dx_r,
    (dw_first, None, dw_down))`` non-gated: their share of the weight gradients, ``dw_down`` as
    ``[f, d]`` (``down_t``: the layout the per-unit kernel adds the light rows into) or ``[d, f]``
    (w_down's own); ``s``, ``u`` as :func:`_dense_rows` returned them. ``needs``: whether dx,
    w_first's, w_up's and w_down's gradients are wanted (the others come back None and cost no
    product). Gated: dh stays fp32 until it is multiplied by g and u, as on the light rows,
    because the L1 term's c sign(h) is far below half a bf16 step of the product's (on-grid)
    values and would round away if added in bf16. Non-gated: dh is itself the weight-gradient
    operand, in the inputs' dtype, as in dense autograd. The element-wise work is one pass
    (:func:`twell.kernels.dense_rows.dense_rows_backward`)."""
    need_x, need_first, need_up, need_down = needs
    d1, da, h = dense_rows_backward(torch.mm(dy_r, w_down), s, u, c, c_scale, check=False)
    if u is None:  # d1 is dh, s is h
        h, d_first, d_up = s, d1, None
    else:  # d1 is du
        d_first, d_up = da, d1
    dx = None
    if need_x:
        dx = torch.mm(d_first, w_first)
        if d_up is not None:
            dx = torch.addmm(dx, d_up, w_up)
    dw_first = torch.mm(d_first.t(), x_r) if need_first else None
    dw_up = torch.mm(d_up.t(), x_r) if (d_up is not None and need_up) else None
    dw_down = None
    if need_down:
        dw_down = torch.mm(h.t(), dy_r) if down_t else torch.mm(dy_r.t(), h)
    return dx, ((dw_first, None) if u is None else (dw_up, dw_first)) + (dw_down,)


def _l1_scale(dl1: Optional[torch.Tensor], M: int, device) -> torch.Tensor:
    if dl1 is None:
        return torch.zeros(1, dtype=torch.float32, device=device)
    return (dl1.float() / max(M, 1)).reshape(1).contiguous()


def _heavy_backward(x, dy, heavy, n_heavy, c, w_first, w_up, w_down):
    """``(dx_h, base)`` of the heavy rows (:func:`_dense_rows_backward`), their a and u (h
    non-gated) recomputed from x: the forward kept no ``[n_heavy, f]`` tensor, since it could not
    size one without waiting for the GPU."""
    rows = heavy[:n_heavy]
    x_h = x[rows]
    a_h = torch.mm(x_h, w_first.t())
    if w_up is None:
        return _dense_rows_backward(x_h, dy[rows], torch.relu(a_h), None, c, w_first, None, w_down)
    return _dense_rows_backward(x_h, dy[rows], a_h, torch.mm(x_h, w_up.t()), c, w_first, w_up, w_down)


def _check_width(width, modes: bool = False) -> None:
    """A clear error unless ``width`` is an ELL width (an int >= 1; not a bool); with ``modes``
    also 0 (every row dense) or ``LAYER_CHOICE`` (the layer's choice), as the custom op takes."""
    if isinstance(width, bool) or not isinstance(width, int) or not (width >= 1 or (modes and width in (0, LAYER_CHOICE))):
        raise ValueError(f"width must be an int >= 1{' (or 0, or LAYER_CHOICE)' if modes else ''}, got {width!r}")


# --- one forward and one backward, behind two entry points ---------------------------------------
#
# Eager calls take TrainFFNFunction (an autograd.Function); calls that torch.compile traces take
# the custom ops twell::train_ffn_fwd / twell::train_ffn_bwd, which it keeps in its graph (an
# autograd.Function that launches Triton kernels and reads counts on the host cannot be traced).
# Both run _forward and _backward. Eager calls do not go through the custom ops: their dispatch
# (schema defaults, the generated autograd wrapper, a redispatch) took 80 us more host time than
# the autograd.Function's per forward and as much per backward (measured on a 2-core CPU: 115
# against 35 us per forward), which every layer of an eager step would pay.


def _forward(x, w_first, w_down, w_up, width, owner=None) -> tuple:
    """The FFN ``y = (relu(x w_first^T) * (x w_up^T)) w_down^T`` (gated; non-gated, ``w_up``
    None: ``relu(x w_first^T) w_down^T``), its L1 term and statistics, and what its backward
    needs: ``(y, l1, row_counts, unit_counts, n_heavy, values, u, cols, heavy, hot_mask,
    schedule, host)``, the first five as :class:`TrainFFNOutput` describes them.

    ``width`` >= 1: the sparse kernels at ELL width ``W = min(width, f)``: ``values [M, W]``
    (g gated, h non-gated), ``u [M, W]`` (gated), ``cols [M, W]``, ``heavy [M]`` int64,
    ``hot_mask [f]`` bool, ``schedule [f]`` int64, ``host [4]`` int64 on the CPU (pinned on
    CUDA; :func:`_to_host`). ``width`` 0: every row dense (:func:`_dense_forward`): ``values
    [M, f]`` (a gated, h non-gated), ``u [M, f]`` (gated), the rest None. ``LAYER_CHOICE``: the
    path and width that the module owning ``owner`` chooses (:func:`_layer_forward`). ``u`` is
    None non-gated."""
    _check_width(width, modes=True)
    if width == LAYER_CHOICE:
        return _layer_forward(x, w_first, w_down, w_up, owner)
    gated = w_up is not None
    W = _check_args(x, w_up if gated else w_first, w_down, w_first if gated else None, max(width, 1), sparse=width != 0)
    if width == 0:
        return _dense_forward(x, w_first, w_down, w_up)
    _refuse_capture(x)
    a = torch.mm(x, w_first.t())
    cols, values, counts, y, u, l1, unit_counts, heavy, n_heavy, hot_mask, schedule, host = _light_forward(x, a, W, w_down, w_up)
    del a
    return y, l1, counts, unit_counts, n_heavy, values, u, cols, heavy, hot_mask, schedule, host


def _dense_forward(x, w_first, w_down, w_up) -> tuple:
    """The FFN with every row held dense, with its L1 term and statistics: cuBLAS products and
    one fused element-wise pass each way (:mod:`twell.kernels.dense_rows`). What a layer trains
    with where the sparse kernels would not pay (``train_kernels = "dense"``, or ``"auto"`` on a
    layer with many active units, early in training before the L1 term has made it sparse, or
    on a call of fewer than ``twell.training.path.MIN_SPARSE_TOKENS`` tokens).

    Against dense autograd of the same math, which walks ``[M, f]`` tensors for relu, the
    product, ``|h|``, the active mask and their gradients (six to nine passes), this makes one
    pass each way and saves two ``[M, f]`` tensors (a and u; non-gated h) where autograd saves
    three; and it keeps the L1 term's gradient in fp32 until it meets g and u (in bf16 it would
    round away, see :func:`_dense_rows_backward`). Returns :func:`_forward`'s tuple."""
    M = x.shape[0]
    # the inputs' dtype throughout (autocast would recast the products, not the backward's)
    with autocast_off(x.device.type):
        a = torch.mm(x, w_first.t())
        s, u, y, l1_rows, unit_counts, row_counts = _dense_rows(x, a, w_up, w_down)
    del a
    n_heavy = torch.zeros((), dtype=torch.int64, device=x.device)
    # the mean over tokens (one launch; no tokens: 0, where the mean would be NaN)
    l1 = l1_rows.mean() if M else l1_rows.sum()
    return (y, l1, row_counts, unit_counts, n_heavy, s, u) + (None,) * 5


def _layer_forward(x, w_first, w_down, w_up, owner) -> tuple:
    """:func:`_forward` on the path and at the width that the twell module whose first
    projection's stored weight is ``owner`` chooses for this call
    (:func:`twell.training.path.call_choice`), which is noted in its state afterwards (its last
    path; on probe calls its row counts published). How a compiled module trains: the choice
    reads the layer's measured sparsity on the host at run time, inside the custom op, so that
    one compiled graph serves every layer and every choice. The layer is found from ``owner``
    (the module's own parameter, not the autocast copy the op computes with) as the inference op
    finds it (:func:`twell.inference.dispatch.layer_of_weight`). Weights no live module owns get
    the dense path, with a warning."""
    from ..inference.dispatch import layer_of_weight

    state = None if owner is None else layer_of_weight(owner)
    if state is None:
        warnings.warn("twell::train_ffn_fwd: no twell module owns this weight (copied by a compiler?); "
                      "training this call on the dense path", RuntimeWarning, stacklevel=2)
        return _forward(x, w_first, w_down, w_up, 0)
    module = state.module
    # no timing trials here (they time the module's eager calls); a verdict the layer has holds
    path, width = train_path.call_choice(module, x.shape[0], x.is_cuda, timed=False)
    out = _forward(x, w_first, w_down, w_up, width if path == "sparse" else 0)
    module._twell_train.note_call(path, out[2], module.intermediate_size)
    return out


def _backward(dy, dl1, x, w_first, w_down, w_up, counts, values, u, cols, heavy, hot_mask, schedule, host, own,
              needs) -> tuple:
    """``(dx [M, d], dw_first [f, d], dw_down [d, f], dw_up [f, d] or None)`` of a
    :func:`_forward` call, from the gradients of its y and l1 (``dy [M, d]``, ``dl1`` a scalar;
    None: zero) and what it saved (``counts`` is its row_counts; zero-size ``cols`` stand for
    None, as the custom op passes them). ``own``: the host buffer of this node's own forward
    (see :func:`_host_counts`). ``needs``: whether x's, w_first's, w_down's and w_up's gradients
    are wanted; the others come back None (the dense path skips their products, as dense
    autograd does). ``dw_down`` comes ``[f, d]``-major (a transposed view) from the sparse path
    and from the dense path where w_down is held so (:func:`kernel_layout`)."""
    need_x, need_first, need_down, need_up = needs
    gated = w_up is not None
    u = u if gated else None
    if dy is None:
        dy = torch.zeros_like(x)
    if cols is None or cols.shape[1] == 0:  # every row dense
        # w_down held as the transpose of a contiguous [f, d] matrix (the kernels' layout): its
        # gradient is made [f, d] and handed back transposed, in the parameter's own layout
        down_t = kernel_layout(w_down)
        with autocast_off(x.device.type):  # a backward run inside autocast too
            # the L1 gradient per |h| is dl1 / M, scaled in the element-wise kernel (no launch for it)
            dx, (dw_a, dw_b, dw_down) = _dense_rows_backward(x, dy.contiguous(), values, u, dl1, w_first, w_up, w_down,
                                                             down_t=down_t, needs=(need_x, need_first, need_up, need_down),
                                                             c_scale=1.0 / max(x.shape[0], 1))
        if down_t and dw_down is not None:
            dw_down = dw_down.t()
        return (dx, dw_b, dw_down, dw_a) if gated else (dx, dw_a, dw_down, None)  # gated: dw_a is w_up's
    _refuse_capture(x)
    M = x.shape[0]
    f = w_first.shape[0]
    dy = dy.contiguous()
    c = _l1_scale(dl1, M, x.device)
    up, gate = (w_up, w_first) if gated else (w_first, None)
    # The light rows' backward needs nothing from the host: queued before the wait for the
    # forward's counts, it keeps the GPU busy while the host waits and then issues the rest
    # (where the host is slower than the GPU, the GPU would otherwise idle for that issue time).
    dx, du, da = ffn_rows_backward(dy, cols, values, u, counts, _rows_of(w_down), up, gate, c, **ROWS_CONFIG)
    n_heavy, n_hot, n_hot_slots = _host_counts(host, own, x.device, (M, f, cols.numel()))
    base = None
    if n_heavy:
        dx[heavy[:n_heavy]], base = _heavy_backward(x, dy, heavy, n_heavy, c, w_first, w_up, w_down)
    dw_a, dw_b, dw_down_t = _unit_weight_grads(x, dy, cols, counts, values, u, du, da, hot_mask, schedule, n_hot,
                                               n_hot_slots, base, f, w_first.dtype)
    # dw_down_t is [f, d]; autograd lays the [d, f] view out as w_down's .grad
    grads = (dx, dw_b, dw_down_t.t(), dw_a) if gated else (dx, dw_a, dw_down_t.t(), None)
    return tuple(g if need else None for g, need in zip(grads, needs))


class TrainFFNFunction(torch.autograd.Function):
    """The training FFN in eager mode: ``apply(x, w_first, w_down, w_up, width, owner)`` ->
    ``(y, l1, row_counts, unit_counts, n_heavy)``, :func:`_forward`'s first five (the rest is
    saved for the backward, :func:`_backward`). ``w_first`` is w_gate gated, w_up non-gated (then
    ``w_up`` is None); ``width`` as :func:`_forward` takes it. Use :func:`sparse_gated_ffn`,
    :func:`sparse_ffn`, :func:`dense_gated_ffn` or :func:`dense_ffn`.
    """

    @staticmethod
    def forward(ctx, x, w_first, w_down, w_up, width, owner):
        out = _forward(x, w_first, w_down, w_up, width, owner)
        # This forward's own host buffer, beside the saved one (see _host_counts): under
        # save_on_cpu the saved one is a copy that may have been taken before the counts landed.
        ctx.host = out[11]
        sparse = out[7] is not None  # (the dense path's backward needs no row counts)
        ctx.save_for_backward(x, w_first, w_down, w_up, out[2] if sparse else None, *out[5:])
        ctx.mark_non_differentiable(*out[2:5])
        return out[:5]

    @staticmethod
    @once_differentiable
    def backward(ctx, dy, dl1, *_):
        return (*_backward(dy, dl1, *ctx.saved_tensors, ctx.host, ctx.needs_input_grad[:4]), None, None)


# twell::train_ffn_fwd returns _forward's twelve tensors; where _forward gives None it returns a
# zero-size tensor (a custom op's outputs are tensors of a fixed count). Its fake implementation
# gives each output's shape: fixed for a width >= 1 or 0; for LAYER_CHOICE the sizes that depend
# on the layer's choice (ELL width or f, and which of the sparse path's tensors exist) are
# unbacked sizes, so that the compiled graph takes whichever path the layer picks at run time.
_FWD_SCHEMA = ("(Tensor x, Tensor w_first, Tensor w_down, Tensor? w_up, int width, Tensor? owner) -> "
               "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
_BWD_SCHEMA = ("(Tensor? dy, Tensor? dl1, Tensor x, Tensor w_first, Tensor w_down, Tensor? w_up, Tensor row_counts, "
               "Tensor values, Tensor u, Tensor cols, Tensor heavy, Tensor hot_mask, Tensor schedule, Tensor host, "
               "Tensor own_host, bool[] needs) -> Tensor[]")


@torch.library.custom_op("twell::train_ffn_fwd", mutates_args=(), schema=_FWD_SCHEMA)
def train_ffn_fwd(x, w_first, w_down, w_up, width, owner):
    """:func:`_forward` as a custom op (see ``_FWD_SCHEMA``): ``(y [M, d], l1 [], row_counts [M]
    int32, unit_counts [f] int64, n_heavy [] int64, values, u, cols, heavy, hot_mask, schedule,
    host)``, zero-size where :func:`_forward` gives None (``u [M, 0]``, ``cols [M, 0]``, the
    rest ``[0]``). ``host`` is ``[3]``: the buffer of :func:`_to_host` less its tag (the
    buffer's address, which no two calls share: not a result), a view that keeps it in its
    storage for the backward (:func:`_tagged`)."""
    out = _forward(x, w_first, w_down, w_up, width, owner)
    M, f = x.shape[0], w_first.shape[0]
    none = (x.new_empty(M, 0), x.new_empty((M, 0), dtype=col_dtype(f)), x.new_empty(0, dtype=torch.int64),
            x.new_empty(0, dtype=torch.bool), x.new_empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64))
    out = out[:6] + tuple(n if t is None else t for t, n in zip(out[6:], none))
    return out[:11] + (out[11][:-1] if out[7].shape[1] else out[11],)


def _tagged(host: torch.Tensor) -> torch.Tensor:
    """The whole :func:`_to_host` buffer, tag included, behind the op's ``host`` output (a view
    of it less its last element), as :func:`_host_counts` reads it; a copy that a saved-tensor
    hook made of the view holds no tag: it gets -1 (no buffer's address)."""
    n = host.numel() + 1
    if host.storage_offset() == 0 and host.untyped_storage().nbytes() >= n * host.element_size():
        return host.as_strided((n,), (1,))
    return torch.cat([host, host.new_full((1,), -1)])


@train_ffn_fwd.register_fake
def _train_ffn_fwd_fake(x, w_first, w_down, w_up, width, owner):
    _check_width(width, modes=True)
    gated = w_up is not None
    # the same checks as the real op: meta tensors (which take this implementation) fail here too
    W = _check_args(x, w_up if gated else w_first, w_down, w_first if gated else None, max(width, 1))
    M, d = x.shape
    f = w_first.shape[0]
    if width == LAYER_CHOICE:  # values' and u's width (W or f), cols' (W or 0), heavy's, hot_mask's, host's
        k, kc, kh, kf, kn = (_run_time_size() for _ in range(5))
    elif width == 0:
        k, kc, kh, kf, kn = f, 0, 0, 0, 0
    else:
        k, kc, kh, kf, kn = W, W, M, f, 3
    i64 = torch.int64
    return (x.new_empty(M, d), x.new_empty((), dtype=torch.float32), x.new_empty(M, dtype=torch.int32),
            x.new_empty(f, dtype=i64), x.new_empty((), dtype=i64), x.new_empty(M, k), x.new_empty(M, k if gated else 0),
            x.new_empty((M, kc), dtype=col_dtype(f)), x.new_empty(kh, dtype=i64), x.new_empty(kf, dtype=torch.bool),
            x.new_empty(kf, dtype=i64), torch.empty(kn, dtype=i64, device="cpu"))


def _run_time_size():
    """A size the layer's choice sets at run time, in a fake implementation (an unbacked SymInt).
    ``ctx.new_dynamic_size()`` makes one only where dynamo captures operators of data-dependent
    output shape (``fullgraph=True``, or ``capture_dynamic_output_shape_ops``); elsewhere it
    raises, and dynamo would break the graph at every compiled layer's MLP. Every backend that
    runs this op handles such sizes (inductor binds them from the op's outputs; the sparse op
    cannot be captured in CUDA graphs anyway), so it is made directly in that case."""
    ctx = torch.library.get_ctx()
    shape_env = getattr(ctx, "_shape_env", None)
    try:
        from torch._library.fake_impl import allocate_size
    except ImportError:  # (a torch without it: a graph break, as new_dynamic_size makes)
        allocate_size = None
    if shape_env is None or shape_env.allow_dynamic_output_shape_ops or allocate_size is None:
        return ctx.new_dynamic_size()
    return allocate_size(shape_env)


@torch.library.custom_op("twell::train_ffn_bwd", mutates_args=(), schema=_BWD_SCHEMA)
def train_ffn_bwd(dy, dl1, x, w_first, w_down, w_up, row_counts, values, u, cols, heavy, hot_mask, schedule, host,
                  own_host, needs):
    """:func:`_backward` as a custom op (see ``_BWD_SCHEMA``): ``[dx [M, d], dw_first [f, d],
    dw_down [d, f]]`` and ``dw_up [f, d]`` gated; a gradient not in ``needs`` comes back as a
    ``[0]`` tensor. ``dw_down`` is laid out as w_down is (:func:`kernel_layout`: ``[f, d]``-major,
    else contiguous), whichever path ran, as the fake implementation says."""
    if cols.shape[1]:
        host, own_host = _tagged(host), _tagged(own_host)
    grads = list(_backward(dy, dl1, x, w_first, w_down, w_up, row_counts, values, u, cols, heavy, hot_mask, schedule,
                           host, own_host, needs))
    if grads[2] is not None and not kernel_layout(w_down):
        grads[2] = grads[2].contiguous()  # the sparse path's is [f, d]-major (autograd would copy it so too)
    return [x.new_empty(0) if g is None else g for g in grads[:3 if w_up is None else 4]]


@train_ffn_bwd.register_fake
def _train_ffn_bwd_fake(dy, dl1, x, w_first, w_down, w_up, row_counts, values, u, cols, heavy, hot_mask, schedule,
                        host, own_host, needs):
    M, d = x.shape
    f = w_first.shape[0]
    dw_down = w_down.new_empty(f, d).t() if kernel_layout(w_down) else w_down.new_empty(d, f)
    grads = (x.new_empty(M, d), w_first.new_empty(f, d), dw_down, w_first.new_empty(f, d))
    return [g if need else x.new_empty(0) for g, need in zip(grads[:3 if w_up is None else 4], needs)]


def _op_setup(ctx, inputs, output):
    x, w_first, w_down, w_up, _, _ = inputs
    # No zero gradients made for the outputs that only the backward reads (or for an unused y)
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(*output[2:])
    ctx.host = output[11]  # this forward's own host buffer, as TrainFFNFunction keeps it
    ctx.save_for_backward(x, w_first, w_down, w_up, output[2], *output[5:])


def _op_backward(ctx, dy, dl1, *_):
    needs = [bool(n) for n in ctx.needs_input_grad[:4]]
    grads = torch.ops.twell.train_ffn_bwd(dy, dl1, *ctx.saved_tensors, ctx.host, needs)
    grads = [g if need else None for g, need in zip(grads, needs)]
    return (*grads, *[None] * (4 - len(grads)), None, None)


train_ffn_fwd.register_autograd(_op_backward, setup_context=_op_setup)


def _train_ffn(x, w_first, w_down, w_up, width, owner=None) -> TrainFFNOutput:
    """:func:`_forward` with autograd: through the custom op while torch.compile traces, else
    through :class:`TrainFFNFunction` (the same computation)."""
    if torch.compiler.is_compiling():
        out = torch.ops.twell.train_ffn_fwd(x, w_first, w_down, w_up, width, owner)
    else:
        out = TrainFFNFunction.apply(x, w_first, w_down, w_up, width, owner)
    return TrainFFNOutput(*out[:5])


def sparse_gated_ffn(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, width: int) -> TrainFFNOutput:
    """Gated FFN for training on the hybrid format, with its L1 term.

    Args:
        x: ``[M, d]`` contiguous tokens (fp32, fp16 or bf16; CUDA, or CPU under the Triton
            interpreter).
        w_gate, w_up: ``[f, d]`` (nn.Linear layout, unit-stride rows); w_down: ``[d, f]``; all
            of x's dtype and device.
        width: ELL width W (see :func:`choose_width`); rows with more active units take the
            dense backup. Values above f are treated as f.

    Returns:
        :class:`TrainFFNOutput`; ``y`` and ``l1`` carry gradients to x and the three weights
        equal to dense autograd's of ``(relu(x w_gate^T) * (x w_up^T)) w_down^T`` and
        ``l1_penalty(h)`` up to rounding. With M = 0, l1 is 0. Under ``torch.compile`` the call
        is the custom op ``twell::train_ffn_fwd`` (no graph break).
    """
    _check_width(width)
    return _train_ffn(x, w_gate, w_down, w_up, width)


def sparse_ffn(x: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, width: int) -> TrainFFNOutput:
    """Non-gated FFN ``y = relu(x w_up^T) w_down^T`` for training; as :func:`sparse_gated_ffn`."""
    _check_width(width)
    return _train_ffn(x, w_up, w_down, None, width)


def dense_gated_ffn(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> TrainFFNOutput:
    """Gated FFN for training with every row dense (:func:`_dense_forward`), with its L1 term
    and statistics; arguments and result as :func:`sparse_gated_ffn` (no width; ``n_heavy`` is
    0: no row takes a backup, all are dense). It runs in the inputs' dtype whatever autocast
    says (cast them first, as the modules do); its backward is not itself differentiable (no
    double backward), as with the sparse op."""
    return _train_ffn(x, w_gate, w_down, w_up, 0)


def dense_ffn(x: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> TrainFFNOutput:
    """Non-gated FFN ``y = relu(x w_up^T) w_down^T`` for training, every row dense; as
    :func:`dense_gated_ffn`."""
    return _train_ffn(x, w_up, w_down, None, 0)


def layer_ffn(x: torch.Tensor, w_first: torch.Tensor, w_down: torch.Tensor, w_up: Optional[torch.Tensor],
              owner: torch.Tensor) -> TrainFFNOutput:
    """The training FFN of a twell module on the path and at the width the module chooses at run
    time (:func:`_layer_forward`): how a module traced by ``torch.compile`` trains. ``x [M, d]``
    contiguous; ``w_first [f, d]`` (w_gate gated, w_up non-gated), ``w_down [d, f]``, ``w_up
    [f, d]`` or None (non-gated), as the module computes with them (autocast copies included);
    ``owner``: the module's own first-projection weight, which names the layer."""
    return _train_ffn(x, w_first, w_down, w_up, LAYER_CHOICE, owner)


def saved_bytes(fn: Callable[..., object], *inputs: torch.Tensor) -> int:
    """Bytes that autograd keeps for the backward of ``fn(*inputs)``, besides the inputs.

    Runs ``fn`` once (inputs that are floating tensors are detached and made to require grad)
    and sums, over the distinct tensors saved for backward, those that share no storage with an
    input: for :func:`sparse_gated_ffn` with inputs (x, w_gate, w_up, w_down) that is the ELL
    rows, counts, the heavy rows' list, the hot units' mask and the schedule; for the dense FFN, its
    ``[M, f]`` intermediates. x
    and the weights, which both keep, are not counted.

    Example::

        saved_bytes(lambda *t: sparse_gated_ffn(*t, 64), x, w_gate, w_up, w_down)
    """
    leaves = [t.detach().requires_grad_(t.is_floating_point()) if isinstance(t, torch.Tensor) else t for t in inputs]
    input_storages = {t.untyped_storage().data_ptr() for t in leaves if isinstance(t, torch.Tensor)}
    seen: dict[tuple, int] = {}

    def pack(t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in input_storages:
            seen[(ptr, t.storage_offset(), tuple(t.shape), t.dtype)] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*leaves)
    return sum(seen.values())

"""Sparse FFN training kernels (twell.training.ops on twell.kernels.train_ffn) against dense
PyTorch autograd: y, l1 and every gradient, with the L1 term in the loss, on adversarial
patterns (Triton interpreter on the CPU in fp32/fp16; GPU tests in bf16 at real shapes).

Patterns are set by construction: column 0 of x is 1 and column 0 of w_gate holds minus a
threshold (the density), and then single rows and units are edited (see ``make_case``)."""

from __future__ import annotations

import math

import pytest
import torch

import twell.training.ops as T
from kernel_cases import GUARD, case_id, guard_empty, rel_err, untouched
from twell import reference as R
from twell.format import pack_hybrid
from twell.kernels.train_ffn import pack_rows
from twell.training.ops import choose_width, saved_bytes, sparse_ffn, sparse_gated_ffn

# Small blocks, so that every loop of the kernels runs more than once at test shapes: pack walks
# f in 32-column steps (one bit word), the row kernels take 4 slots and 32 columns of d per step (d = 40 here), the
# weight gradients 4 (token, slot) pairs per step, the heavy rows 16 x 16 tiles in 16-wide steps
# (with two programs along the rows on the CPU: each walks more than one block of 16 rows
# from 33 heavy rows on).
SMALL = dict(
    PACK_CONFIG=dict(block_m=2, block_f=32, num_warps=1),
    ROWS_CONFIG=dict(block_e=4, block_d=32, num_warps=1),
    GRADS_CONFIG=dict(block_t=4, block_d=32, num_warps=1, split=True),  # as shipped: two launches
    HEAVY_CONFIG=dict(block_m=16, block_n=16, block_k=16, num_warps=1, num_stages=1),
)
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the Triton interpreter
TOL = {torch.float32: 2e-6, torch.float16: 3e-3, torch.bfloat16: 1.5e-2}
DEAD, ONLY_HEAVY, HOT = 10, 70, 3  # units of make_case(adversarial=True), f = 75


# The same with block_d None: rows of d whole in registers, the whole-row kernels (d <= FULL_D_MAX).
SMALL_FULL = {name: {**cfg, "block_d": None} if "block_d" in cfg else cfg for name, cfg in SMALL.items()}


@pytest.fixture(params=["blocked", "one-pass"])
def small_blocks(request, monkeypatch):
    for name, cfg in (SMALL if request.param == "blocked" else SMALL_FULL).items():
        monkeypatch.setattr(T, name, cfg)


def make_case(M, d, f, seed=0, density=0.12, adversarial=True):
    """``(x [M, d], w_gate [f, d], w_up [f, d], w_down [d, f])`` in float64.

    adversarial (needs M >= 8, f = 75): row 1 has no active unit (x[1] = 0: every gate is
    exactly 0, and relu'(0) = 0), row 2
    every unit (heavy), row 5 about half (heavy); unit DEAD never fires (its gate is exactly 0),
    unit ONLY_HEAVY fires only in heavy rows (2, perhaps 5), unit HOT fires in every row with x[m, 0] = 1."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, d, generator=g, dtype=torch.float64)
    wg = torch.randn(f, d, generator=g, dtype=torch.float64) / math.sqrt(d - 1)
    x[:, 0] = 1.0
    wg[:, 0] = -float(torch.special.ndtri(torch.tensor(1.0 - density, dtype=torch.float64)))
    if adversarial:
        x[1] = 0.0
        x[2, 0] = -40.0
        x[5, 0] = 0.0
        wg[DEAD] = 0.0
        wg[ONLY_HEAVY, 0] = -30.0  # a = -30 + z where x[m, 0] = 1, +1200 in row 2
        wg[HOT, 0] = 30.0
    wu = torch.randn(f, d, generator=g, dtype=torch.float64) / math.sqrt(d)
    wd = torch.randn(d, f, generator=g, dtype=torch.float64) / math.sqrt(f)
    return tuple(t.to(DEV) for t in (x, wg, wu, wd))


def dense_ffn(x, wg, wu, wd):
    """The dense oracle: y and the L1 term (reference.l1_penalty) of the gated or plain FFN."""
    h = torch.relu(x @ wg.T) * (x @ wu.T) if wu is not None else torch.relu(x @ wg.T)
    return h @ wd.T, R.l1_penalty(h)


def run(fn, tensors, r, lam):
    """Leaves from ``tensors``, ``out = fn(*leaves)``, backward of (y r).sum() + lam l1."""
    leaves = [t.clone().requires_grad_() for t in tensors]
    out = fn(*leaves)
    y, l1 = out[0], out[1]
    ((y * r).sum() + lam * l1).backward()
    detached = [t.detach() for t in out]
    return (type(out)(*detached) if hasattr(out, "_fields") else detached), [t.grad for t in leaves]


def compare(tensors, width, dtype, gated=True, lam=0.37, seed=1, op="sparse"):
    """Run the sparse op (``op`` "dense": the all-rows-dense op, width unused) in ``dtype`` and
    dense autograd in float64 on the same (rounded) inputs; check y, l1, every gradient and the
    statistics. Returns (out, grads, dense grads)."""
    tensors = [t.to(dtype) for t in tensors]
    M, d = tensors[0].shape
    r = torch.randn(M, d, generator=torch.Generator().manual_seed(seed)).to(DEV, dtype)  # both see the same r
    if op == "dense":
        fn = T.dense_gated_ffn if gated else T.dense_ffn
    else:
        fn = (lambda *t: sparse_gated_ffn(*t, width)) if gated else (lambda *t: sparse_ffn(*t, width))
    out, grads = run(fn, tensors, r, lam)
    if gated:
        ref, ref_grads = run(lambda x, wg, wu, wd: dense_ffn(x, wg, wu, wd), [t.double() for t in tensors], r.double(), lam)
    else:
        ref, ref_grads = run(lambda x, wu, wd: dense_ffn(x, wu, None, wd), [t.double() for t in tensors], r.double(), lam)
    assert out.y.dtype == dtype and out.y.shape == (M, d)
    assert out.l1.dtype == torch.float32 and out.l1.dim() == 0
    tol = TOL[dtype]
    assert rel_err(out.y, ref[0]) < tol
    assert abs(float(out.l1) - float(ref[1])) <= tol * max(float(ref[1]), 1e-30)
    for name, gr, gr_ref, t in zip(("dx", "dw_gate", "dw_up", "dw_down") if gated else ("dx", "dw_up", "dw_down"), grads, ref_grads, tensors):
        assert gr.dtype == dtype and gr.shape == t.shape, name
        assert rel_err(gr, gr_ref) < tol, (name, rel_err(gr, gr_ref))
    a = tensors[0] @ tensors[1].T
    assert out.row_counts.dtype == torch.int32 and torch.equal(out.row_counts.long(), (a > 0).sum(1))
    assert out.unit_counts.dtype == torch.int64 and torch.equal(out.unit_counts, (a > 0).sum(0))
    W = min(width, a.shape[1])
    heavy = 0 if op == "dense" else int(((a > 0).sum(1) > W).sum())
    assert out.n_heavy.dtype == torch.int64 and int(out.n_heavy) == heavy
    for t in (out.row_counts, out.unit_counts, out.n_heavy):
        assert not t.requires_grad
    return out, grads, ref_grads


def boundary_width(tensors):
    """A width W such that some row has exactly W active units (light, every slot used), some
    has more (heavy) and at least half the rows have fewer."""
    counts = ((tensors[0] @ tensors[1].T) > 0).sum(1)
    for c in sorted(set(counts.tolist())):
        if c >= 2 and int((counts < c).sum()) >= counts.numel() // 2:
            assert bool((counts > c).any())
            return c
    raise AssertionError("no boundary width in this case")


def test_pack_rows():
    """Light rows as pack_hybrid stores them; slots past the count written as zeros. (First in
    the file: a wrong pack leaves stray columns that later tests would gather out of bounds.)"""
    x, wg, _, _ = (t.float() for t in make_case(13, 40, 75, seed=10))
    a = x @ wg.T
    cols, vals, counts = pack_rows(a, 12, block_m=4, block_f=32, num_warps=1)
    ref = pack_hybrid(torch.relu(a), width=12)
    assert cols.dtype == torch.int16 and torch.equal(counts, ref.counts)
    light = counts <= 12
    assert torch.equal(cols[light].int(), ref.cols[light]) and torch.equal(vals[light], ref.values[light])
    used = torch.arange(12, device=DEV) < counts.unsqueeze(1)
    assert torch.all(vals[~used] == 0) and torch.all(cols[~used] == 0)
    heavy = ~light  # the first W entries of a heavy row
    nz = torch.nonzero(a[heavy][0] > 0).flatten()[:12]
    assert torch.equal(cols[heavy][0].long(), nz)


@pytest.mark.parametrize("dtype,M", [(torch.float32, 37), (torch.float16, 16), (torch.bfloat16, 16)], ids=case_id)
def test_gated_adversarial(dtype, M, small_blocks):
    """Empty, full, heavy and exactly-W rows; a dead unit, a unit fed only by a heavy row, a hot
    unit; M, d, f multiples of no block."""
    tensors = make_case(M, 40, 75)
    W = boundary_width(tensors)
    out, grads, ref_grads = compare(tensors, W, dtype)
    assert int(out.n_heavy) >= 3 and int(out.row_counts[1]) == 0 and int(out.row_counts[2]) == 73  # all but DEAD and HOT
    a = tensors[0].to(dtype) @ tensors[1].to(dtype).T
    fired = a[:, ONLY_HEAVY] > 0
    assert int(out.unit_counts[DEAD]) == 0 and bool(fired.any()) and bool(torch.all(out.row_counts[fired] > W))
    assert torch.all(out.y[1] == 0)
    dx, dwg, dwu, dwd = grads
    # a unit with no token gets exact zero gradients (dense's are exact zeros too)
    assert torch.all(dwg[DEAD] == 0) and torch.all(dwu[DEAD] == 0) and torch.all(dwd[:, DEAD] == 0)
    # the unit fed only by heavy rows: its gradients come from the dense backup alone
    assert rel_err(dwu[ONLY_HEAVY], ref_grads[2][ONLY_HEAVY]) < TOL[dtype]
    assert rel_err(dwd[:, ONLY_HEAVY], ref_grads[3][:, ONLY_HEAVY]) < TOL[dtype]


def test_gated_single_row():
    """M = 1, with the launchers' default blocks."""
    x, wg, wu, wd = make_case(1, 24, 37, seed=4, adversarial=False)
    out, _, _ = compare((x, wg, wu, wd), 16, torch.float32)
    assert int(out.row_counts[0]) > 0


@pytest.mark.parametrize("M", [9, 70])
@pytest.mark.parametrize("gated", [True, False])
def test_every_row_heavy(M, gated, small_blocks):
    """Every row heavier than W (at M 70 the heavy rows' programs walk several blocks of rows)."""
    x, wg, wu, wd = make_case(M, 40, 75, seed=5, density=0.4, adversarial=False)
    out, _, _ = compare((x, wg, wu, wd) if gated else (x, wg, wd), 4, torch.float32, gated=gated)
    assert int(out.n_heavy) == M


def _saved_shapes(fn, tensors):
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    leaves = [t.clone().requires_grad_() for t in tensors]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*leaves)
    return shapes


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("width", [4, 12])
def test_mostly_heavy_saves_no_dense_rows(gated, width, monkeypatch):
    """Most rows heavy (a share of about 0.7 to 1): the same outputs, gradients and counts as
    dense autograd, and still nothing [M, f]-sized saved for the backward (the heavy rows' a and
    u are recomputed there from x), only the ELL rows."""
    monkeypatch.setattr(T, "ROWS_CONFIG", SMALL_FULL["ROWS_CONFIG"])
    x, wg, wu, wd = (t.float() for t in make_case(37, 40, 75, seed=12, density=0.3, adversarial=False))
    tensors = (x, wg, wu, wd) if gated else (x, wg, wd)
    fn = (lambda *t: sparse_gated_ffn(*t, width)) if gated else (lambda *t: sparse_ffn(*t, width))
    share = float((((x @ wg.T) > 0).sum(1) > width).float().mean())
    assert share > 0.6, share
    out, _, _ = compare(tensors, width, torch.float32, gated=gated)
    assert int(out.n_heavy) == round(share * 37)
    shapes = _saved_shapes(fn, tensors)
    assert (37, 75) not in shapes and (37, width) in shapes


@pytest.mark.parametrize("op", ["sparse", "dense"])
def test_rows_held_dense_keep_the_l1_gradient_in_bf16(op, monkeypatch):
    """At training's scale (lam 2e-5, dy of order 1/M) the L1 term's gradient c sign(h) is far
    below half a bf16 step of dy . w_down: the backward of rows held dense (the sparse op's heavy
    rows, here most rows, and the all-rows-dense op) must add it in fp32 before the products
    with g and u (as the light rows do), or it rounds away. The L1 part of dW_gate in bf16 (with lam minus
    without) must point the way fp64's does."""
    monkeypatch.setattr(T, "ROWS_CONFIG", SMALL_FULL["ROWS_CONFIG"])
    x, wg, wu, wd = make_case(512, 40, 75, seed=12, density=0.3, adversarial=False)
    r = torch.randn(512, 40, generator=torch.Generator().manual_seed(1)).to(DEV) / 512

    def l1_part(fn, tensors):
        out = []
        for lam in (2e-5, 0.0):
            leaves = [t.clone().requires_grad_() for t in tensors]
            y, l1 = fn(*leaves)[:2]
            ((y * r.to(y.dtype)).sum() + lam * l1).backward()
            out.append(leaves[1].grad.double())
        return out[0] - out[1]

    ref = l1_part(dense_ffn, [t.double() for t in (x, wg, wu, wd)])
    fn = (lambda *t: sparse_gated_ffn(*t, 4)) if op == "sparse" else T.dense_gated_ffn
    got = l1_part(fn, [t.bfloat16() for t in (x, wg, wu, wd)])
    if op == "sparse":
        assert float((((x @ wg.T) > 0).sum(1) > 4).float().mean()) > 0.6  # mostly heavy rows
    assert float((got * ref).sum() / (ref * ref).sum()) > 0.5


@pytest.mark.parametrize("dtype,M", [(torch.float32, 37), (torch.float16, 16), (torch.float32, 1)], ids=case_id)
@pytest.mark.parametrize("gated", [True, False])
def test_dense_op_adversarial(dtype, M, gated):
    """The all-rows-dense training op (a layer's dense path) on the adversarial case (an empty
    row, rows of every unit, a dead unit, a hot unit; M, d, f multiples of no block): y, l1,
    every gradient and the statistics as dense autograd's."""
    x, wg, wu, wd = make_case(M, 40, 75, seed=13, adversarial=M >= 8)
    out, grads, _ = compare((x, wg, wu, wd) if gated else (x, wg, wd), 1, dtype, gated=gated, op="dense")
    if M >= 8:
        assert int(out.row_counts[1]) == 0 and int(out.unit_counts[DEAD]) == 0
        assert torch.all(grads[1][DEAD] == 0) and torch.all(grads[-1][:, DEAD] == 0)


@pytest.mark.parametrize("op", ["sparse", "dense"])
@pytest.mark.parametrize("gated", [True, False])
def test_w_down_in_the_kernel_layout(op, gated):
    """w_down held as the transpose of a contiguous [f, d] matrix (the modules' kernel layout):
    the same outputs and gradients as the nn.Linear layout, and w_down's gradient comes back in
    its own layout (autograd then keeps it as is, where otherwise it copies)."""
    x, wg, wu, wd = (t.float() for t in make_case(37, 40, 75, seed=21))
    wd_k = wd.t().contiguous().t()
    assert T.kernel_layout(wd_k) and not T.kernel_layout(wd) and not T.kernel_layout(wd[:, :10].t())
    r = torch.randn(37, 40, generator=torch.Generator().manual_seed(4)).to(DEV)
    width = 12
    if op == "dense":
        fn = T.dense_gated_ffn if gated else T.dense_ffn
    else:
        fn = (lambda *t: sparse_gated_ffn(*t, width)) if gated else (lambda *t: sparse_ffn(*t, width))
    outs, grads = [], []
    for w in (wd, wd_k):
        leaves = [t.clone().requires_grad_() for t in ((x, wg, wu) if gated else (x, wg))]
        w_leaf = w.detach().clone() if w.is_contiguous() else w.detach().t().clone().t()
        w_leaf.requires_grad_()
        out = fn(*leaves, w_leaf)
        g = torch.autograd.grad((out.y * r).sum() + 0.3 * out.l1, (*leaves, w_leaf))
        assert g[-1].stride() == w_leaf.stride() or w_leaf.is_contiguous()
        outs.append(out.y)
        grads.append(g)
    assert g[-1].stride() == (1, 40)  # the kernel layout's own strides
    assert rel_err(outs[1], outs[0]) < 1e-6
    for a, b in zip(*grads):
        assert rel_err(b, a) < 1e-6


def test_dense_op_empty_and_saved_tensors():
    """M = 0: zeros, no NaN. Saved for backward: two [M, f] tensors gated (a and u), one
    non-gated (h), where dense autograd keeps three gated."""
    x, wg, wu, wd = (t.float() for t in make_case(0, 40, 75, seed=3, adversarial=False))
    out, grads = run(T.dense_gated_ffn, (x, wg, wu, wd), torch.zeros(0, 40, device=DEV), 0.5)
    assert float(out.l1) == 0.0 and out.y.shape == (0, 40)
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)
    x, wg, wu, wd = (t.float() for t in make_case(37, 40, 75, seed=3))
    assert _saved_shapes(T.dense_gated_ffn, (x, wg, wu, wd)).count((37, 75)) == 2
    assert _saved_shapes(T.dense_ffn, (x, wg, wd)).count((37, 75)) == 1
    assert saved_bytes(T.dense_gated_ffn, x, wg, wu, wd) < saved_bytes(dense_ffn, x, wg, wu, wd)


def test_dense_op_only_the_gradients_asked_for_and_ignores_autocast():
    """Frozen weights get no gradient (and cost no product); under autocast the op keeps its
    inputs' dtype in the forward and the backward (autocast would otherwise recast only the
    forward's products)."""
    x, wg, wu, wd = (t.float() for t in make_case(37, 40, 75, seed=14))
    r = torch.randn(37, 40, generator=torch.Generator().manual_seed(3)).to(DEV)
    xl = x.clone().requires_grad_()
    wul = wu.clone().requires_grad_()
    out = T.dense_gated_ffn(xl, wg, wul, wd)
    ((out.y * r).sum() + 0.3 * out.l1).backward()
    _, ref = run(T.dense_gated_ffn, (x, wg, wu, wd), r, 0.3)
    assert torch.equal(xl.grad, ref[0]) and torch.equal(wul.grad, ref[2])
    with torch.autocast(DEV, dtype=torch.bfloat16):
        out, grads = run(T.dense_gated_ffn, (x, wg, wu, wd), r, 0.3)
    assert out.y.dtype == torch.float32 and all(g.dtype == torch.float32 for g in grads)
    for g, g_ref in zip(grads, ref):
        assert rel_err(g, g_ref) < 1e-6


def test_all_units_active(small_blocks):
    """a = +1 everywhere and W = f (and a width above f): every row fills its ELL row, none is heavy."""
    x, wg, wu, wd = make_case(3, 24, 21, seed=6, adversarial=False)
    wg.zero_()
    wg[:, 0] = 1.0
    for width in (21, 200):
        out, _, _ = compare((x, wg, wu, wd), width, torch.float32)
        assert int(out.n_heavy) == 0 and torch.all(out.row_counts == 21)


def test_no_active_unit(small_blocks):
    """No positive at all: y, l1 and every gradient are exact zeros (no NaN)."""
    x, wg, wu, wd = make_case(11, 40, 75, seed=7, adversarial=False)
    wg[:, 0] = -100.0
    out, grads, ref_grads = compare((x, wg, wu, wd), 16, torch.float32)
    assert float(out.l1) == 0.0 and torch.equal(out.y, torch.zeros_like(out.y))
    for gr in grads:
        assert torch.equal(gr, torch.zeros_like(gr))
    assert int(out.unit_counts.sum()) == 0


def test_non_gated(small_blocks):
    x, wg, _, wd = make_case(37, 40, 75, seed=8)
    W = boundary_width((x, wg))
    out, grads, _ = compare((x, wg, wd), W, torch.float32, gated=False)
    assert int(out.n_heavy) >= 3
    assert torch.all(grads[1][DEAD] == 0) and torch.all(grads[2][:, DEAD] == 0)


def test_matches_hybrid_reference():
    """Same gradients as reference.gated_mlp_backward on the gate in Hybrid form, with
    l1_coef = lam / M, which is what the l1 output's gradient feeds into dh."""
    x, wg, wu, wd = (t.float() for t in make_case(37, 40, 75, seed=9))
    lam, M = 0.5, 37
    dy = torch.randn(M, 40, generator=torch.Generator().manual_seed(2)).to(DEV)
    _, grads = run(lambda *t: sparse_gated_ffn(*t, 12), (x, wg, wu, wd), dy, lam)
    g = pack_hybrid(torch.relu(x @ wg.T), width=12)
    ref = R.gated_mlp_backward(x, g, wg, wu, wd, dy, l1_coef=lam / M)
    for gr, gr_ref in zip(grads, ref):
        assert rel_err(gr, gr_ref) < 2e-6


def test_saves_no_dense_intermediate():
    """Backward keeps the ELL rows and the heavy rows, nothing [M, f]; fewer bytes than dense."""
    x, wg, wu, wd = (t.float() for t in make_case(64, 40, 75, seed=11, density=0.05))
    M, f = 64, 75
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    leaves = [t.clone().requires_grad_() for t in (x, wg, wu, wd)]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = sparse_gated_ffn(*leaves, 16)
    assert 0 < int(out.n_heavy) < M
    assert (M, f) not in shapes and (f, M) not in shapes
    sparse = saved_bytes(lambda *t: sparse_gated_ffn(*t, 16), x, wg, wu, wd)
    dense = saved_bytes(dense_ffn, x, wg, wu, wd)
    assert 0 < sparse < dense


def test_choose_width():
    assert choose_width(29.0) == 64
    assert choose_width(0.0) == 16 and choose_width(1000.0) == 512
    assert choose_width(29.0, active_max=40) == 48
    assert choose_width(29.0, f=20) == 20


def test_validation():
    x, wg, wu, wd = (t.float() for t in make_case(5, 24, 37, adversarial=False))
    with pytest.raises(TypeError, match="dtype"):
        sparse_gated_ffn(x, wg, wu.half(), wd, 16)
    with pytest.raises(TypeError, match="dtype in"):
        sparse_gated_ffn(x.double(), wg.double(), wu.double(), wd.double(), 16)
    with pytest.raises(ValueError, match=r"w_down must be \[24, 37\]"):
        sparse_gated_ffn(x, wg, wu, wd.T.contiguous(), 16)
    with pytest.raises(ValueError, match="2-D"):
        sparse_gated_ffn(x.view(1, 5, 24), wg, wu, wd, 16)
    with pytest.raises(ValueError, match="contiguous"):
        sparse_gated_ffn(x.T.contiguous().T, wg, wu, wd, 16)
    with pytest.raises(ValueError, match="unit-stride rows"):
        sparse_gated_ffn(x, wg.T.contiguous().T, wu, wd, 16)
    with pytest.raises(ValueError, match="width"):
        sparse_gated_ffn(x, wg, wu, wd, 0)
    with pytest.raises(ValueError, match="w_up must be"):
        sparse_ffn(x, wu[:, :20], wd, 16)
    # weights spanning 2^31 elements (meta: shapes only): the heavy rows' kernels cannot address them
    x, wg, wu, wd = (torch.empty(s, device="meta", dtype=torch.bfloat16) for s in
                     ((5, 16384), (131073, 16384), (131073, 16384), (16384, 131073)))
    with pytest.raises(ValueError, match="fewer than 2\\^31 elements"):
        sparse_gated_ffn(x, wg, wu, wd, 16)


def test_meta_tensors_and_a_missing_up_weight_are_refused():
    """Meta tensors (shapes only) get a clear error before any kernel, under the interpreter too;
    the row backward needs w_up (the first projection, non-gated) even without w_gate."""
    from twell.kernels.train_ffn import ffn_rows_backward

    x, wg, wu, wd = (t.float().to("meta") for t in make_case(5, 24, 37, adversarial=False))
    for call in (lambda: sparse_gated_ffn(x, wg, wu, wd, 16), lambda: sparse_ffn(x, wu, wd, 16),
                 lambda: T.dense_gated_ffn(x, wg, wu, wd), lambda: T.dense_ffn(x, wu, wd)):
        with pytest.raises(ValueError, match="x is on the meta device"):
            call()
    x, wg, wu, wd = (t.float() for t in make_case(5, 24, 37, adversarial=False))
    cols, h, counts = pack_rows(torch.relu(x @ wu.T), 16)
    with pytest.raises(TypeError, match="w_up must be a torch.Tensor, got NoneType"):
        ffn_rows_backward(torch.randn(5, 24), cols, h, None, counts, wd.t().contiguous(), None, None, torch.zeros(1))


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    x, wg, wu, wd = (t.float().cpu() for t in make_case(5, 24, 37, adversarial=False))
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="CUDA tensor"):
        sparse_gated_ffn(x, wg, wu, wd, 16)
    with pytest.raises(ValueError, match="CUDA tensor"):
        sparse_ffn(x, wu, wd, 16)


# --- GPU, bf16, real shapes --------------------------------------------------------------------


def _gpu_tensors(M=4096, d=2048, f=5632, k=29):
    """bf16 CUDA tensors with about k of f units active per token (set by column 0), plus an
    empty row and a fully dense (heavy) row."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, d, generator=g, device="cuda")
    wg = torch.randn(f, d, generator=g, device="cuda") / math.sqrt(d - 1)
    x[:, 0] = 1.0
    wg[:, 0] = -float(torch.special.ndtri(torch.tensor(1.0 - k / f, dtype=torch.float64)))
    x[5, 1:] = 0.0
    x[7, 0] = -50.0
    wu = torch.randn(f, d, generator=g, device="cuda") / math.sqrt(d)
    wd = torch.randn(d, f, generator=g, device="cuda") / math.sqrt(f)
    return [t.to(torch.bfloat16) for t in (x, wg, wu, wd)]


@pytest.mark.gpu
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("op", ["sparse", "dense"])
def test_gpu_bf16_real_shape(gated, op):
    """M 4096, d 2048, f 5632, bf16, the L1 path weighted so that it counts: the sparse op (with
    heavy rows) and the all-rows-dense op against bf16 and fp32 autograd."""
    tensors = _gpu_tensors()
    if not gated:
        tensors = [tensors[0], tensors[1], tensors[3]]
    M, d = tensors[0].shape
    r = torch.randn(M, d, device="cuda", dtype=torch.bfloat16)
    lam = 0.25 * M  # c = lam / M = 0.25 against |dy . w_down^T[j]| ~ 0.6: the L1 path counts
    width = choose_width(29.0)
    if op == "dense":
        fn = T.dense_gated_ffn if gated else T.dense_ffn
    else:
        fn = (lambda *t: sparse_gated_ffn(*t, width)) if gated else (lambda *t: sparse_ffn(*t, width))
    out, grads = run(fn, tensors, r, lam)
    if gated:
        ref, ref_grads = run(lambda x, wg, wu, wd: dense_ffn(x, wg, wu, wd), tensors, r, lam)
        fp32, fp32_grads = run(lambda x, wg, wu, wd: dense_ffn(x, wg, wu, wd), [t.float() for t in tensors], r.float(), lam)
    else:
        ref, ref_grads = run(lambda x, wu, wd: dense_ffn(x, wu, None, wd), tensors, r, lam)
        fp32, fp32_grads = run(lambda x, wu, wd: dense_ffn(x, wu, None, wd), [t.float() for t in tensors], r.float(), lam)
    assert int(out.n_heavy) >= 1 if op == "sparse" else int(out.n_heavy) == 0
    assert rel_err(out.y, ref[0]) <= 1e-2 and rel_err(out.y, fp32[0]) <= 1e-2
    assert abs(float(out.l1) - float(fp32[1])) <= 1e-2 * float(fp32[1])
    for gr, gr_ref, gr32 in zip(grads, ref_grads, fp32_grads):
        assert rel_err(gr, gr_ref) <= 1e-2 and rel_err(gr, gr32) <= 1e-2
    a = tensors[0] @ tensors[1].T
    assert torch.equal(out.row_counts.long(), (a > 0).sum(1)) and torch.equal(out.unit_counts, (a > 0).sum(0))


@pytest.mark.gpu
@pytest.mark.parametrize("gated", [True, False])
def test_gpu_no_stream_synchronisation(gated, monkeypatch):
    """No stream or device synchronisation and no blocking copy in the sparse op's forward or
    backward (CUDA's sync debug mode raises on those: torch.nonzero's, .item(), .tolist() of a
    GPU tensor), with heavy rows (a tenth of the tokens, more than one block per program of the
    heavy-row kernels) and a hot unit present; the results still match dense autograd's in bf16
    and fp32. (The backward's read of the counts its forward copied to pinned memory polls host
    memory, which that mode does not see: test_gpu_backward_reads_the_forward_counts.)"""
    x, wg, wu, wd = _gpu_tensors(M=8192)
    x[::10, 0] = 0.0  # a = z: about half the units active, heavy
    wg[3, 0] = 5.0  # unit 3 fires for nearly every token: hot
    tensors = (x, wg, wu, wd) if gated else (x, wg, wd)
    calls = []
    add_hot = T._add_hot
    monkeypatch.setattr(T, "_add_hot", lambda *a: calls.append(a[1].numel()) or add_hot(*a))
    r = torch.randn(x.shape, device="cuda", dtype=torch.bfloat16)
    fn = (lambda *t: sparse_gated_ffn(*t, 64)) if gated else (lambda *t: sparse_ffn(*t, 64))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, grads = run(fn, tensors, r, 0.25 * x.shape[0])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert calls and int(out.n_heavy) >= 819
    dense = (lambda x, wg, wu, wd: dense_ffn(x, wg, wu, wd)) if gated else (lambda x, wu, wd: dense_ffn(x, wu, None, wd))
    ref, ref_grads = run(dense, tensors, r, 0.25 * x.shape[0])
    fp32, fp32_grads = run(dense, [t.float() for t in tensors], r.float(), 0.25 * x.shape[0])
    assert rel_err(out.y, fp32[0]) <= 1e-2 and abs(float(out.l1) - float(fp32[1])) <= 1e-2 * float(fp32[1])
    for gr, gr_ref, gr32 in zip(grads, ref_grads, fp32_grads):
        assert rel_err(gr, gr32) <= max(1e-2, 1.5 * rel_err(gr_ref, gr32))


@pytest.mark.gpu
def test_gpu_backward_reads_the_forward_counts(monkeypatch):
    """The counts reach the host through pinned memory that starts at -1: the forward returns
    before they land, the backward polls until they have; heavy rows then sized right."""
    x, wg, wu, wd = _gpu_tensors(M=2048)
    x[::8, 0] = 0.0  # 256 heavy rows, and the helper's fully dense row 7
    heavy = int((((x @ wg.T) > 0).sum(1) > 64).sum())
    assert heavy == 257
    seen = []
    poll = T._host_counts
    monkeypatch.setattr(T, "_host_counts", lambda saved, own, *a: seen.append(own.is_pinned()) or poll(saved, own, *a))
    leaves = [t.clone().requires_grad_() for t in (x, wg, wu, wd)]
    out = sparse_gated_ffn(*leaves, 64)
    out.y.float().sum().backward()
    assert seen == [True] and int(out.n_heavy) == heavy
    host = T._to_host(torch.tensor([3, 0, 7], device="cuda"))
    assert T._host_counts(host, host, torch.device("cuda"), (9, 9, 9)) == [3, 0, 7]


def test_host_counts_wait_for_the_copy():
    """The backward's read of the forward's counts waits until every value has replaced the -1
    the buffer starts with and lies within its bound (here a thread plays the copy: first a
    value past the bound, as a half-landed one would read, then the real ones)."""
    import threading

    host = T._to_host(torch.tensor([5, 1, 2]))
    host[:-1] = -1
    threading.Timer(0.02, lambda: host[:-1].copy_(torch.tensor([5, 2 ** 40, 2]))).start()
    threading.Timer(0.08, lambda: host[:-1].copy_(torch.tensor([5, 1, 2]))).start()
    assert T._host_counts(host, host, torch.device("cpu"), (9, 9, 9)) == [5, 1, 2]


def _late_counts(monkeypatch, delay=0.1):
    """Make the forward's counts land only ``delay`` seconds after the backward first asks for
    them (as a copy behind a busy GPU queue would): every hook has packed its saved tensors by
    then."""
    import threading

    real, poll, pending = T._to_host, T._host_counts, []

    def late(values):
        host = real(values)
        pending.append((host, host[:-1].clone()))
        host[:-1] = -1
        return host

    def first_poll_lands(*args):
        while pending:
            host, landed = pending.pop()
            threading.Timer(delay, lambda h=host, v=landed: h[:-1].copy_(v)).start()
        return poll(*args)

    monkeypatch.setattr(T, "_to_host", late)
    monkeypatch.setattr(T, "_host_counts", first_poll_lands)


@pytest.mark.parametrize("wrap", ["plain", "save_on_cpu", "checkpoint", "checkpoint_in_save_on_cpu"])
def test_counts_that_land_late_under_saved_tensor_hooks(wrap, monkeypatch):
    """Counts that land after the forward returned: the backward waits for them, also under
    save_on_cpu(pin_memory=True), whose pack hook copies the saved buffer while it still holds
    -1 (the backward must then read the forward's own buffer, not the copy), and under a
    non-reentrant checkpoint; the gradients are dense autograd's. Run in a thread: a backward
    that never finishes fails the test instead of hanging it."""
    import contextlib
    import threading

    from torch.utils.checkpoint import checkpoint

    _late_counts(monkeypatch)
    tensors = [t.float() for t in make_case(37, 40, 75, seed=7, adversarial=False)]
    leaves = [t.clone().requires_grad_() for t in tensors]
    fn = lambda *t: sparse_gated_ffn(*t, 12).y  # noqa: E731
    hooks = torch.autograd.graph.save_on_cpu(pin_memory=True) if "save_on_cpu" in wrap else contextlib.nullcontext()
    with hooks:
        y = checkpoint(fn, *leaves, use_reentrant=False) if "checkpoint" in wrap else fn(*leaves)
    done = []
    worker = threading.Thread(target=lambda: (y.sum().backward(), done.append(True)), daemon=True)
    worker.start()
    worker.join(60)
    assert done, "the backward is still waiting for its counts"
    ref = [t.double().requires_grad_() for t in tensors]
    dense_ffn(*ref)[0].sum().backward()
    for got, want in zip((t.grad for t in leaves), (t.grad for t in ref)):
        assert rel_err(got, want) < TOL[torch.float32]


def test_checkpoint_recomputation_uses_its_own_counts(small_blocks):
    """Under activation checkpointing the backward runs on the recomputed forward's ELL rows and
    row list, and must take that forward's counts too: here the recomputation sees a denser gate
    (more heavy rows) than the first forward, and the gradients are dense autograd's at the
    recomputed point."""
    from torch.utils.checkpoint import checkpoint

    x, wg, wu, wd = (t.float() for t in make_case(37, 40, 75, seed=7, adversarial=False))
    shift = {"v": 0.0}

    def shifted(wg):
        return torch.cat([wg[:, :1] + shift["v"], wg[:, 1:]], dim=1)  # a lower threshold: more units fire

    def fn(x, wg, wu, wd):
        return sparse_gated_ffn(x, shifted(wg), wu, wd, 12).y

    heavy = []
    for v in (0.0, 0.6):
        shift["v"] = v
        heavy.append(int((((x @ shifted(wg).T) > 0).sum(1) > 12).sum()))
    assert heavy[1] > heavy[0] > 0
    r = torch.randn(37, 40, generator=torch.Generator().manual_seed(2)).to(DEV)
    leaves = [t.clone().requires_grad_() for t in (x, wg, wu, wd)]
    shift["v"] = 0.0
    y = checkpoint(fn, *leaves, use_reentrant=False)
    shift["v"] = 0.6  # what the recomputation in the backward sees
    (y * r).sum().backward()
    ref = [t.double().requires_grad_() for t in (x, wg, wu, wd)]
    ((dense_ffn(ref[0], shifted(ref[1]), ref[2], ref[3])[0] * r.double()).sum()).backward()
    for got, want in zip((t.grad for t in leaves), (t.grad for t in ref)):
        assert rel_err(got, want) < TOL[torch.float32]


@pytest.mark.parametrize("align", [1, 8])
@pytest.mark.parametrize("gated", [True, False])
def test_hot_units_take_the_dense_columns(gated, align, monkeypatch):
    """Units held by far more slots than the mean (HOT fires in every ordinary row) get their
    weight gradients from the dense [M, n_hot] block: the same gradients, with the block's
    columns padded to a multiple of HOT_ALIGN or not."""
    for name, cfg in SMALL_FULL.items():
        monkeypatch.setattr(T, name, cfg)
    monkeypatch.setattr(T, "HOT_MIN", 4)
    monkeypatch.setattr(T, "HOT_FACTOR", 2.0)
    monkeypatch.setattr(T, "HOT_ALIGN", align)
    x, wg, wu, wd = (t.float() for t in make_case(37, 40, 75, seed=5))
    a = x @ wg.T
    counts = (a > 0).sum(1).int()
    cols, _, cnt = pack_rows(a, 12)
    from twell.kernels.train_index import light_unit_counts

    _, _, hot_mask, info, _ = T._heavy_and_hot(cnt, 12, light_unit_counts(cols, cnt, 75), 75)
    hot = torch.nonzero(hot_mask).flatten()
    assert HOT in hot.tolist() and 0 < hot.numel() < 75 and int(info[1]) == hot.numel()
    n = -(-hot.numel() // align) * align
    assert align == 1 or n > hot.numel()  # (padding columns present)
    block, none = T._hot_dense(cols, cnt, hot, int(info[2]), 75, torch.ones(cols.shape, device=DEV), None)
    assert none is None and block.shape == (37, n) and not bool(block[:, hot.numel():].any())
    assert int(block.sum()) == int(info[2])  # every hot slot, once
    compare((x, wg, wu, wd) if gated else (x, wg, wd), 12, torch.float32, gated=gated)
    assert int((counts > 12).sum()) > 0  # heavy rows too: both dense contributions meet


def test_hot_unit_cutoff_is_strict():
    """A unit is hot when it holds *more than* max(HOT_MIN, HOT_SHARE M, HOT_FACTOR x mean) slots: one at
    exactly the limit stays on the per-unit kernel (a mutant with >= survived every other test:
    both paths give the same gradients)."""
    f = 100
    per_unit = torch.zeros(f, dtype=torch.int64)
    per_unit[0], per_unit[1] = T.HOT_MIN, T.HOT_MIN + 1  # the limit is HOT_MIN here
    _, _, hot, info, _ = T._heavy_and_hot(torch.zeros(4, dtype=torch.int32, device=DEV), 16, per_unit.to(DEV), f)
    assert hot.nonzero().flatten().tolist() == [1]
    assert info.tolist() == [0, 1, T.HOT_MIN + 1]


def test_hot_limit_grows_with_the_call():
    """From ``HOT_MIN / HOT_SHARE`` tokens on, the limit is ``HOT_SHARE`` of them: at 25600
    tokens (1/64 of them, 400) a unit needs more than 400 slots, and one with 400 stays on the
    per-unit kernel; the mean's multiple still binds where it is larger."""
    assert T.hot_limit(1000) == T.HOT_MIN and T.hot_limit(25600) == pytest.approx(T.HOT_SHARE * 25600) == pytest.approx(400.0)
    f = 100
    per_unit = torch.zeros(f, dtype=torch.int64)
    per_unit[0], per_unit[1], per_unit[2] = 300, 400, 401
    _, _, hot, info, _ = T._heavy_and_hot(torch.zeros(25600, dtype=torch.int32, device=DEV), 16, per_unit.to(DEV), f)
    assert hot.nonzero().flatten().tolist() == [2] and info.tolist() == [0, 1, 401]
    per_unit[3:] = 250  # mean 253.5: HOT_FACTOR x mean = 507 binds
    _, _, hot, _, _ = T._heavy_and_hot(torch.zeros(25600, dtype=torch.int32, device=DEV), 16, per_unit.to(DEV), f)
    assert hot.nonzero().flatten().tolist() == []


@pytest.mark.parametrize("block_d", [None, 32])
def test_row_backward_adds_the_l1_term_in_fp32(block_d):
    """bf16 inputs and an L1 weight c far below half a bf16 step of dy . w_down^T: per slot,
    du(c) - du(0) = c sign(h) g and da(c) - da(0) = c sign(h) u, which holds only if dh is kept in
    fp32 until it is multiplied (rounding dh to bf16 first survived every other test: unbiased
    over many tokens)."""
    from twell.kernels.train_ffn import ffn_rows_backward, ffn_rows_forward

    c = 5e-6  # about 1e-4 of |dy . w_down^T|: under half a bf16 step, far above an fp32 one
    x, wg, wu, wd = (t.bfloat16() for t in make_case(16, 40, 75, seed=3, adversarial=False))
    dy = (torch.randn(16, 40, generator=torch.Generator().manual_seed(0)) / 16).bfloat16()
    cols, g, counts = pack_rows(x @ wg.T, 75)
    wdt = wd.t().contiguous()
    _, u, _ = ffn_rows_forward(x, cols, g, counts, wdt, wu, block_d=block_d)
    with_c, without = (ffn_rows_backward(dy, cols, g, u, counts, wdt, wu, wg, torch.tensor([cc]), block_d=block_d)
                       for cc in (c, 0.0))
    used = torch.arange(75) < counts.long().unsqueeze(1)
    assert used.sum() > 20
    h = g.float() * u.float()
    for i, v in ((1, g.float()), (2, u.float())):
        diff = (with_c[i] - without[i])[used]
        want = (c * torch.sign(h) * v)[used]
        assert (diff - want).abs().max() <= 2e-2 * want.abs().max(), i


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("op", ["sparse", "dense"])
def test_nan_comes_out_where_dense_puts_it(op, gated, small_blocks):
    """A NaN gate fires (relu keeps it), as in dense: a NaN in one token's input makes the row
    heavy (every gate NaN) and its output NaN, the other rows dense's; a NaN in one unit's gate
    weights (a light-row slot in every row) makes every output NaN. The counts count them."""
    x, wg, wu, wd = (t.float() for t in make_case(13, 40, 75, seed=3, adversarial=False))
    if op == "dense":
        fn = (lambda *t: T.dense_gated_ffn(*t)) if gated else (lambda x, wg, wd: T.dense_ffn(x, wg, wd))
    else:
        fn = (lambda *t: sparse_gated_ffn(*t, 16)) if gated else (lambda x, wg, wd: sparse_ffn(x, wg, wd, 16))
    args = (wg, wu, wd) if gated else (wg, wd)
    x[4, 2] = float("nan")
    out = fn(x, *args)
    ref = dense_ffn(x, wg, wu if gated else None, wd)[0]
    rest = torch.arange(13, device=x.device) != 4
    assert torch.isnan(out.y[4]).all() and not torch.isnan(out.y[rest]).any()
    assert rel_err(out.y[rest], ref[rest]) < TOL[torch.float32]
    assert int(out.row_counts[4]) == 75
    fired = ~((x @ wg.T) <= 0)  # > 0 or NaN: row 4 counts for every unit (the heavy rows' count)
    assert torch.equal(out.unit_counts.long(), fired.sum(0))
    x[4, 2] = 0.0
    wg[9, 1] = float("nan")
    out = fn(x, *args)
    assert torch.isnan(out.y).all()
    assert int(out.unit_counts[9]) == 13 and bool(torch.all(out.row_counts >= 1))



# --- host-side bookkeeping (a mutation round: these had survived) ------------------------------


def test_choose_width_floor_and_saved_bytes_counts_bytes_of_saved_tensors_only():
    assert choose_width(5.0, active_max=0) == 16
    assert saved_bytes(torch.mm, torch.randn(4, 5), torch.randn(5, 3)) == 0  # inputs are not counted
    assert saved_bytes(torch.exp, torch.ones(10)) == 40  # exp saves its float32 result: bytes, not elements


def test_width_above_f_is_clamped():
    g = torch.Generator().manual_seed(0)
    x, wg, wu = torch.randn(3, 24, generator=g), torch.randn(21, 24, generator=g), torch.randn(21, 24, generator=g)
    wd = torch.randn(24, 21, generator=g)
    leaves = [t.to(DEV).requires_grad_() for t in (x, wg, wu, wd)]
    shapes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
        sparse_gated_ffn(*leaves, 200)
    assert (3, 200) not in shapes and (3, 21) in shapes


def test_a_frozen_w_up_gets_no_gradient_product(monkeypatch):
    seen = []
    real = T._dense_rows_backward
    monkeypatch.setattr(T, "_dense_rows_backward", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    g = torch.Generator().manual_seed(0)
    x, wg, wu = torch.randn(6, 8, generator=g), torch.randn(12, 8, generator=g), torch.randn(12, 8, generator=g)
    wd = torch.randn(8, 12, generator=g)
    xl, wgl, wdl = (t.to(DEV).requires_grad_() for t in (x, wg, wd))
    out = T.dense_gated_ffn(xl, wgl, wu.to(DEV), wdl)
    (out.y.sum() + out.l1).backward()
    _, (dw_up, dw_gate, dw_down) = seen[0]
    assert dw_up is None and dw_gate is not None and dw_down is not None


# --- a second mutation round: these had survived ------------------------------------------------


def test_to_host_reads_the_sentinel_until_the_copy_lands():
    """Until its copy lands the buffer reads -1 (what _host_counts waits past: every count is
    >= 0) and its last element tags it with its own address. On the CPU the copy is immediate,
    so a tensor whose copy is dropped plays one still in flight (a buffer that started at 0
    survived every other test: the backward would read 0 heavy rows before the copy landed)."""
    class InFlight(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if func is torch.Tensor.copy_:
                return args[0]
            return super().__torch_function__(func, types, args, kwargs or {})

    host = T._to_host(torch.tensor([3, 0, 7]).as_subclass(InFlight))
    assert type(host) is torch.Tensor and host.dtype == torch.int64
    assert host.tolist() == [-1, -1, -1, host.data_ptr()]


def test_a_bool_width_is_refused():
    """width=True is an int to isinstance, but not a width: refused like 0."""
    x, wg, wu, wd = (t.float() for t in make_case(5, 24, 37, adversarial=False))
    for call in (lambda: sparse_gated_ffn(x, wg, wu, wd, True), lambda: sparse_ffn(x, wu, wd, True)):
        with pytest.raises(ValueError, match="width must be an int"):
            call()


@pytest.mark.parametrize("gated", [True, False])
def test_a_single_heavy_row_takes_the_dense_backup(gated):
    """Exactly one row heavier than W: its gradients come from the dense backup (a backward that
    ran the backup only from two heavy rows on survived every other test)."""
    x, wg, wu, wd = make_case(6, 16, 24, seed=2, density=0.1, adversarial=False)
    x[2, 0] = -40.0  # every unit fires in row 2
    out, _, _ = compare((x, wg, wu, wd) if gated else (x, wg, wd), 8, torch.float32, gated=gated)
    assert int(out.n_heavy) == 1


@pytest.mark.parametrize("gated", [True, False])
def test_backward_takes_a_broadcast_dy(gated):
    """``y.sum()`` hands the backward an expanded dy (stride 0): the ops make it contiguous
    before their kernels (dropping that in the non-gated op survived every other test)."""
    x, wg, wu, wd = (t.float() for t in make_case(6, 16, 24, seed=3, density=0.2, adversarial=False))
    tensors = (x, wg, wu, wd) if gated else (x, wg, wd)
    fn = (lambda *t: sparse_gated_ffn(*t, 8)) if gated else (lambda *t: sparse_ffn(*t, 8))
    leaves = [t.clone().requires_grad_() for t in tensors]
    fn(*leaves).y.sum().backward()
    ref = [t.double().requires_grad_() for t in tensors]
    dense_ffn(ref[0], ref[1], ref[2] if gated else None, ref[-1])[0].sum().backward()
    for got, want in zip((t.grad for t in leaves), (t.grad for t in ref)):
        assert rel_err(got, want) < TOL[torch.float32]


def test_pack_rows_writes_nothing_past_its_rows(monkeypatch):
    """The same for the training pack: the last row is heavy (its entries past W must not be
    stored: they would land past the buffer), and rows past M (which fire everywhere in memory)
    write nothing. Kills the same mutants as above for train_ffn (W + 1 as the limit, no limit,
    rows not masked)."""
    M, f, W = 5, 70, 4

    big_a = torch.full((M + GUARD, f), -1.0, device=DEV)
    big_a[M:] = 1.0
    a = big_a[:M]
    a[0, [1, 31, 40]] = 1.5
    a[M - 1, 10:30] = 2.0  # heavy: 20 entries, W = 4
    handed = guard_empty(monkeypatch, lambda size, kw: size[0] == M)  # GUARD poisoned rows past each
    for bm, bf in [(4, 32), (2, 512), (1, 64)]:
        handed.clear()
        cols, vals, counts = pack_rows(a, W, block_m=bm, block_f=bf, num_warps=1)
        fired = a > 0
        assert torch.equal(counts, fired.sum(1).int())
        assert torch.equal(cols[M - 1].long(), torch.arange(10, 14, device=DEV))
        assert torch.equal(cols[0, :3].long(), torch.tensor([1, 31, 40], device=DEV))
        assert len(handed) == 3  # cols, values, counts
        for h in handed:
            assert untouched(h.guards[1]).all(), (bm, bf)


def test_pack_rows_int32_columns():
    """f > 32768: cols are int32 (col_dtype) and hold columns past 32767 as they are. Kills
    'col.to(tl.int16)' in write_step_entries (any fixed column dtype), which every other test
    survives (they all have f <= 32768)."""
    M, f = 2, 33000
    a = torch.full((M, f), -1.0, device=DEV)
    a[0, [3, 32767, 32768, 32999]] = 1.0
    a[1, 32800] = 2.0
    cols, vals, counts = pack_rows(a, 4, block_m=2, block_f=4096, num_warps=1)
    assert cols.dtype == torch.int32
    assert counts.tolist() == [4, 1]
    assert cols[0].tolist() == [3, 32767, 32768, 32999] and cols[1].tolist() == [32800, 0, 0, 0]
    assert vals[1].tolist() == [2.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("block_f", [16, 8])
def test_pack_rows_refuses_steps_narrower_than_a_word(block_f):
    """block_f // 32 words a step: 16 would give a zero-word step (a compile error deep in
    Triton, or on another backend a pack that drops every column). Kills lowering the bound of
    check_pow2(block_f, ...) back to 16."""
    with pytest.raises(ValueError, match="block_f"):
        pack_rows(torch.zeros(3, 64, device=DEV), 4, block_f=block_f)


@pytest.mark.gpu
def test_pack_rows_int64_offsets_gpu():
    """M * W and M * stride beyond 2^31: the rows' offsets must be int64 (rows .to(tl.int64) in
    _pack_rows_kernel). Kills dropping that cast. Not run in this review."""
    M, f, W = (1 << 27) + 3, 32, 16  # M * W = 2^31 + 48, M * f = 2^32 + 96
    a = torch.full((M, f), -1.0, dtype=torch.bfloat16, device="cuda")
    a[-1, [2, 31]] = 1.0
    a[-2, 5] = 2.0
    cols, vals, counts = pack_rows(a, W)
    assert counts[-2:].tolist() == [1, 2] and int(counts[:-2].sum()) == 0
    assert cols[-1, :3].tolist() == [2, 31, 0] and cols[-2, :2].tolist() == [5, 0]
    assert vals[-1, :2].float().tolist() == [1.0, 1.0] and bool((cols[0] == 0).all())


# --- a third mutation round (the sparse op and its bookkeeping): these had survived --------------


@pytest.mark.parametrize("gated", [True, False])
def test_sparse_ops_with_no_tokens(gated):
    """M = 0: y is [0, d], l1 is exactly 0 (not 0 / 0), no row is heavy, and every gradient is
    an exact zero. Kills dividing the L1 sum by M instead of max(M, 1) in _light_forward."""
    x, wg, wu, wd = (t.float() for t in make_case(0, 24, 37, seed=3, adversarial=False))
    tensors = (x, wg, wu, wd) if gated else (x, wg, wd)
    fn = (lambda *t: sparse_gated_ffn(*t, 16)) if gated else (lambda *t: sparse_ffn(*t, 16))
    out, grads = run(fn, tensors, torch.zeros(0, 24, device=DEV), 0.5)
    assert out.y.shape == (0, 24) and float(out.l1) == 0.0 and int(out.n_heavy) == 0
    assert out.unit_counts.shape == (37,) and int(out.unit_counts.sum()) == 0
    for g, t in zip(grads, tensors):
        assert g.shape == t.shape and torch.equal(g, torch.zeros_like(g))


def test_l1_gradient_is_zero_where_h_is_exactly_zero():
    """sign(0) = 0 in the L1 term's gradient, as in dense autograd (d|h|/dh at 0): a unit whose
    w_up row is zero has h = g u = 0 exactly at every slot it holds, so the L1 term adds nothing
    to its gradients. Kills _l1_sign giving +1 at 0 (h >= 0), which every other test survives (h
    is never exactly 0 on a used slot there)."""
    x, wg, wu, wd = make_case(16, 24, 37, seed=6, density=0.15, adversarial=False)
    wg[3, 0] = 30.0  # unit 3 fires in every row (with x[m, 0] = 1)
    wu[3] = 0.0  # ... with u = 0 exactly: h = 0 at each of its slots
    x[2, 0] = -40.0  # one heavy row (every unit but 3): the light rows' slots meet the dense backup's
    out, grads, ref_grads = compare((x, wg, wu, wd), 16, torch.float32, lam=2.0)
    assert int(out.unit_counts[3]) == 15 and int(out.n_heavy) == 1
    dw_up, ref = grads[2], ref_grads[2]
    assert rel_err(dw_up[3], ref[3]) < TOL[torch.float32]


@pytest.mark.parametrize("block_d", [None, 32])
def test_rows_forward_writes_zeros_past_each_row(block_d):
    """ffn_rows_forward's outputs have no unwritten element: u is zero past each light row's
    entries and over all of a heavy row's (from torch.empty, NaN under the fixture, it would
    otherwise stay NaN where nothing reads it now), and a heavy row's y and |h| sum are zero.
    Kills _zero_unused_slots starting one slot late (s > n), which every other test survives."""
    from twell.kernels.train_ffn import ffn_rows_forward

    x, wg, wu, wd = (t.float() for t in make_case(13, 40, 75, seed=10))
    W = 12
    cols, g, counts = pack_rows(x @ wg.T, W, block_m=2, block_f=32, num_warps=1)
    heavy = counts > W
    assert bool(heavy.any()) and bool((counts == 0).any()) and bool(((counts > 0) & ~heavy).any())
    y, u, l1_rows = ffn_rows_forward(x, cols, g, counts, wd.t().contiguous(), wu, block_e=4, block_d=block_d)
    used = (torch.arange(W, device=DEV) < counts.unsqueeze(1)) & ~heavy.unsqueeze(1)
    assert torch.equal(u[~used], torch.zeros_like(u[~used]))
    want_u = (x @ wu.T).gather(1, cols.long())
    assert torch.allclose(u[used], want_u[used], rtol=1e-5, atol=1e-6)
    assert torch.equal(y[heavy], torch.zeros_like(y[heavy])) and torch.equal(l1_rows[heavy], torch.zeros_like(l1_rows[heavy]))


def test_pack_rows_int32_columns_from_one_past_int16():
    """f = 32769 is the first f whose columns (up to 32768) int16 cannot hold: the pack's
    columns are int32 there and column 32768 comes back as it is (kills col_dtype's bound moved
    one up, f <= 32769, which test_pack_rows_int32_columns at f 33000 survives)."""
    from twell.kernels.train_ffn import col_dtype

    assert col_dtype(32768) == torch.int16
    a = torch.full((1, 32769), -1.0, device=DEV)
    a[0, [5, 32768]] = 1.0
    cols, vals, counts = pack_rows(a, 2, block_m=1, block_f=4096, num_warps=1)
    assert cols.dtype == torch.int32 and counts.tolist() == [2] and cols[0].tolist() == [5, 32768]


def test_saved_bytes_counts_views_of_one_storage_apart():
    """Two saved tensors that are views of one intermediate's storage (different offsets) are
    both counted (kills keying the distinct saved tensors by their storage alone)."""
    def two_halves(t):
        y = t * 2  # saves nothing of its own
        return y[:5].sin().sum() + y[5:].sin().sum()  # sin saves each half, two views of y

    assert saved_bytes(two_halves, torch.ones(10)) == 40


def test_choose_width_is_a_width_the_ops_take_at_f_zero():
    """At least 1 whatever f (the ops refuse width 0): kills dropping max(1, f) in choose_width."""
    assert choose_width(3.0, f=0) == 1 and choose_width(0.0, active_max=0, f=0) == 1


def test_weight_grads_dtype_and_base():
    """ffn_weight_grads writes its outputs in ``dtype`` (default x's): fp32 gradients from bf16
    inputs are the bf16 ones before rounding (kills ignoring the dtype argument); a gated call's
    base must hold dw_gate (kills skipping its check whenever it is None: the kernel would get
    no buffer to add to)."""
    from twell.kernels.train_ffn import ffn_rows_backward, ffn_rows_forward, ffn_weight_grads
    from twell.kernels.train_index import unit_index

    x, wg, wu, wd = (t.bfloat16() for t in make_case(9, 24, 37, seed=2, adversarial=False))
    dy = torch.randn(9, 24, generator=torch.Generator().manual_seed(0)).to(DEV, torch.bfloat16)
    cols, g, counts = pack_rows(x @ wg.T, 16)
    wdt = wd.t().contiguous()
    _, u, _ = ffn_rows_forward(x, cols, g, counts, wdt, wu)
    _, du, da = ffn_rows_backward(dy, cols, g, u, counts, wdt, wu, wg, torch.tensor([0.1], device=DEV))
    order, offsets = unit_index(cols, counts, 37)
    low = ffn_weight_grads(order, offsets, x, dy, g, u, du, da)
    high = ffn_weight_grads(order, offsets, x, dy, g, u, du, da, dtype=torch.float32)
    assert all(t.dtype == torch.bfloat16 for t in low) and all(t.dtype == torch.float32 for t in high)
    for lo, hi in zip(low, high):
        assert rel_err(lo, hi) < TOL[torch.bfloat16] and bool((hi != hi.bfloat16().float()).any())
    with pytest.raises(ValueError, match="base dw_gate"):
        ffn_weight_grads(order, offsets, x, dy, g, u, du, da, base=(low[0].clone(), None, low[2].clone()))


@pytest.mark.parametrize("gated", [True, False])
def test_weight_grads_split_is_the_one_launch_bit_for_bit(gated):
    """``split=True`` (one launch gathering x rows, one gathering dy rows) writes the one
    launch's bits, with and without a base to add to, and so does the longest-first schedule
    (``units``); each part writes only its own outputs (kills a part that skips its base,
    stores the other's accumulator, or runs both parts; a program that sums one unit's slots
    into another's row, as an output row taken from the program instead of ``units``)."""
    from twell.kernels.train_ffn import ffn_rows_backward, ffn_rows_forward, ffn_weight_grads
    from twell.kernels.train_index import heavy_and_hot, light_unit_counts, unit_index

    x, wg, wu, wd = (t.bfloat16() for t in make_case(11, 40, 75, seed=5, adversarial=True))
    dy = torch.randn(11, 40, generator=torch.Generator().manual_seed(1)).to(DEV, torch.bfloat16)
    cols, g, counts = pack_rows(x @ wg.T, 8)
    wdt = wd.t().contiguous()
    if gated:
        _, u, _ = ffn_rows_forward(x, cols, g, counts, wdt, wu)
        _, du, da = ffn_rows_backward(dy, cols, g, u, counts, wdt, wu, wg, torch.tensor([0.1], device=DEV))
    else:
        u = da = None
        _, du, _ = ffn_rows_backward(dy, cols, g, None, counts, wdt, wu, None, torch.tensor([0.1], device=DEV))
    order, offsets = unit_index(cols, counts, 75)
    gen = torch.Generator().manual_seed(2)
    base = tuple(None if (i == 1 and not gated) else torch.randn(75, 40, generator=gen).to(DEV, torch.bfloat16) for i in range(3))
    for b in (None, base):
        args = dict(block_t=4, block_d=32, num_warps=1)
        one = ffn_weight_grads(order, offsets, x, dy, g, u, du, da, base=None if b is None else tuple(t if t is None else t.clone() for t in b), **args)
        two = ffn_weight_grads(order, offsets, x, dy, g, u, du, da, base=None if b is None else tuple(t if t is None else t.clone() for t in b), split=True, **args)
        units = heavy_and_hot(counts, 8, light_unit_counts(cols, counts, 75), 1e9, 0.0)[4]
        assert sorted(units.tolist()) == list(range(75)) and units.tolist() != list(range(75))
        three = ffn_weight_grads(order, offsets, x, dy, g, u, du, da, base=None if b is None else tuple(t if t is None else t.clone() for t in b), split=True, units=units, **args)
        for o, t, r in zip(one, two, three):
            assert (o is None) == (t is None) == (r is None)
            if o is not None:
                assert torch.equal(o, t) and torch.equal(o, r) and bool(o.ne(0).any())
    for bad in (units[:-1].contiguous(), units.repeat(2)[::2], units.view(1, -1)):
        with pytest.raises(ValueError, match="units must be"):
            ffn_weight_grads(order, offsets, x, dy, g, u, du, da, units=bad)
    with pytest.raises(TypeError, match="units"):
        ffn_weight_grads(order, offsets, x, dy, g, u, du, da, units=units.int())


@pytest.mark.parametrize("gated", [True, False])
def test_the_backward_gives_the_weight_gradients_the_forwards_schedule(gated, monkeypatch):
    """The op's backward hands ffn_weight_grads the schedule its forward's heavy_and_hot wrote
    (the order only changes speed, so no gradient would show it missing), and none while
    GRADS_LONGEST_FIRST is off."""
    from twell.kernels import train_index as TI

    x, wg, wu, wd = (t.float() for t in make_case(9, 40, 75, seed=3, adversarial=True))
    schedules, handed = [], []
    real_hh, real_wg = T.heavy_and_hot, T.ffn_weight_grads

    def spy_hh(*a, **k):
        out = real_hh(*a, **k)
        schedules.append(out[4])
        return out

    def spy_wg(*a, units=None, **k):
        handed.append(units)
        return real_wg(*a, units=units, **k)

    monkeypatch.setattr(T, "heavy_and_hot", spy_hh)
    monkeypatch.setattr(T, "ffn_weight_grads", spy_wg)
    for on in (True, False):
        monkeypatch.setattr(T, "GRADS_LONGEST_FIRST", on)
        leaves = [t.clone().requires_grad_() for t in ((x, wg, wu, wd) if gated else (x, wu, wd))]
        out = sparse_gated_ffn(*leaves, 12) if gated else sparse_ffn(*leaves, 12)
        (out.y.sum() + out.l1).backward()
        if on:
            assert handed[-1] is not None and torch.equal(handed[-1], schedules[-1])
            assert sorted(handed[-1].tolist()) == list(range(75))
        else:
            assert handed[-1] is None
    assert TI.heavy_and_hot is real_hh  # (patched in train_ops only)



# --- a fourth mutation round (the row and weight-gradient kernels themselves): these had survived


def _ell_case(gated, d=33, f=29, W=6, seed=0):
    """ELL rows with every kind of row at once, M = 7: row 0 heavy (so the slots of du and da a
    masked-off lane falls back to, flat index 0, are never written), row 1 empty, rows 2 and 6
    (the last) exactly W used slots (W = 6 is no multiple of block_e 4: the last step of slots runs
    past W), row 3 every unit (heavy), rows 4 and 5 some. The last unit fires in light rows, 3
    times (no multiple of block_t 4). d = 33 is one past a multiple of block_d 32.
    Whatever a kernel could wrongly read is NaN: x and dy are the leading rows of longer buffers
    whose extra rows are NaN; a and the weights are views with a row stride past their width
    (the launchers take any row stride), NaN in the gap and in extra rows past the last unit."""
    M = 7
    active = [list(range(0, f, 2)), [], [1, 5, 9, 13, 17, f - 1], list(range(f)), [0, 2, 3, f - 2, f - 1], [7],
              [3, 4, 8, 20, f - 2, f - 1]]
    g = torch.Generator().manual_seed(seed)
    a = torch.full((M, f + 3), float("nan"))
    a[:, :f] = -0.5 - torch.rand(M, f, generator=g)
    for m, units in enumerate(active):
        a[m, units] = 0.5 + torch.rand(len(units), generator=g)

    def guarded(rows, cols, gap):
        big = torch.full((rows + GUARD, cols + gap), float("nan"))
        big[:rows, :cols] = torch.randn(rows, cols, generator=g) / math.sqrt(cols)
        return big.to(DEV)[:rows, :cols]

    x, dy = guarded(M, d, 0), guarded(M, d, 0)
    w_up, w_gate, w_down_t = guarded(f, d, 3), guarded(f, d, 5), guarded(f, d, 1)  # three row strides
    return a.to(DEV)[:, :f], x, dy, w_up, (w_gate if gated else None), w_down_t, W


@pytest.mark.parametrize("block_d,split", [(None, False), (32, False), (None, True), (32, True)])
@pytest.mark.parametrize("gated", [True, False])
def test_row_and_weight_grad_kernels_on_every_kind_of_row(gated, block_d, split, monkeypatch):
    """The three training kernels called directly (gated or not, whole-row or blocked over d)
    against float64 sums over the light rows' used slots: y, u, the |h| sums, dx, du and da at
    used slots, and the three weight gradients; and no kernel writes past its outputs. Kills
    mutants every other test survives: a loop over d that stops at d - 1 (d 33, block_d 32), the
    whole-row forward storing u without its slot mask, a launcher passing d (or w_up's) as a
    weight's row stride or f as a's. And kills for certain stores without their column or slot
    mask (y, dx, du, u's zeroing past W, the weight gradients), which elsewhere only corrupt the
    interpreter's heap, at random: on the GPU the last row's land past the buffer and the
    others race with the next row's program."""
    from twell.kernels.train_ffn import ffn_rows_backward, ffn_rows_forward, ffn_weight_grads
    from twell.kernels.train_index import unit_index

    a, x, dy, w_up, w_gate, w_down_t, W = _ell_case(gated)
    (M, d), f = x.shape, a.shape[1]
    cols, g, counts = pack_rows(a, W, block_m=2, block_f=32, num_warps=1)
    order, offsets = unit_index(cols, counts, f)
    c = torch.tensor([0.3], device=DEV)
    rows = dict(block_e=4, block_d=block_d, num_warps=1)
    with monkeypatch.context() as mp:
        # the kernels' outputs: GUARD poisoned rows past each
        handed = guard_empty(mp, lambda size, kw: size in {(M, d), (M, W), (M,), (f, d)})
        y, u, l1_rows = ffn_rows_forward(x, cols, g, counts, w_down_t, w_up if gated else None, **rows)
        dx, du, da = ffn_rows_backward(dy, cols, g, u, counts, w_down_t, w_up, w_gate, c, **rows)
        dwu, dwg, dwdt = ffn_weight_grads(order, offsets, x, dy, g, u, du, da, block_t=4, block_d=block_d, num_warps=1,
                                          split=split)
    assert len(handed) == (9 if gated else 6)
    for h in handed:
        assert untouched(h.guards[1]).all()

    # the reference: dense [M, f] matrices that are zero off the light rows' used slots
    light = counts <= W
    assert torch.equal(counts.long(), (a > 0).sum(1)) and light.tolist() == [False, True, True, False, True, True, True]
    used = (torch.arange(W, device=DEV) < counts.unsqueeze(1)) & light.unsqueeze(1)
    r, s = used.nonzero(as_tuple=True)
    j = cols[r, s].long()
    x64, dy64, wu64, wdt64 = (t.double() for t in (x, dy, w_up, w_down_t))
    G = torch.relu(a.double()) * light.unsqueeze(1)  # a light row's slots hold all its positives
    assert torch.equal(G[r, j], g[r, s].double())
    if gated:
        U = x64 @ wu64.T
        H = G * U
        assert rel_err(u[used], U[r, j]) < 1e-6 and torch.equal(u[~used], torch.zeros_like(u[~used]))
    else:
        H = G
    assert l1_rows.dtype == torch.float32
    assert rel_err(y, H @ wdt64) < 1e-6 and rel_err(l1_rows, H.abs().sum(1)) < 1e-6
    dH = (dy64 @ wdt64.T + 0.3 * torch.sign(H)) * (G != 0)
    if gated:
        dU, dA = dH * G, dH * U
        assert rel_err(du[used], dU[r, j]) < 1e-6 and rel_err(da[used], dA[r, j]) < 1e-6
        assert rel_err(dx, dU @ wu64 + dA @ w_gate.double()) < 1e-6
        assert rel_err(dwg, dA.T @ x64) < 1e-6
    else:
        dU = dH
        assert rel_err(du[used], dH[r, j]) < 1e-6 and rel_err(dx, dH @ wu64) < 1e-6
    assert rel_err(dwu, dU.T @ x64) < 1e-6 and rel_err(dwdt, H.T @ dy64) < 1e-6


@pytest.mark.parametrize("block_d", [None, 32])
def test_rows_forward_sums_h_from_the_u_it_returns_in_fp32(block_d):
    """bf16: each row's |h| sum is the fp32 sum of |g u| over its slots with u as the forward
    returns it (rounded to bf16: the h that y, the backward and the weight gradients use). Kills
    the blocked forward summing |g u| before it rounds u, and l1_rows allocated in x's dtype:
    both stay within every other test's bf16 tolerance."""
    from twell.kernels.train_ffn import ffn_rows_forward

    x, wg, wu, wd = (t.bfloat16() for t in make_case(16, 40, 75, seed=3, adversarial=False))
    cols, g, counts = pack_rows(x @ wg.T, 75)
    _, u, l1_rows = ffn_rows_forward(x, cols, g, counts, wd.t().contiguous(), wu, block_e=4, block_d=block_d)
    assert l1_rows.dtype == torch.float32 and int(counts.sum()) > 20
    want = (g.float() * u.float()).abs().sum(1)  # zeros past each row's count in g and u
    assert rel_err(l1_rows, want) < 1e-6

"""The heavy rows' forward with the row list on the device (twell.kernels.heavy_rows) against
PyTorch: listed rows in any order, entries past the count ignored (poison there), rows not listed
untouched, h written over a, |h| per row and the per-unit counts (Triton interpreter on the CPU
in fp32/fp16/bf16 at odd shapes; the GPU in bf16)."""

from __future__ import annotations

import pytest
import torch

from kernel_cases import case_id, rel_err
from twell.kernels.heavy_rows import heavy_rows_forward

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the Triton interpreter
SMALL = dict(block_m=16, block_n=16, block_k=16, num_warps=1, num_stages=1)


def _case(M, d, f, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, d, generator=g)
    wg = torch.randn(f, d, generator=g) / d ** 0.5
    wu = torch.randn(f, d, generator=g) / d ** 0.5
    wd = torch.randn(d, f, generator=g) / f ** 0.5
    x, wg, wu, wd = (t.to(DEV, dtype) for t in (x, wg, wu, wd))
    return x, wg, wu, wd


def _reference(x, a, rows, wd, wu):
    """h, y, |h| per row and per-unit counts of the listed rows, in fp32 from the rounded inputs."""
    a_r = a[rows].float()
    h = torch.relu(a_r)
    if wu is not None:
        h = h * (x[rows].float() @ wu.float().T).to(x.dtype).float()
    h = h.to(x.dtype)
    return h, h.float() @ wd.float().T, h.float().abs().sum(1), (a_r > 0).sum(0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=case_id)
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("n", [0, 1, 21, 37])
def test_listed_rows_only(dtype, gated, n):
    """M 37, d 40, f 75 (no multiple of a block); two programs walk blocks of 16 rows, so n 21 and
    37 make one of them take two blocks."""
    M, d, f = 37, 40, 75
    x, wg, wu, wd = _case(M, d, f, dtype)
    wu = wu if gated else None
    a = (x.float() @ wg.float().T).to(dtype)
    a0 = a.clone()
    order = torch.randperm(M, generator=torch.Generator().manual_seed(n)).to(DEV)
    rows = torch.full((M + 5,), 10 ** 9, dtype=torch.int64, device=DEV)  # past n: out of range, never read
    rows[:n] = order[:n]
    y = torch.full((M, d), float("nan"), dtype=dtype, device=DEV)
    l1, counts = heavy_rows_forward(x, a, rows, torch.tensor([n], device=DEV), y, wd, wu, **SMALL)
    listed = torch.zeros(M, dtype=torch.bool, device=DEV)
    listed[order[:n]] = True
    assert torch.isnan(y[~listed]).all() and torch.equal(a[~listed], a0[~listed])  # untouched
    assert l1.dtype == torch.float32 and torch.all(l1[~listed] == 0)
    assert counts.dtype == torch.int32 and counts.shape == (f,)
    if n == 0:
        assert torch.all(counts == 0)
        return
    r = order[:n]
    h, y_ref, l1_ref, counts_ref = _reference(x, a0, r, wd, wu)
    tol = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}[dtype]
    assert rel_err(a[r], h) <= tol and rel_err(y[r], y_ref) <= tol and rel_err(l1[r], l1_ref) <= tol
    assert torch.equal(counts.long(), counts_ref)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=case_id)
def test_counts_added_to_a_given_buffer(dtype):
    """``unit_counts=`` adds the listed rows' counts to the caller's buffer (the light rows'
    counts, in the training op) in place and returns it; a wrong buffer is refused."""
    M, d, f = 37, 40, 75
    x, wg, wu, wd = _case(M, d, f, torch.float32, seed=8)
    a = x @ wg.T
    rows = torch.tensor([5, 30, 11, 0], device=DEV)
    base = torch.arange(f, dtype=dtype, device=DEV)
    buf = base.clone()
    _, counts = heavy_rows_forward(x, a.clone(), rows, torch.tensor([4], device=DEV), torch.zeros(M, d, device=DEV), wd, wu,
                                   unit_counts=buf, **SMALL)
    assert counts is buf and counts.dtype == dtype
    assert torch.equal((buf - base).long(), _reference(x, a, rows, wd, wu)[3])
    for bad in (torch.zeros(f, dtype=torch.float32, device=DEV), torch.zeros(f - 1, dtype=dtype, device=DEV)):
        with pytest.raises(ValueError, match="unit_counts"):
            heavy_rows_forward(x, a.clone(), rows, torch.tensor([4], device=DEV), torch.zeros(M, d, device=DEV), wd, wu,
                               unit_counts=bad, **SMALL)


def test_given_buffer_kept_with_no_rows_and_strided_refused():
    """With no row listed the caller's buffer comes back untouched (the light rows' counts, which
    a fresh zero buffer would lose); a strided buffer is refused (the kernel adds at unit
    offsets). Both survived a mutation round."""
    M, d, f = 37, 40, 75
    x, wg, wu, wd = _case(M, d, f, torch.float32, seed=8)
    a = x @ wg.T
    base = torch.arange(f, dtype=torch.int64, device=DEV)
    buf = base.clone()
    _, counts = heavy_rows_forward(x, a.clone(), torch.zeros(0, dtype=torch.int64, device=DEV), torch.tensor([0], device=DEV),
                                   torch.zeros(M, d, device=DEV), wd, wu, unit_counts=buf, **SMALL)
    assert counts is buf and torch.equal(buf, base)
    with pytest.raises(ValueError, match="unit_counts"):
        heavy_rows_forward(x, a.clone(), torch.tensor([5, 30], device=DEV), torch.tensor([2], device=DEV),
                           torch.zeros(M, d, device=DEV), wd, wu, unit_counts=torch.zeros(2 * f, dtype=torch.int32, device=DEV)[::2],
                           **SMALL)


def test_transposed_w_down_and_nan_gate():
    """w_down as a transpose (the modules' eval layout) gives the same rows; a NaN pre-activation
    stays NaN in h and in its row of y, as torch.relu keeps it."""
    x, wg, wu, wd = _case(20, 40, 75, torch.float32, seed=3)
    a = x @ wg.T
    a[4, 7] = float("nan")
    rows = torch.tensor([4, 9, 2], device=DEV)
    outs = []
    for w_down in (wd, wd.t().contiguous().t()):
        a_i, y = a.clone(), torch.zeros(20, 40, device=DEV)
        heavy_rows_forward(x, a_i, rows, torch.tensor([3], device=DEV), y, w_down, wu, **SMALL)
        outs.append((a_i, y))
    assert torch.equal(outs[0][1][[9, 2]], outs[1][1][[9, 2]])
    assert torch.isnan(outs[0][0][4, 7]) and torch.isnan(outs[0][1][4]).all()


def test_validation():
    x, wg, wu, wd = _case(8, 40, 75, torch.float32)
    a = x @ wg.T
    y = torch.zeros(8, 40, device=DEV)
    rows, n = torch.arange(8, device=DEV), torch.tensor([2], device=DEV)
    with pytest.raises(ValueError, match="rows must be int32 or int64"):
        heavy_rows_forward(x, a, rows.float(), n, y, wd, wu)
    with pytest.raises(ValueError, match="n_rows must be"):
        heavy_rows_forward(x, a, rows, n.float(), y, wd, wu)
    with pytest.raises(ValueError, match="y must be"):
        heavy_rows_forward(x, a, rows, n, y[:, :20], wd, wu)
    with pytest.raises(ValueError, match="w_down must be"):
        heavy_rows_forward(x, a, rows, n, y, wd[:, :20], wu)
    with pytest.raises(ValueError, match="a must be|x must be"):
        heavy_rows_forward(x, a.half(), rows, n, y, wd, wu)
    with pytest.raises(ValueError, match="w_up"):
        heavy_rows_forward(x, a, rows, n, y, wd, wu[:, :20])
    with pytest.raises(TypeError, match="y must be a torch.Tensor, got NoneType"):
        heavy_rows_forward(x, a, rows, n, None, wd, wu)


@pytest.mark.parametrize("gated", [True, False])
def test_more_outputs_than_units(gated):
    """d above f by more than a block (d 75, f 40: five column blocks of y, three of h): every
    column of the listed rows of y is written (the down launch's grid follows d, not f)."""
    M, d, f = 20, 75, 40
    x, wg, wu, wd = _case(M, d, f, torch.float32, seed=4)
    wu = wu if gated else None
    a = x @ wg.T
    a0 = a.clone()
    rows = torch.tensor([3, 17, 0, 11], device=DEV)
    y = torch.full((M, d), float("nan"), device=DEV)
    heavy_rows_forward(x, a, rows, torch.tensor([4], device=DEV), y, wd, wu, **SMALL)
    h, y_ref, _, _ = _reference(x, a0, rows, wd, wu)
    listed = torch.zeros(M, dtype=torch.bool, device=DEV)
    listed[rows] = True
    assert torch.isnan(y[~listed]).all()
    assert rel_err(y[rows], y_ref) <= 1e-6 and rel_err(a[rows], h) <= 1e-6


def test_gated_h_rounds_the_up_product_as_the_dense_path():
    """fp16, gated: the up product is rounded to fp16 (what torch.mm would have stored) before
    it multiplies relu(a), so the h written over a is bit for bit the dense path's
    ``(relu(a) * (x @ w_up^T)).half()``. Inputs are multiples of 1/64 in [-1, 1] (d 40): every
    product and sum is exact in fp32, so the fp16 rounding of x @ w_up^T is the only rounding
    before the product and a tolerance would hide it. Kills the mutant that multiplies by the
    unrounded fp32 up product (``u = acc``), which the rel-error checks above let through."""
    M, d, f = 37, 40, 75
    g = torch.Generator().manual_seed(3)
    x, wu = ((torch.randint(-64, 65, s, generator=g) / 64).to(DEV, torch.float16) for s in ((M, d), (f, d)))
    a = torch.randn(M, f, generator=g).to(DEV, torch.float16)
    wd = (torch.randn(d, f, generator=g) / f ** 0.5).to(DEV, torch.float16)
    rows = torch.arange(M, device=DEV).flip(0)
    u = (x.double() @ wu.double().T).to(torch.float16)  # exact sums, then the one rounding
    h_ref = (torch.relu(a.float()) * u.float()).to(torch.float16)
    a_out = a.clone()
    y = torch.full((M, d), float("nan"), dtype=torch.float16, device=DEV)
    heavy_rows_forward(x, a_out, rows, torch.tensor([M], device=DEV), y, wd, wu, **SMALL)
    assert torch.equal(a_out, h_ref)
    assert rel_err(y, h_ref.float() @ wd.float().T) <= 2e-3


def test_nan_gate_counts_as_an_active_unit():
    """A NaN pre-activation is active (relu keeps it, twell.kernels._activity): the per-unit counts
    take it, as the exact path and the light rows count it. Counting ``a > 0`` instead passed the
    other tests, which check the counts only on finite gates (mutation round on heavy_rows.py)."""
    M, d, f = 20, 40, 75
    x, wg, wu, wd = _case(M, d, f, torch.float32, seed=3)
    a = x @ wg.T
    a[4, 7] = a[9, 70] = float("nan")  # the second in the partial last column block (64..74)
    rows = torch.tensor([4, 9, 2], device=DEV)
    expected = (a[rows] > 0).sum(0)
    expected[7] += 1
    expected[70] += 1
    for w_up in (wu, None):
        _, counts = heavy_rows_forward(x, a.clone(), rows, torch.tensor([3], device=DEV), torch.zeros(M, d, device=DEV),
                                       wd, w_up, **SMALL)
        assert torch.equal(counts.long(), expected)

"""The element-wise passes of rows held dense (twell.kernels.dense_rows) against the formulas in
float64: relu, the gated product, |h| per row, active tokens per unit; the backward's
dh = dz + c sign(h), du = dh g, da = dh u [a > 0] (non-gated dh = (dz + c) [a > 0]). Interpreter on
the CPU (fp32, fp16) at shapes that walk every loop twice; bf16 at a real shape on the GPU."""

from __future__ import annotations

import pytest
import torch

from kernel_cases import rel_err
from twell.kernels.dense_rows import dense_rows_backward, dense_rows_forward

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the Triton interpreter
TOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def case(M, f, dtype, seed=0):
    """``(a, u, dz)``: a about 30% positive, with exact zeros, a zero row, a row of all
    positives, and zeros in u where a > 0 (h = 0 on an active unit: sign 0, still counted)."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(M, f, generator=g) - 0.5
    a[:, ::7] = 0.0
    a[0] = 0.0
    if M > 2:
        a[2] = a[2].abs() + 0.1
    u = torch.randn(M, f, generator=g)
    u[:, 1::5] = 0.0
    dz = torch.randn(M, f, generator=g)
    return tuple(t.to(DEV, dtype) for t in (a, u, dz))


def forward_ref(a, u):
    a64 = a.double()
    h = torch.relu(a64) if u is None else torch.relu(a64) * u.double()
    h = h.to(a.dtype)  # the kernel stores h in the input dtype and sums what it stored
    return h, h.double().abs().sum(1), (a > 0).sum(0), (a > 0).sum(1)


def backward_ref(dz, a, u, c):
    a64, dz64 = a.double(), dz.double()
    if u is None:
        return torch.where(a64 > 0, dz64 + c, 0.0), None, None
    g = torch.relu(a64)
    h = (g * u.double()).to(a.dtype)
    dh = dz64 + c * torch.sign(h.double())
    return dh * g, torch.where(a64 > 0, dh * u.double(), 0.0), h


DTYPES = [torch.float32, torch.float16] if DEV == "cpu" else [torch.bfloat16, torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,f", [(1, 1), (7, 5), (33, 300), (18, 257)])
@pytest.mark.parametrize("gated", [True, False])
def test_forward(dtype, M, f, gated):
    a, u, _ = case(M, f, dtype)
    h, l1, counts, row_counts = dense_rows_forward(a, u if gated else None)
    h_ref, l1_ref, counts_ref, row_counts_ref = forward_ref(a, u if gated else None)
    assert h.dtype == dtype and l1.dtype == torch.float32 and counts.dtype == torch.int64
    assert row_counts.dtype == torch.int32
    assert torch.equal(h, h_ref)  # one product of two stored values, rounded once: exact
    assert rel_err(l1, l1_ref) < 1e-6
    assert torch.equal(counts, counts_ref) and torch.equal(row_counts.long(), row_counts_ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,f", [(1, 1), (7, 5), (33, 300), (18, 257)])
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("c,how", [(0.0, "tensor"), (0.0, "none"), (0.25, "tensor"), (0.25, "scaled")])
def test_backward(dtype, M, f, gated, c, how):
    a, u, dz = case(M, f, dtype, seed=1)
    if not gated:
        a = torch.relu(a)  # what the op saves non-gated: h itself
    # c given as it is, as None (no L1 gradient), or as the training ops pass it: l1's gradient
    # (a 0-d tensor) and 1 / M
    c_t, scale = {"tensor": (torch.tensor([c], dtype=torch.float32, device=DEV), 1.0), "none": (None, 1.0),
                  "scaled": (torch.tensor(c * 8, dtype=torch.float32, device=DEV), 1 / 8)}[how]
    d1_ref, da_ref, h_ref = backward_ref(dz, a, u if gated else None, c)
    dz_in = dz.clone()
    d1, da, h = dense_rows_backward(dz_in, a, u if gated else None, c_t, scale)
    assert d1.data_ptr() == dz_in.data_ptr()  # written over dz
    assert rel_err(d1, d1_ref) < TOL[dtype]
    if gated:
        assert rel_err(da, da_ref) < TOL[dtype]
        assert torch.equal(h, h_ref)
        assert not torch.isnan(da).any()
    else:
        assert da is None and h is None


def test_relu_keeps_nan_and_bad_input_is_refused():
    a, u, dz = case(5, 9, torch.float32)
    a[3, 4] = float("nan")
    h, l1, counts, row_counts = dense_rows_forward(a, u)
    assert torch.isnan(h[3, 4]) and torch.isnan(l1[3]) and not torch.isnan(l1[torch.arange(5) != 3]).any()
    # NaN is active (relu keeps it: twell.kernels._activity), in both counts
    assert int(counts[4]) == int((a[:, 4] > 0).sum()) + 1
    assert int(row_counts[3]) == int((a[3] > 0).sum()) + 1
    c = torch.zeros(1, device=DEV)
    # relu's gradient passes at a NaN pre-activation, as torch.relu's does: da = dh u there
    du, da, _ = dense_rows_backward(dz.clone(), a, u, c)
    assert float(da[3, 4]) == float(dz[3, 4] * u[3, 4]) and not torch.isnan(da).any()
    dh, _, _ = dense_rows_backward(dz.clone(), a, None, c)
    assert float(dh[3, 4]) == float(dz[3, 4])
    # with the L1 term: c sign(h) is 0 at a NaN h (torch.sign(NaN) = 0, as dense autograd of
    # |relu(a)| gives), c where h > 0; gated and non-gated alike (non-gated added c at NaN)
    c = torch.full((1,), 0.25, device=DEV)
    dh, _, _ = dense_rows_backward(dz.clone(), a, None, c)
    pos = a > 0
    assert float(dh[3, 4]) == float(dz[3, 4]) and torch.equal(dh[pos], dz[pos] + 0.25)
    du, da, _ = dense_rows_backward(dz.clone(), a, u, c)
    assert float(da[3, 4]) == float(dz[3, 4] * u[3, 4])
    with pytest.raises(ValueError, match="must match"):
        dense_rows_forward(a, u[:, :8].contiguous())
    with pytest.raises(ValueError, match="contiguous"):
        dense_rows_forward(a.t(), None)
    with pytest.raises(TypeError, match="dtype"):
        dense_rows_forward(a.long(), None)
    with pytest.raises(ValueError, match="one-element"):
        dense_rows_backward(dz, a, u, torch.zeros(2, device=DEV))
    with pytest.raises(TypeError, match="dtype"):
        dense_rows_backward(dz, a, u, c.double())


def test_empty():
    a = torch.zeros(0, 6, device=DEV)
    h, l1, counts, row_counts = dense_rows_forward(a, a)
    assert h.shape == (0, 6) and l1.shape == (0,) and row_counts.shape == (0,)
    assert torch.equal(counts, torch.zeros(6, dtype=torch.int64, device=DEV))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("M", [1024, 4096, 20000])
def test_gpu_bf16_real_shape_keeps_the_l1_term(M):
    """f 5632 in bf16, with f split into column chunks (1024 and 4096 tokens) and not (20000): the
    formulas hold, and a c far below half a bf16 step of dz still moves du and da (it is added in
    fp32 before the products)."""
    a, u, dz = case(M, 5632, torch.bfloat16, seed=3)
    h, l1, counts, row_counts = dense_rows_forward(a, u)
    h_ref, l1_ref, counts_ref, row_counts_ref = forward_ref(a, u)
    assert torch.equal(h, h_ref) and rel_err(l1, l1_ref) < 1e-6 and torch.equal(counts, counts_ref)
    assert torch.equal(row_counts.long(), row_counts_ref)
    c = 1e-5
    d1, da, _ = dense_rows_backward(dz.clone(), a, u, torch.tensor([c], device="cuda"))
    d1_0, da_0, _ = dense_rows_backward(dz.clone(), a, u, torch.zeros(1, device="cuda"))
    d1_ref, da_ref, _ = backward_ref(dz, a, u, c)
    assert rel_err(d1, d1_ref) < TOL[torch.bfloat16] and rel_err(da, da_ref) < TOL[torch.bfloat16]
    assert int((d1 != d1_0).sum()) > 0 and int((da != da_0).sum()) > 0


@pytest.mark.parametrize("gated", [True, False])
def test_pytorch_fallback_matches_the_kernels(gated, monkeypatch):
    """CPU tensors without the Triton interpreter (the dense training op on a CPU machine) take the
    PyTorch formulas in dense_rows_forward / _backward_torch: the same outputs as the kernels,
    NaN pre-activations counted as active and the L1 term's sign taken from h, not a (u has zeros
    and negatives where a > 0). The other tests run every call under the interpreter, so a
    fallback that counted ``a > 0`` or took ``sign(a)`` passed them (mutation round on
    dense_rows.py)."""
    a, u, dz = case(7, 30, torch.float32, seed=2)
    a[3, 4] = a[5, 29] = float("nan")
    u = u if gated else None
    c = torch.tensor([0.25])
    outs = {}
    for interpret in ("1", "0"):
        monkeypatch.setenv("TRITON_INTERPRET", interpret)
        fwd = dense_rows_forward(a.clone(), u)
        bwd = dense_rows_backward(dz.clone(), a.clone() if gated else torch.relu(a), u, c)
        outs[interpret] = [*fwd, *(t for t in bwd if t is not None)]
    assert len(outs["0"]) == len(outs["1"])
    for got, want in zip(outs["0"], outs["1"]):
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, equal_nan=True)


@pytest.mark.parametrize("f", [100, 300])
def test_forward_writes_only_its_rows(monkeypatch, f):
    """The per-row outputs (|h| sums, active counts) of M 33 rows, which the kernel's last block
    of 32 rows overhangs, are written in their [M] buffers and nowhere past them (a guard after
    each stays as it was). A store without its row mask wrote past the allocation, which the
    other tests caught only when the heap corruption happened to crash the process. f 100: one
    program per row block; f 300: each row block's columns in chunks (few rows), whose |h| sums
    go to a [chunks * M] buffer and whose row counts add into a zeroed [M] buffer."""
    from twell.kernels.dense_rows import FORWARD_WIDEST, _blocks, _chunks
    from kernel_cases import guard_empty, untouched

    assert (_chunks(33, f, *_blocks(f, FORWARD_WIDEST))[0] > 1) == (f == 300)
    # 1-D buffers: 64 poisoned elements past each, past the last block's overhang (blocks of 32
    # rows, 31 past M)
    handed = guard_empty(monkeypatch, lambda size, kw: len(size) == 1, after=64)
    a, u, _ = case(33, f, torch.float32)
    _, l1, _, row_counts = dense_rows_forward(a, u)
    _, l1_ref, _, row_counts_ref = forward_ref(a, u)
    assert rel_err(l1, l1_ref) < 1e-6 and torch.equal(row_counts.long(), row_counts_ref)
    assert len(handed) == 2 and all(bool(untouched(h.guards[1]).all()) for h in handed)

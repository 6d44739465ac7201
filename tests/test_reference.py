"""The PyTorch references: sparse forms equal dense, and the pattern-restricted backward equals
dense autograd."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsity import rel_err
from twell import reference as ref
from twell.format import pack_hybrid, pack_twell


def make_mlp(M, d, f, seed, dtype=torch.float64, hot=False, heavy=False):
    """Random inputs and weights. ``hot`` biases a few units on for every token (hot units),
    ``heavy`` makes a few rows fire almost everywhere (heavy rows)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, d, generator=g, dtype=dtype)
    w_gate = torch.randn(f, d, generator=g, dtype=dtype) / d**0.5
    w_up = torch.randn(f, d, generator=g, dtype=dtype) / d**0.5
    w_down = torch.randn(d, f, generator=g, dtype=dtype) / f**0.5
    if hot:
        # units 0..f/8 see a large positive gate for the all-ones direction of x
        x[:, 0] = x[:, 0].abs() + 2
        w_gate[: max(1, f // 8), 0] = 3.0
    if heavy and M > 2:
        x[1] = w_gate.sum(0) * 3  # aligns with most gate rows: fires nearly everywhere
    return x, w_gate, w_up, w_down


cases = st.tuples(
    st.integers(1, 19),  # M
    st.integers(1, 13),  # d
    st.integers(1, 70),  # f
    st.integers(0, 2**31 - 1),
    st.booleans(),
    st.booleans(),
)


@settings(max_examples=40, deadline=None)
@given(case=cases, tile_c=st.sampled_from([(16, 8), (16, 2), (32, 4)]))
def test_gated_from_twell_equals_dense(case, tile_c):
    M, d, f, seed, hot, heavy = case
    x, wg, wu, wd = make_mlp(M, d, f, seed, hot=hot, heavy=heavy)
    dense = ref.gated_mlp(x, wg, wu, wd)
    t = pack_twell(torch.relu(x @ wg.T), *tile_c)
    assert rel_err(ref.gated_mlp_from_twell(x, t, wu, wd), dense) < 1e-12
    # a kernel-written TwELL carries no overflow values: they are recomputed from the gate
    t.overflow_index = t.overflow_values = None
    assert rel_err(ref.gated_mlp_from_twell(x, t, wu, wd, w_gate=wg), dense) < 1e-12


def test_overflow_needs_the_gate_when_values_are_missing():
    x, wg, wu, wd = make_mlp(4, 8, 32, seed=0, heavy=True)
    t = pack_twell(torch.relu(x @ wg.T), 16, 8)
    assert t.overflowed().any()
    t.overflow_index = t.overflow_values = None
    with pytest.raises(ValueError, match="w_gate"):
        ref.gated_mlp_from_twell(x, t, wu, wd)


def test_fill_overflow_keeps_the_values_dtype():
    """Recomputed tiles are stored in the TwELL's own dtype, whatever x's and the gate's."""
    x, wg, _, _ = make_mlp(4, 8, 32, seed=0, heavy=True)
    t = pack_twell(torch.relu(x @ wg.T).float(), 16, 8)
    assert t.overflowed().any()
    t.overflow_index = t.overflow_values = None
    filled = ref.fill_overflow(t, x, wg)
    assert filled.overflow_values.dtype == torch.float32


def test_gate_tiles_recomputes_partial_last_tile():
    x, wg, _, _ = make_mlp(3, 5, 20, seed=1)
    tiles = ref.gate_tiles(x, wg, torch.tensor([0, 2]), torch.tensor([1, 0]), tile=16)
    full = torch.relu(x @ wg.T)
    assert torch.allclose(tiles[0, :4], full[0, 16:20]) and torch.all(tiles[0, 4:] == 0)
    assert torch.allclose(tiles[1], full[2, :16])


@settings(max_examples=30, deadline=None)
@given(case=cases, tile_c=st.sampled_from([(16, 8), (32, 2)]))
def test_mlp_from_formats_equals_dense(case, tile_c):
    M, d, f, seed, hot, heavy = case
    x, _, wu, wd = make_mlp(M, d, f, seed, hot=hot, heavy=heavy)
    dense = ref.mlp(x, wu, wd)
    h = torch.relu(x @ wu.T)
    assert rel_err(ref.mlp_from_twell(pack_twell(h, *tile_c), wd), dense) < 1e-12
    assert rel_err(ref.mlp_from_hybrid(pack_hybrid(h, width=3), wd), dense) < 1e-12


@settings(max_examples=40, deadline=None)
@given(case=cases, width=st.integers(1, 8), l1=st.sampled_from([0.0, 0.3]))
def test_gated_backward_equals_autograd(case, width, l1):
    M, d, f, seed, hot, heavy = case
    x, wg, wu, wd = make_mlp(M, d, f, seed, hot=hot, heavy=heavy)
    dy = torch.randn(M, d, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 1))
    leaves = [t.clone().requires_grad_() for t in (x, wg, wu, wd)]
    xl, wgl, wul, wdl = leaves
    h = torch.relu(xl @ wgl.T) * (xl @ wul.T)
    loss = ((h @ wdl.T) * dy).sum() + l1 * h.abs().sum()
    loss.backward()
    g = pack_hybrid(torch.relu(x @ wg.T), width=width)
    assert rel_err(ref.gated_mlp_from_hybrid(x, g, wu, wd), ref.gated_mlp(x, wg, wu, wd)) < 1e-12
    grads = ref.gated_mlp_backward(x, g, wg, wu, wd, dy, l1_coef=l1)
    for name, got, leaf in zip(("dx", "dw_gate", "dw_up", "dw_down"), grads, leaves):
        assert got.shape == leaf.shape and got.is_contiguous(), name
        assert rel_err(got, leaf.grad) < 1e-10, name


@settings(max_examples=30, deadline=None)
@given(case=cases, width=st.integers(1, 8), l1=st.sampled_from([0.0, 0.3]))
def test_mlp_backward_equals_autograd(case, width, l1):
    M, d, f, seed, hot, heavy = case
    x, _, wu, wd = make_mlp(M, d, f, seed, hot=hot, heavy=heavy)
    dy = torch.randn(M, d, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 1))
    xl, wul, wdl = (t.clone().requires_grad_() for t in (x, wu, wd))
    h = torch.relu(xl @ wul.T)
    (((h @ wdl.T) * dy).sum() + l1 * h.abs().sum()).backward()
    grads = ref.mlp_backward(x, pack_hybrid(torch.relu(x @ wu.T), width=width), wu, wd, dy, l1_coef=l1)
    for got, leaf in zip(grads, (xl, wul, wdl)):
        assert got.is_contiguous() and rel_err(got, leaf.grad) < 1e-10


def test_l1_penalty_sums_over_units_and_averages_over_tokens():
    h = torch.tensor([[1.0, -2.0, 0.0], [0.0, 0.0, 3.0]])
    assert ref.l1_penalty(h).item() == pytest.approx((3.0 + 3.0) / 2)


@pytest.mark.parametrize(
    "mutate, error, match",
    [
        (lambda a: a.update(w_gate=a["w_gate"].T.contiguous()), ValueError, r"w_gate must be \[6, 4\]"),
        (lambda a: a.update(w_down=a["w_down"].T.contiguous()), ValueError, r"w_down must be \[4, 6\]"),
        (lambda a: a.update(w_up=a["w_up"].float()), TypeError, "w_up has dtype torch.float32 but x has torch.float64"),
        (lambda a: a.update(x=a["x"][None]), ValueError, "x must be 2-D"),
        (lambda a: a.update(x=a["x"].long()), TypeError, "x must have dtype"),
        (lambda a: a.update(w_up=a["w_up"].to("meta")), ValueError, "is on meta but x is on cpu"),
    ],
)
def test_bad_inputs_are_named(mutate, error, match):
    x, wg, wu, wd = make_mlp(3, 4, 6, seed=0)
    args = dict(x=x, w_gate=wg, w_up=wu, w_down=wd)
    mutate(args)
    with pytest.raises(error, match=match):
        ref.gated_mlp(**args)

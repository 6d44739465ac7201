"""TwELL and hybrid formats: lossless round trips for every input, and clear errors."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsity import PATTERNS, sparse_hidden
from twell.format import (
    Hybrid,
    TwELL,
    hybrid_from_coo,
    pack_hybrid,
    pack_twell,
    twell_slots,
    unpack_hybrid,
    unpack_twell,
)

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]

shapes = st.tuples(st.integers(0, 23), st.integers(1, 97))
common = settings(max_examples=60, deadline=None)


@common
@given(
    shape=shapes,
    pattern=st.sampled_from(PATTERNS),
    density=st.floats(0.0, 1.0),
    tile_compression=st.sampled_from([(16, 2), (16, 4), (16, 8), (32, 8), (64, 4), (256, 8)]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**31 - 1),
)
def test_twell_round_trip(shape, pattern, density, tile_compression, dtype, seed):
    M, f = shape
    tile, C = tile_compression
    h = sparse_hidden(M, f, pattern, density, seed, dtype)
    h[:, ::2] *= -1  # gated hidden values have both signs
    t = pack_twell(h, tile=tile, compression=C)
    t.validate()
    n_tiles = math.ceil(f / tile)
    assert t.values.shape == (M, n_tiles, tile // C - 1)
    # counts are the true counts per (row, tile), also for overflowed tiles
    padded = torch.nn.functional.pad(h, (0, n_tiles * tile - f))
    assert torch.equal(t.counts, (padded.view(M, n_tiles, tile) != 0).sum(-1).int())
    assert t.nnz_per_row().dtype == torch.int64 and torch.equal(t.nnz_per_row(), (h != 0).sum(1))
    # the slots of every tile hold its entries in ascending column order (overflowed tiles too:
    # their first slots)
    used = torch.arange(t.slots) < t.counts.clamp(max=t.slots).unsqueeze(-1)
    cols = t.cols.long()
    assert bool(((cols[..., 1:] > cols[..., :-1]) | ~used[..., 1:]).all())
    out = unpack_twell(t)
    assert out.is_contiguous() and torch.equal(out, h)


def test_twell_slots_hold_entries_in_column_order():
    h = torch.zeros(2, 20)
    h[0, [3, 1, 17]] = torch.tensor([5.0, 7.0, 9.0])
    t = pack_twell(h, tile=16, compression=4)  # 3 slots per tile
    assert t.counts.tolist() == [[2, 1], [0, 0]]
    assert t.cols[0, 0, :2].tolist() == [1, 3]
    assert t.values[0, 0, :2].tolist() == [7.0, 5.0]
    assert t.cols[0, 1, 0].item() == 1 and t.values[0, 1, 0].item() == 9.0


def test_twell_overflow_is_marked_and_lossless():
    h = torch.zeros(3, 32)
    h[1, :16] = torch.arange(1, 17, dtype=torch.float32)  # 16 non-zeros, 3 slots: overflows
    h[2, 20] = 1.0
    t = pack_twell(h, tile=16, compression=4)
    assert t.overflowed().tolist() == [[False, False], [True, False], [False, False]]
    assert t.overflow_index.tolist() == [2]  # row 1, tile 0 -> 1 * 2 + 0
    assert torch.equal(t.overflow_values[0], h[1, :16])
    assert torch.equal(unpack_twell(t), h)


def test_twell_unused_slots_are_never_read():
    h = sparse_hidden(7, 50, "random", 0.1, seed=1, dtype=torch.float32)
    t = pack_twell(h, tile=16, compression=2)
    used = torch.arange(t.slots) < t.counts.unsqueeze(-1)
    t.values = torch.where(used, t.values, torch.full_like(t.values, float("nan")))
    t.cols = torch.where(used, t.cols, torch.full_like(t.cols, 12345))
    assert torch.equal(unpack_twell(t), h)


def test_twell_without_overflow_values_refuses_to_unpack():
    h = torch.ones(1, 16)
    t = pack_twell(h, tile=16, compression=8)
    t.overflow_index = t.overflow_values = None
    with pytest.raises(ValueError, match="fill_overflow"):
        unpack_twell(t)


@pytest.mark.parametrize(
    "tile, compression, match",
    [(16, 3, "compression"), (24, 4, "power of two"), (8, 8, "at least"), (65536, 8, "32768")],
)
def test_twell_bad_parameters(tile, compression, match):
    with pytest.raises(ValueError, match=match):
        pack_twell(torch.ones(2, 8), tile=tile, compression=compression)


def test_twell_bad_input():
    with pytest.raises(ValueError, match=r"2-D \[M, f\]"):
        pack_twell(torch.ones(2, 3, 4), tile=16, compression=4)
    with pytest.raises(TypeError, match="float16, bfloat16"):
        pack_twell(torch.ones(2, 8, dtype=torch.int32), tile=16, compression=4)
    with pytest.raises(TypeError, match="torch.Tensor"):
        pack_twell([[1.0, 0.0]], tile=16, compression=4)


def test_unpack_twell_of_a_kernel_written_twell():
    """As the pack kernels leave it (an overflowed tile's slots unwritten: NaN values and
    out-of-tile columns under the tests' fixture), after fill_overflow: the exact matrix."""
    from kernel_cases import packed
    from twell.reference import fill_overflow

    a = torch.randn(4, 40, generator=torch.Generator().manual_seed(0))
    a[2] = 1.0  # every tile of row 2 overflows
    t = packed(a, 16, 4)
    assert bool(t.overflowed().any())
    t = fill_overflow(t, a, torch.eye(40))  # the gate recomputed as relu(a eye^T) = relu(a)
    assert torch.equal(unpack_twell(t), torch.relu(a))


@pytest.mark.parametrize("call, error, match", [
    (lambda: unpack_twell(torch.ones(2, 8)), TypeError, "must be a twell.TwELL, got Tensor"),
    (lambda: unpack_hybrid(torch.ones(2, 8)), TypeError, "must be a twell.Hybrid, got Tensor"),
    (lambda: pack_hybrid(torch.ones(2, 8), width=2.5), ValueError, "width must be an int >= 1, got 2.5"),
    (lambda: pack_hybrid(torch.ones(2, 8), width=None), ValueError, "width must be an int >= 1, got None"),
    (lambda: pack_twell(torch.ones(2, 8, device="meta"), tile=16, compression=4), ValueError, "meta device"),
    (lambda: pack_hybrid(torch.ones(2, 8, device="meta")), ValueError, "meta device"),
    # 8.0 == 8: a membership test took it, and the shapes made from it failed inside torch
    (lambda: pack_twell(torch.ones(2, 40), tile=16, compression=4.0), ValueError, "compression must be 2, 4 or 8, got 4.0"),
    (lambda: twell_slots(32, 8.0), ValueError, "compression must be 2, 4 or 8, got 8.0"),
    (lambda: twell_slots(True, 2), ValueError, "tile must be a power of two"),
], ids=["unpack_twell", "unpack_hybrid", "width-float", "width-None", "pack_twell-meta", "pack_hybrid-meta",
        "compression-float", "slots-compression-float", "tile-bool"])
def test_format_bad_arguments(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_twell_slots():
    assert twell_slots(256, 8) == 31 and twell_slots(256, 2) == 127 and twell_slots(16, 4) == 3
    # the widest tile int16 columns can index, accepted
    assert twell_slots(32768, 8) == 4095
    assert torch.equal(unpack_twell(pack_twell(torch.ones(1, 8), tile=32768, compression=8)), torch.ones(1, 8))


def test_twell_validate_catches_inconsistency():
    t = pack_twell(torch.ones(2, 16), tile=16, compression=8)
    t.validate()
    bad = TwELL(t.values, t.cols.int(), t.counts, t.f, t.tile, t.compression, t.overflow_index, t.overflow_values)
    with pytest.raises(ValueError, match="int16"):
        bad.validate()
    bad = TwELL(t.values, t.cols, t.counts, 40, t.tile, t.compression, t.overflow_index, t.overflow_values)
    with pytest.raises(ValueError, match="tiles cannot hold"):
        bad.validate()
    h = torch.zeros(2, 32)
    h[1, :16] = 1.0  # row 1's first tile overflows
    t = pack_twell(h, tile=16, compression=8)
    t.validate()
    bad = TwELL(t.values, t.cols, t.counts, t.f, t.tile, t.compression, t.overflow_index + 1, t.overflow_values)
    with pytest.raises(ValueError, match="overflow_index"):
        bad.validate()


# --- hybrid ---------------------------------------------------------------------------------


@common
@given(
    shape=shapes,
    pattern=st.sampled_from(PATTERNS),
    density=st.floats(0.0, 1.0),
    width=st.integers(1, 40),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**31 - 1),
)
def test_hybrid_round_trip_and_transpose(shape, pattern, density, width, dtype, seed):
    M, f = shape
    h = sparse_hidden(M, f, pattern, density, seed, dtype)
    h[:, ::2] *= -1  # gated hidden values have both signs
    hy = pack_hybrid(h, width=width)
    hy.validate()
    nnz = (h != 0).sum(1)
    assert torch.equal(hy.counts, nnz.int())
    # the backup holds exactly the heavy rows: no capacity, nothing dropped
    assert torch.equal(hy.heavy_rows, torch.nonzero(nnz > width).flatten())
    assert hy.heavy_values.shape == (int((nnz > width).sum()), f)
    assert torch.equal(unpack_hybrid(hy), h)
    ht = hy.transpose()
    ht.validate()
    assert ht.shape == (f, M)
    assert torch.equal(unpack_hybrid(ht), h.T)
    back = ht.transpose(width=3)
    assert back.width == 3 and torch.equal(unpack_hybrid(back), h)


def test_hybrid_many_heavy_rows_are_all_kept():
    # More heavy rows than any fixed backup would hold in proportion: every row is heavy.
    h = sparse_hidden(300, 64, "full", 1.0, seed=3, dtype=torch.float32)
    hy = pack_hybrid(h, width=4)
    assert hy.heavy_rows.numel() == 300
    assert torch.equal(unpack_hybrid(hy), h)


def test_hybrid_coo_is_row_major_sorted():
    h = sparse_hidden(9, 30, "heavy_rows", 0.2, seed=4, dtype=torch.float32)
    rows, cols, vals = pack_hybrid(h, width=3).to_coo()
    key = rows * 30 + cols
    assert torch.all(key[1:] > key[:-1])
    assert torch.equal(vals, h[rows, cols])


def test_hybrid_from_coo_any_order():
    h = sparse_hidden(6, 11, "random", 0.4, seed=5, dtype=torch.float32)
    r, c = torch.nonzero(h, as_tuple=True)
    perm = torch.randperm(r.numel())
    hy = hybrid_from_coo(r[perm], c[perm], h[r, c][perm], (6, 11), width=2)
    assert torch.equal(unpack_hybrid(hy), h)
    with pytest.raises(ValueError, match="width"):
        hybrid_from_coo(r, c, h[r, c], (6, 11), width=0)


def test_hybrid_validate_catches_inconsistency():
    hy = pack_hybrid(sparse_hidden(5, 9, "dense_rows", 0.2, seed=6, dtype=torch.float32), width=2)
    bad = Hybrid(hy.values, hy.cols, hy.counts, hy.heavy_rows[:0], hy.heavy_values[:0], hy.n_cols)
    with pytest.raises(ValueError, match="heavy_rows"):
        bad.validate()


def test_hybrid_transpose_width_zero_is_refused_and_none_keeps_the_width():
    """``width or self.width`` read 0 as "the default": transpose(0) returned the old width."""
    hy = pack_hybrid(torch.eye(6), width=3)
    with pytest.raises(ValueError, match="width must be an int >= 1, got 0"):
        hy.transpose(0)
    assert hy.transpose().width == 3 and hy.transpose(None).width == 3 and hy.transpose(1).width == 1


@pytest.mark.parametrize("rows, cols, match", [
    ([0, 9], [1, 2], r"rows must lie in \[0, 8\)"),
    ([0, -1], [1, 2], r"rows must lie in \[0, 8\)"),
    # a column at n_cols was stored in the ELL slots without an error (and read back past the
    # matrix's edge)
    ([0, 1], [1, 64], r"cols must lie in \[0, 64\)"),
    ([0, 1], [-3, 2], r"cols must lie in \[0, 64\)"),
    ([0, 1], [1], "1-D of one length"),
    ([[0, 1]], [[1, 2]], "1-D of one length"),
], ids=["row-past", "row-negative", "col-past", "col-negative", "length", "2-D"])
def test_hybrid_from_coo_refuses_coordinates_outside_the_shape(rows, cols, match):
    values = torch.ones(len(rows) if isinstance(rows[0], int) else 2)
    with pytest.raises(ValueError, match=match):
        hybrid_from_coo(torch.tensor(rows), torch.tensor(cols), values, (8, 64), 4)
    with pytest.raises(ValueError, match="integer coordinates"):
        hybrid_from_coo(torch.tensor([0.0, 1.0]), torch.tensor([1, 2]), torch.ones(2), (8, 64), 4)
    # the edges themselves are inside
    h = hybrid_from_coo(torch.tensor([0, 7]), torch.tensor([63, 0]), torch.tensor([2.0, 3.0]), (8, 64), 4)
    want = torch.zeros(8, 64)
    want[0, 63], want[7, 0] = 2.0, 3.0
    assert torch.equal(unpack_hybrid(h), want)


def test_twell_validate_checks_every_field():
    """Each field validate() covers, made wrong alone on a TwELL that is otherwise valid (one
    overflowed tile, so that the overflow fields are in play)."""
    h = torch.zeros(2, 32)
    h[1, :16] = 1.0
    t = pack_twell(h, tile=16, compression=8)
    t.validate()
    fields = dict(values=t.values, cols=t.cols, counts=t.counts, f=t.f, tile=t.tile, compression=t.compression,
                  overflow_index=t.overflow_index, overflow_values=t.overflow_values)
    bad_cases = [
        (dict(counts=t.counts.long()), "counts must be int32"),
        (dict(counts=t.counts[:, :1]), "counts must be int32"),
        # one slot fewer than tile // compression - 1, in values and cols alike
        (dict(values=t.values[..., :-1], cols=t.cols[..., :-1]), "slots"),
        (dict(overflow_values=None), "both be set or both be None"),
        (dict(overflow_index=None), "both be set or both be None"),
        (dict(overflow_values=t.overflow_values[:, :8]), r"overflow_values must be \[1, 16\]"),
    ]
    for change, match in bad_cases:
        with pytest.raises(ValueError, match=match):
            TwELL(**{**fields, **change}).validate()
    # kernel-written: neither overflow field, which is valid
    TwELL(**{**fields, "overflow_index": None, "overflow_values": None}).validate()


def test_hybrid_validate_checks_every_field():
    hy = pack_hybrid(sparse_hidden(5, 9, "dense_rows", 0.2, seed=6, dtype=torch.float32), width=2)
    hy.validate()
    assert hy.heavy_rows.numel()  # the backup is in play
    fields = dict(values=hy.values, cols=hy.cols, counts=hy.counts, heavy_rows=hy.heavy_rows,
                  heavy_values=hy.heavy_values, n_cols=hy.n_cols)
    bad_cases = [
        (dict(cols=hy.cols.long()), "cols must be int32"),
        (dict(counts=hy.counts.long()), "counts must be int32"),
        (dict(counts=hy.counts.unsqueeze(1)), "counts must be int32"),
        (dict(heavy_values=hy.heavy_values[:, :-1]), r"heavy_values must be \[\d+, 9\]"),
    ]
    for change, match in bad_cases:
        with pytest.raises(ValueError, match=match):
            Hybrid(**{**fields, **change}).validate()


def test_hybrid_from_coo_refuses_the_row_at_n_rows_bools_and_other_devices():
    """A row index equal to n_rows is one past the end (the check on the columns' edge is
    tested above); bool tensors are masks, not coordinates; coordinates on another device than
    the values are refused before any work."""
    ones = torch.ones(2)
    with pytest.raises(ValueError, match=r"rows must lie in \[0, 8\)"):
        hybrid_from_coo(torch.tensor([0, 8]), torch.tensor([1, 2]), ones, (8, 64), 4)
    with pytest.raises(ValueError, match="integer coordinates"):
        hybrid_from_coo(torch.tensor([True, False]), torch.tensor([1, 2]), ones, (8, 64), 4)
    with pytest.raises(ValueError, match="one device"):
        hybrid_from_coo(torch.tensor([0, 1], device="meta"), torch.tensor([1, 2]), ones, (8, 64), 4)

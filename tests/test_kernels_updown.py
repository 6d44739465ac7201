"""FFN-from-TwELL kernel, ops and module kernel path against the PyTorch references
(Triton interpreter on the CPU in fp32/fp16; GPU tests in bf16 at real shapes).

The kernel tests take their TwELL from ``kernel_cases.packed`` (what the pack kernels write,
built in PyTorch, unwritten slots NaN); the ops and module tests run the pack kernels too."""

from __future__ import annotations

import pytest
import torch

import twell
from kernel_cases import case_id, gate_case, packed, rel_err
from twell import reference as R
from twell.kernels import OverflowCounters, ffn_from_twell, gate_pack_fused, updown
from twell.inference.ops import gate_to_twell, prepare_gated_weights, twell_gated_mlp, twell_mlp

TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1e-2}
SHAPES = [(13, 40, 100, 32, 4), (8, 72, 70, 16, 8), (5, 24, 37, 64, 2)]  # M, d, f, tile, C
# Every shape in fp32; fp16 (its loads, the fp16 rounding of recomputed gates, the rows kernel's
# tf32 dots) on the first, which has several tiles, a partial one and overflows: the other
# shapes' geometry (padded d, one-slot tiles, one tile wider than f) does not depend on the dtype.
CASES = [(torch.float32, *shape) for shape in SHAPES] + [(torch.float16, *SHAPES[0])]


@pytest.mark.parametrize("dtype,M,d,f,tile,C", CASES, ids=case_id)
@pytest.mark.parametrize("source", ["pre", "recompute"])
@pytest.mark.parametrize("kernel", ["token", "token-two-pass", "rows", "split"])
def test_gated_from_twell(dtype, M, d, f, tile, C, source, kernel, monkeypatch):
    if kernel == "token-two-pass":  # overflowed tiles in a second launch, as for large M
        monkeypatch.setattr(updown, "TWO_PASS_MIN_M", 0)
        kernel = "token"
    x, wg, wu, wd = gate_case(M, d, f, dtype, seed=M + d + f)
    ref = R.gated_mlp(x.double(), wg.double(), wu.double(), wd.double())
    pre = x @ wg.T
    if kernel == "rows":  # one tile per row
        tile = 128 if f > 64 else 64
    g = packed(pre, tile, C)
    assert bool(g.overflowed().any())
    w = prepare_gated_weights(wu, wd)
    c = OverflowCounters.zeros("cpu")
    kw = dict(pre=pre) if source == "pre" else dict(w_first=wg)
    y = ffn_from_twell(x, g, w.down_t, w_up=w.up, counters=c, kernel=kernel, **kw)
    assert y.dtype == dtype and y.shape == (M, d)
    assert rel_err(y, ref) < TOL[dtype]
    assert torch.all(y[1] == 0)  # the all-zero row
    over = g.overflowed()
    assert int(c.tiles) == int(over.sum()) and int(c.rows) == int(over.any(dim=1).sum())
    # the counters accumulate; separate (unfused) layout gives the same result
    y2 = ffn_from_twell(x, g, wd.T.contiguous(), w_up=wu, counters=c, kernel=kernel, **kw)
    assert int(c.tiles) == 2 * int(over.sum())
    assert torch.equal(y, y2)
    if kernel == "split":  # the same products in the same order as the fused two-pass kernels'
        out = torch.full((M, d), float("nan"), dtype=dtype)
        assert torch.equal(ffn_from_twell(x, g, w.down_t, w_up=w.up, kernel="split", out=out, **kw), y)
        monkeypatch.setattr(updown, "TWO_PASS_MIN_M", 0)
        assert torch.equal(ffn_from_twell(x, g, w.down_t, w_up=w.up, kernel="token", **kw), y)


def test_exact_path_is_needed():
    """Consuming only the stored slots of overflowed tiles (what a kernel without the exact
    path would do) is measurably wrong on these cases: the tests above can fail."""
    x, wg, wu, wd = gate_case(13, 40, 100, torch.float32, seed=1)
    g = twell.pack_twell(torch.relu(x @ wg.T), 32, 4)  # keeps the first `slots` entries of every tile
    truncated = twell.TwELL(g.values, g.cols, g.counts.clamp(max=g.slots), g.f, g.tile, g.compression)
    y_bad = ffn_from_twell(x, truncated, wd.T.contiguous(), w_up=wu, w_first=wg)
    assert rel_err(y_bad, R.gated_mlp(x, wg, wu, wd)) > 1e-2


@pytest.mark.parametrize("dtype,M,d,f,tile,C", [case for case in CASES if case[1:] != SHAPES[2]], ids=case_id)
@pytest.mark.parametrize("kernel", ["token", "token-two-pass", "rows"])
def test_mlp_from_twell(dtype, M, d, f, tile, C, kernel, monkeypatch):
    if kernel == "token-two-pass":
        monkeypatch.setattr(updown, "TWO_PASS_MIN_M", 0)
        kernel = "token"
    x, wu, _, wd = gate_case(M, d, f, dtype, seed=M * 7)
    ref = R.mlp(x.double(), wu.double(), wd.double())
    pre = x @ wu.T
    h = packed(pre, 128 if kernel == "rows" else tile, C)
    assert bool(h.overflowed().any())
    for kw in (dict(pre=pre), dict(w_first=wu)):
        y = ffn_from_twell(x, h, wd.T.contiguous(), kernel=kernel, **kw)
        assert rel_err(y, ref) < TOL[dtype]


@pytest.mark.parametrize("tile", [32, 128])
@pytest.mark.parametrize("kernel", ["token", "token-two-pass", "split"])
def test_stats_outputs(tile, kernel, monkeypatch):
    if kernel == "token-two-pass":
        monkeypatch.setattr(updown, "TWO_PASS_MIN_M", 0)
        kernel = "token"
    x, wg, wu, wd = gate_case(13, 40, 100, torch.float32, seed=5)
    pre = x @ wg.T
    g = packed(pre, tile, 4)
    assert bool(g.overflowed().any())
    uc = torch.zeros(100, dtype=torch.int32)
    nnz = torch.empty(13, dtype=torch.int32)
    ffn_from_twell(x, g, wd.T.contiguous(), w_up=wu, pre=pre, unit_counts=uc, row_nnz=nnz, kernel=kernel)
    assert torch.equal(uc.long(), (pre > 0).sum(0))
    assert torch.equal(nnz.long(), (pre > 0).sum(1))


@pytest.mark.parametrize("dtype,M,d,f,tile,C", CASES, ids=case_id)
@pytest.mark.parametrize("kernel", ["token", "split"])
@pytest.mark.parametrize("row_limit", [None, "boundary", -1])
def test_overflowed_rows_dense(dtype, M, d, f, tile, C, kernel, row_limit, monkeypatch):
    """With ``pre_writable`` (the modules' and ops' calls), from TWO_PASS_MIN_M tokens the rows
    with an overflowed tile or more than DENSE_ROW_MIN active units ("boundary": the fewest
    active units of a row that fits its tiles, so that rows of exactly that many stay and longer
    ones are listed; -1: every row) are listed on the device and computed whole as the dense
    MLP does (twell.kernels.heavy_rows): every row of a NaN-filled output written and right,
    the statistics and counters as the exact path gives them, pre's listed rows overwritten
    with h and no other; without the flag pre is only read. x with strided rows takes the same
    path. Lists built by blocks of 4 rows, so that several list programs append to one list."""
    monkeypatch.setattr(updown, "TWO_PASS_MIN_M", 0)
    monkeypatch.setattr(updown, "LIST_ROWS_BLOCK", 4)
    x, wg, wu, wd = gate_case(M, d, f, dtype, seed=M + 3 * d + f)
    ref = R.gated_mlp(x.double(), wg.double(), wu.double(), wd.double())
    pre = x @ wg.T
    g = packed(pre, tile, C)
    overflowed = g.overflowed().any(dim=1)
    active = (pre > 0).sum(dim=1)
    if row_limit == "boundary":
        fitting = active[~overflowed & (active > 0)]
        row_limit = int(fitting.min()) if fitting.numel() else 0
    if row_limit is not None:
        monkeypatch.setattr(updown, "DENSE_ROW_MIN", row_limit)
    listed = overflowed | (active > updown.DENSE_ROW_MIN)
    assert bool(listed.any()) and (row_limit == -1) == bool(listed.all())
    if row_limit is not None and not bool((listed & ~overflowed).any()):
        pytest.skip("every row above the limit overflows a tile here (one-slot tiles)")
    w = prepare_gated_weights(wu, wd)
    runs = {}
    for writable in (True, False):
        p = pre.clone()
        c = OverflowCounters.zeros("cpu")
        uc = torch.zeros(f, dtype=torch.int32)
        nnz = torch.full((M,), -1, dtype=torch.int32)
        out = torch.full((M, d), float("nan"), dtype=dtype)
        y = ffn_from_twell(x, g, w.down_t, w_up=w.up, pre=p, counters=c, unit_counts=uc, row_nnz=nnz, kernel=kernel,
                           out=out, pre_writable=writable)
        assert y.data_ptr() == out.data_ptr() and rel_err(y, ref) < TOL[dtype]
        assert rel_err(y[listed], ref[listed]) < TOL[dtype]
        assert int(c.tiles) == int(g.overflowed().sum()) and int(c.rows) == int(overflowed.sum())
        assert torch.equal(uc.long(), (pre > 0).sum(0)) and torch.equal(nnz.long(), (pre > 0).sum(1))
        runs[writable] = (y, p)
    y, p = runs[True]
    assert torch.equal(p[~listed], pre[~listed])
    h = torch.relu(pre[listed]) * (x[listed] @ wu.T)  # what the listed rows of pre now hold
    torch.testing.assert_close(p[listed], h, rtol=TOL[dtype], atol=TOL[dtype])
    assert torch.equal(runs[False][1], pre)  # only read
    assert torch.equal(y[~listed], runs[False][0][~listed])  # the other rows: the same kernels
    # non-gated: h = relu(pre), listed rows dense too
    pre_u = x @ wu.T
    hu = packed(pre_u, tile, C)
    if bool(hu.overflowed().any()):
        y_u = ffn_from_twell(x, hu, wd.T.contiguous(), pre=pre_u.clone(), pre_writable=True)
        assert rel_err(y_u, R.mlp(x.double(), wu.double(), wd.double())) < TOL[dtype]
    # x with unit-stride but strided rows: the same listed rows, the same y and pre
    wide = torch.zeros(M, d + 3, dtype=dtype)
    wide[:, :d] = x
    p_nc = pre.clone()
    y_nc = ffn_from_twell(wide[:, :d], g, w.down_t, w_up=w.up, pre=p_nc, kernel=kernel, pre_writable=True)
    assert torch.equal(p_nc, p) and torch.equal(y_nc, y)


def test_weights_past_int32_offsets_take_the_exact_launch(monkeypatch):
    """The heavy-rows kernels address weights with int32 offsets: weights whose views span 2^31
    elements or more (none real: the span is checked on meta tensors) are refused there, and
    ffn_from_twell takes the exact launch instead of listing rows (here with the limit lowered
    so that a small case crosses it: pre is left as it was, y as without pre_writable)."""
    from twell.kernels import heavy_rows

    meta = dict(device="meta", dtype=torch.bfloat16)
    assert heavy_rows.weights_addressable(torch.empty(131072, 16384, **meta), None)  # last element 2^31 - 1
    assert not heavy_rows.weights_addressable(torch.empty(131073, 16384, **meta))
    fused = torch.empty(65536, 2 * 16384, **meta)  # the second half of a fused [f, 2d] matrix
    assert heavy_rows.weights_addressable(fused[:, 16384:])
    assert not heavy_rows.weights_addressable(torch.empty(65537, 2 * 16384, **meta)[:, 16384:])
    assert not heavy_rows.weights_addressable(torch.empty(16384, 131073, **meta).t())  # w_down_t as a view
    M, d, f = 2, 16384, 131073
    x, a, y = torch.empty(M, d, **meta), torch.empty(M, f, **meta), torch.empty(M, d, **meta)
    rows, n = torch.zeros(M, dtype=torch.int64, device="meta"), torch.ones(1, dtype=torch.int64, device="meta")
    with pytest.raises(ValueError, match="2\\^31"):
        heavy_rows.heavy_rows_forward(x, a, rows, n, y, torch.empty(d, f, **meta), torch.empty(f, d, **meta))

    monkeypatch.setattr(updown, "TWO_PASS_MIN_M", 0)
    monkeypatch.setattr(heavy_rows, "_MAX_SPAN", 40 * 100 - 1)  # w_up [100, 40] reaches element 3999
    x, wg, wu, wd = gate_case(13, 40, 100, torch.float32, seed=5)
    pre = x @ wg.T
    g = packed(pre, 16, 2)
    assert bool(g.overflowed().any())
    p = pre.clone()
    y = ffn_from_twell(x, g, wd.T.contiguous(), w_up=wu, pre=p, pre_writable=True)
    assert torch.equal(p, pre) and torch.equal(y, ffn_from_twell(x, g, wd.T.contiguous(), w_up=wu, pre=pre))
    assert rel_err(y, R.gated_mlp(x.double(), wg.double(), wu.double(), wd.double())) < TOL[torch.float32]


@pytest.mark.parametrize("kernel", ["token", "split"])
def test_dense_rows_from_exactly_two_pass_min_m(kernel, monkeypatch):
    """The dense-rows path starts at TWO_PASS_MIN_M tokens inclusive, with the two launches it
    needs: at M = TWO_PASS_MIN_M every listed row (here every row: DENSE_ROW_MIN -1) is computed
    whole (pre's rows overwritten with h, y right, its rows never taken by the first launch alone),
    one token short of it pre is only read. The row list is written inside its [M] buffer (a
    guard past its end stays as it was)."""
    from kernel_cases import GUARD, I16, guard_empty

    M, d, f = 13, 40, 100
    x, wg, wu, wd = gate_case(M, d, f, torch.float32, seed=21)
    ref = R.gated_mlp(x.double(), wg.double(), wu.double(), wd.double())
    pre = x @ wg.T
    g = packed(pre, 32, 4)
    overflowed = g.overflowed().any(dim=1)
    assert bool(overflowed.any()) and int(((pre > 0).sum(1) > 0)[~overflowed].sum()) >= 2
    monkeypatch.setattr(updown, "DENSE_ROW_MIN", -1)
    # 1-D int32 scratch: GUARD elements before and past it, filled with I16
    handed = guard_empty(monkeypatch, lambda size, kw: len(size) == 1 and kw.get("dtype") == torch.int32, before=GUARD)
    w = prepare_gated_weights(wu, wd)
    for two_pass_min_m, dense in ((M, True), (M + 1, False)):
        monkeypatch.setattr(updown, "TWO_PASS_MIN_M", two_pass_min_m)
        p = pre.clone()
        out = torch.full((M, d), float("nan"))
        y = ffn_from_twell(x, g, w.down_t, w_up=w.up, pre=p, kernel=kernel, out=out, pre_writable=True)
        assert rel_err(y, ref) < 1e-5, two_pass_min_m
        if dense:
            torch.testing.assert_close(p, torch.relu(pre) * (x @ wu.T), rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(p, pre)
    assert len(handed) == 1 and all(bool((g == I16).all()) for g in handed[0].guards)


def test_overflowed_rows_list_without_overflow(monkeypatch):
    """Nothing overflowed: the list is empty, y is the per-row path's bit for bit, pre untouched."""
    monkeypatch.setattr(updown, "TWO_PASS_MIN_M", 0)
    x, wg, wu, wd = gate_case(13, 40, 100, torch.float32, seed=4, adversarial=False)
    pre = x @ wg.T
    g = packed(pre, 128, 2)
    assert not bool(g.overflowed().any())
    p = pre.clone()
    c = OverflowCounters.zeros("cpu")
    y = ffn_from_twell(x, g, wd.T.contiguous(), w_up=wu, pre=p, counters=c, pre_writable=True)
    assert torch.equal(y, ffn_from_twell(x, g, wd.T.contiguous(), w_up=wu, pre=pre)) and torch.equal(p, pre)
    assert int(c.tiles) == 0 and int(c.rows) == 0


def test_split_path_from_split_min_m(monkeypatch):
    """"auto" splits gated calls of SPLIT_MIN_M tokens and more (with SPLIT_CONFIG's shape unless
    the caller gives one), never a non-gated call; "split" needs w_up."""
    x, wg, wu, wd = gate_case(13, 40, 100, torch.float32, seed=9)
    pre = x @ wg.T
    g = packed(pre, 32, 4)
    wdt = wd.T.contiguous()
    assert updown.splits(updown.SPLIT_MIN_M, True) and not updown.splits(updown.SPLIT_MIN_M - 1, True)
    assert not updown.splits(10**6, False) and updown.splits(1, True, "split") and not updown.splits(10**6, True, "token")
    assert updown.default_config(2048, split=True) == updown.SPLIT_CONFIG[2048]
    # by width: d 4096 (and what pads to it) splits from SPLIT_MIN_M_BY_D's batch, d 2048 from SPLIT_MIN_M's
    m4 = updown.SPLIT_MIN_M_BY_D[4096]
    assert m4 < updown.SPLIT_MIN_M and updown.split_min_m(4096) == updown.split_min_m(3000) == m4
    assert updown.splits(m4, True, d=4096) and updown.splits(m4, True, d=3000) and not updown.splits(m4 - 1, True, d=4096)
    assert not updown.splits(m4, True, d=2048) and not updown.splits(m4, True) and not updown.splits(m4, False, d=4096)
    assert updown.split_min_m(2048) == updown.split_min_m() == updown.SPLIT_MIN_M
    launched = []
    real_up = updown._twell_up_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                launched.append((kw["BE"], kw["num_warps"]))
                return real_up[grid](*args, **kw)
            return launch

    monkeypatch.setattr(updown, "_twell_up_kernel", Spy())
    monkeypatch.setattr(updown, "TWO_PASS_MIN_M", 0)  # the overflowed tiles in a second launch, as split
    # bit for bit as the fused kernels with the same entries per step (the order of the sums)
    y4, y2 = (ffn_from_twell(x, g, wdt, w_up=wu, pre=pre, block_e=be) for be in (4, 2))
    assert launched == []
    monkeypatch.setitem(updown.SPLIT_CONFIG, 64, (4, 2))  # d 40 pads to 64
    # by width: ffn_from_twell passes x's d, so a threshold for d 64 alone sends these 13 tokens
    monkeypatch.setitem(updown.SPLIT_MIN_M_BY_D, 64, 13)
    assert torch.equal(ffn_from_twell(x, g, wdt, w_up=wu, pre=pre), y4)
    assert launched == [(4, 2)]
    monkeypatch.setitem(updown.SPLIT_MIN_M_BY_D, 64, 14)  # one token short: fused (at its own shape)
    torch.testing.assert_close(ffn_from_twell(x, g, wdt, w_up=wu, pre=pre), y4)
    assert launched == [(4, 2)]
    monkeypatch.delitem(updown.SPLIT_MIN_M_BY_D, 64)
    monkeypatch.setattr(updown, "SPLIT_MIN_M", 13)
    assert torch.equal(ffn_from_twell(x, g, wdt, w_up=wu, pre=pre), y4)
    assert torch.equal(ffn_from_twell(x, g, wdt, w_up=wu, pre=pre, block_e=2, num_warps=1), y2)
    assert launched == [(4, 2), (4, 2), (2, 1)]
    ffn_from_twell(x, g, wdt, pre=pre)  # non-gated: never split
    assert len(launched) == 3
    with pytest.raises(ValueError, match="gated"):
        ffn_from_twell(x, g, wdt, pre=pre, kernel="split")


def test_rows_kernel_empty_blocks_and_many_tokens():
    """Token blocks with no entry at all still write y (zeros); M not a multiple of the block."""
    x, wg, wu, wd = gate_case(37, 40, 100, torch.float32, seed=11, density=0.02, adversarial=False)
    x[:20] = 0  # the first block has no active unit
    pre = x @ wg.T
    g = packed(pre, 128, 8)
    y = ffn_from_twell(x, g, wd.T.contiguous(), w_up=wu, pre=pre, kernel="rows")
    assert torch.all(y[:20] == 0)
    assert rel_err(y, R.gated_mlp(x.double(), wg.double(), wu.double(), wd.double())) < 1e-5
    with pytest.raises(ValueError, match="one-tile"):
        ffn_from_twell(x, packed(pre, 32, 8), wd.T.contiguous(), w_up=wu, pre=pre, kernel="rows")


def test_ops_match_reference():
    x, wg, wu, wd = gate_case(11, 40, 100, torch.float32, seed=9)
    ref = R.gated_mlp(x.double(), wg.double(), wu.double(), wd.double())
    for method in ("cublas", "fused", "persistent"):
        c = OverflowCounters.zeros("cpu")
        y = twell_gated_mlp(x.view(1, 11, 40), wg, wu, wd, tile=32, compression=4, method=method, counters=c)
        assert y.shape == (1, 11, 40) and rel_err(y[0], ref) < 1e-5
        assert int(c.tiles) > 0
    y = twell_mlp(x, wu, wd, tile=32, compression=8)
    assert rel_err(y, R.mlp(x.double(), wu.double(), wd.double())) < 1e-5
    y = twell_gated_mlp(x, wg, wu, wd)  # default geometry: one tile per row, row-block kernel
    assert rel_err(y, ref) < 1e-5
    with pytest.raises(RuntimeError, match="inference only"):
        twell_gated_mlp(x.requires_grad_(), wg, wu, wd)


def test_fused_gate_then_recompute():
    """The fused gate kernel leaves overflowed tiles to be recomputed from w_gate."""
    x, wg, wu, wd = gate_case(13, 40, 100, torch.float16, seed=2)
    g = gate_pack_fused(x, wg, tile=32, compression=4, block_m=16, block_k=16, num_warps=4, num_stages=1)
    y = ffn_from_twell(x, g, wd.T.contiguous(), w_up=wu, w_first=wg)
    assert rel_err(y, R.gated_mlp(x.double(), wg.double(), wu.double(), wd.double())) < 3e-3


def test_validation():
    x, wg, wu, wd = gate_case(5, 24, 37, torch.float32)
    g = packed(x @ wg.T, 16, 4)
    wdt = wd.T.contiguous()
    with pytest.raises(ValueError, match="pre .* or w_first"):
        ffn_from_twell(x, g, wdt, w_up=wu)
    with pytest.raises(ValueError, match="w_down_t must be"):
        ffn_from_twell(x, g, wd, w_up=wu, w_first=wg)
    with pytest.raises(TypeError, match="g must be"):
        ffn_from_twell(x, "g", wdt, w_first=wg)
    with pytest.raises(TypeError, match="dtype"):
        ffn_from_twell(x.half(), g, wdt, w_first=wg)
    with pytest.raises(ValueError, match="rows"):
        ffn_from_twell(x[:3], g, wdt, w_first=wg)
    with pytest.raises(ValueError, match="unit-stride"):
        ffn_from_twell(x, g, wd.T, w_first=wg)
    with pytest.raises(ValueError, match="together"):
        ffn_from_twell(x, g, wdt, w_first=wg, unit_counts=torch.zeros(37, dtype=torch.int32))
    with pytest.raises(ValueError, match="w_down_t .* is required"):
        ffn_from_twell(x, g, None, w_first=wg)
    with pytest.raises(TypeError, match="pre has dtype"):
        ffn_from_twell(x.half(), packed((x @ wg.T).half(), 16, 4), wdt.half(), pre=x @ wg.T)
    # a TwELL whose geometry does not cover f = 37 (2 tiles of 16) is refused, not misread
    short = packed((x @ wg.T)[:, :32], 16, 4)
    short.f = 37
    with pytest.raises(ValueError, match="inconsistent TwELL"):
        ffn_from_twell(x, short, wdt, w_first=wg)
    with pytest.raises(ValueError, match="w must be"):
        gate_to_twell(x, wg.T.contiguous())


@pytest.mark.parametrize("M", [0, 1])
def test_tiny_batches(M):
    x, wg, wu, wd = gate_case(M, 24, 37, torch.float32, seed=4)
    y = twell_gated_mlp(x, wg, wu, wd, tile=16, compression=4)
    assert y.shape == (M, 24)
    if M:
        assert rel_err(y, R.gated_mlp(x.double(), wg.double(), wu.double(), wd.double())) < 1e-5
    assert twell_mlp(x, wu, wd, tile=16, compression=4).shape == (M, 24)


def test_module_kernel_path_sees_new_weights():
    """The kernel path reads the module's weights as they are at each call: loading new
    weights, or editing them through .data, is never served from a stale copy."""
    torch.manual_seed(3)
    m = twell.SparseGatedMLP(40, 100).eval()
    m.kernel_mode = "twell"
    x = torch.randn(6, 40)

    def dense():
        return R.gated_mlp(x.double(), *(p.double() for p in (m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight)))

    with torch.no_grad():
        m(x)
        m.load_state_dict({k: torch.randn_like(v) for k, v in m.state_dict().items()})
        assert rel_err(m(x), dense()) < 1e-5
        m.down_proj.weight.data.copy_(torch.randn(40, 100))
        assert rel_err(m(x), dense()) < 1e-5
        m.down_proj.weight = torch.nn.Parameter(torch.randn(40, 100))  # a new, contiguous weight
        assert rel_err(m(x), dense()) < 1e-5 and m.last_path == "decode"
        assert m.down_proj.weight.t().is_contiguous()  # laid out for the kernels again


def _spy_updown_shapes(monkeypatch) -> list:
    """The (block_e, num_warps) of each ffn_from_twell call the modules make, in a list."""
    seen = []
    real = ffn_from_twell

    def spy(*args, **kw):
        seen.append((kw["block_e"], kw["num_warps"]))
        return real(*args, **kw)

    monkeypatch.setattr(twell.kernels, "ffn_from_twell", spy)
    return seen


def test_updown_shape_follows_the_layers_density(monkeypatch):
    """A width listed in WIDE_STEP takes its second shape from the listed mean, the others keep
    TUNED's at any density (d 2048's second shape lost below the split path's batch sizes, so
    none is listed); the module's prefill calls pass the shape for the layer's estimate (none yet:
    the sparse shape)."""
    from twell.inference import dispatch
    from twell.kernels.updown import TUNED, WIDE_STEP, default_config

    assert 2048 not in WIDE_STEP and 4096 not in WIDE_STEP
    assert default_config(2048) == default_config(2048, 56.0) == default_config(1500, 500.0) == TUNED[2048]
    assert default_config(4096, 500.0) == TUNED[4096]
    monkeypatch.setitem(WIDE_STEP, 2048, (40.0, (4, 4)))
    assert default_config(2048, 39.5) == TUNED[2048] != (4, 4)
    assert default_config(2048, 40.0) == default_config(1500, 56.0) == (4, 4)  # 1500 pads to 2048
    seen = _spy_updown_shapes(monkeypatch)
    monkeypatch.setitem(WIDE_STEP, 64, (10.0, (8, 1)))  # d 40 pads to 64: a second shape there
    # split shapes there too, which these calls (fewer than SPLIT_MIN_M tokens: the fused kernel) must not take
    monkeypatch.setitem(updown.SPLIT_CONFIG, 64, (16, 2))
    monkeypatch.setitem(updown.SPLIT_NARROW, 64, (32, 2))
    m = twell.SparseGatedMLP(40, 100).eval()
    m.kernel_mode = "prefill"
    x = torch.randn(6, 40)
    layer = m._twell_layer
    with torch.no_grad():
        for k in (None, 3.0, 1000.0):
            layer.k_est = k
            m(x)
    assert seen == [TUNED.get(64, default_config(40)), default_config(40, 3.0), (8, 1)]
    assert seen[1] != seen[2] and dispatch.LayerState is type(layer)


def test_split_shape_follows_the_rows_spread(monkeypatch):
    """The split path takes SPLIT_NARROW's one entry a step when the rows' active units have a
    root mean square of at most SPLIT_NARROW_MAX_SPREAD times their mean, else SPLIT_CONFIG (and
    without both figures); the module's prefill calls pass its probe's mean and rms."""
    from twell.kernels.updown import SPLIT_CONFIG, SPLIT_NARROW, SPLIT_NARROW_MAX_SPREAD, TUNED, default_config

    narrow, wide = SPLIT_NARROW[2048], SPLIT_CONFIG[2048]
    assert narrow != wide
    edge = 29.0 * SPLIT_NARROW_MAX_SPREAD
    assert default_config(2048, 29.0, split=True, rms_k=29.3) == default_config(2048, 29.0, split=True, rms_k=edge) == narrow
    assert default_config(2048, 29.0, split=True, rms_k=edge * 1.01) == wide
    # the measured points: narrow won up to spread 1.07 (even and skewed units), lost at 1.50
    assert default_config(2048, 29.0, split=True, rms_k=29.0 * 1.07) == narrow
    assert default_config(2048, 29.0, split=True, rms_k=29.0 * 1.5) == wide
    assert default_config(2048, 29.0, split=True) == default_config(2048, None, split=True, rms_k=29.0) == wide
    assert default_config(2048, 29.0, rms_k=29.0) == TUNED[2048]  # the fused path keeps its rule
    # d 4096: one entry a step only below SPLIT_NARROW_MAX_K (it lost at k 56 there)
    k_max = updown.SPLIT_NARROW_MAX_K[4096]
    assert default_config(4096, 29.0, split=True, rms_k=29.0) == SPLIT_NARROW[4096] != SPLIT_CONFIG[4096]
    assert default_config(4096, k_max - 0.5, split=True, rms_k=k_max - 0.5) == SPLIT_NARROW[4096]
    assert default_config(4096, k_max, split=True, rms_k=k_max) == SPLIT_CONFIG[4096]
    assert default_config(4096, 56.0, split=True, rms_k=56.0) == SPLIT_CONFIG[4096]
    assert default_config(4096, 29.0, split=True, rms_k=29.0 * 1.5) == SPLIT_CONFIG[4096]
    assert default_config(2048, 56.0, split=True, rms_k=56.0) == narrow  # no such bound at d 2048
    seen = _spy_updown_shapes(monkeypatch)
    # by width: the module must pass its d (64, padded) for this to send 6 tokens down the split path
    monkeypatch.setitem(updown.SPLIT_MIN_M_BY_D, 64, 1)
    monkeypatch.setitem(SPLIT_NARROW, 64, (1, 1))  # d 40 pads to 64
    monkeypatch.setitem(SPLIT_CONFIG, 64, (4, 2))
    m = twell.SparseGatedMLP(40, 100).eval()
    m.kernel_mode = "prefill"
    x = torch.randn(6, 40)
    layer = m._twell_layer
    y = {}
    with torch.no_grad():
        for rms in (3.1, 6.0, None):
            layer.k_est, layer.k_rms = 3.0, rms
            y[rms] = m(x)
    assert seen == [(1, 1), (4, 2), (4, 2)]
    ref = torch.relu(x @ m.gate_proj.weight.T) * (x @ m.up_proj.weight.T) @ m.down_proj.weight.T
    for out in y.values():
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_module_under_autocast_takes_the_dense_path():
    m = twell.SparseGatedMLP(40, 100).eval()
    m.kernel_mode = "twell"
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(torch.randn(5, 40))
    assert y.dtype == torch.bfloat16 and m.last_path is None


@pytest.mark.parametrize("cls", [twell.SparseGatedMLP, twell.SparseMLP])
@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_module_kernel_path_matches_dense(cls, mode):
    torch.manual_seed(0)
    m = cls(40, 100).eval()
    m.track_stats = True
    x = torch.randn(2, 7, 40)
    with torch.no_grad():
        y_dense = m(x)
        s_dense = m.stats
        assert m.last_path is None  # CPU auto: dense path untouched
        m.kernel_mode = mode
        y_k = m(x)
        s_k = m.stats
        assert m.last_path == mode
    assert rel_err(y_k, y_dense) < 1e-5
    assert torch.equal(s_k.unit_counts, s_dense.unit_counts)
    assert float(s_k.active_mean) == pytest.approx(float(s_dense.active_mean))
    assert int(s_k.active_max) == int(s_dense.active_max)
    assert int(m.tokens_seen) == 28 and torch.equal(m.fire_counts, 2 * s_dense.unit_counts)
    # a gradient is needed: the dense path runs, kernel mode or not
    m.train()
    y = m(x)
    assert y.requires_grad


@pytest.mark.parametrize("cls", [twell.SparseGatedMLP, twell.SparseMLP])
@pytest.mark.parametrize("track", [True, False])
def test_module_lean_dense_inference_path(cls, track):
    """The dense path taken on CUDA in inference (in-place product) returns what the
    training dense path returns, with the same statistics."""
    torch.manual_seed(1)
    m = cls(40, 100).eval()
    m.track_stats = track
    x = torch.randn(15, 40)
    gated = cls is twell.SparseGatedMLP
    w_first = m.gate_proj.weight if gated else m.up_proj.weight
    with torch.no_grad():
        y_ref = m(x)
        s_ref = m.stats
        y = m._twell_layer._dense(m, x, w_first, m.down_proj.weight, m.up_proj.weight if gated else None, track, False)
    assert torch.equal(y, y_ref) and m.l1 is None
    if track:
        assert torch.equal(m.stats.unit_counts, s_ref.unit_counts) and int(m.tokens_seen) == 30


# --- GPU, bf16, real shapes --------------------------------------------------------------------


def _gpu_case(dist, k=29, M=4099, d=2048, f=5632):
    from twell.bench.synthetic import make_ffn

    s = make_ffn(M, d, f, k, dist, dtype=torch.bfloat16, device="cuda", seed=3)
    s.x[5] = 0  # an all-zero row
    s.x[7, 0] = -50.0  # a fully dense row
    return s


@pytest.mark.gpu
@pytest.mark.parametrize("dist", ["even", "skewed", "heavy"])
def test_gated_gpu_bf16(dist):
    from twell.bench.inference import errors, reference_fp32

    s = _gpu_case(dist)
    ref = reference_fp32(s.x, s.w_gate, s.w_up, s.w_down)
    dense = torch.relu(s.x @ s.w_gate.T) * (s.x @ s.w_up.T) @ s.w_down.T
    _, dense_row = errors(dense, ref)
    for method in ("cublas", "fused", "persistent"):
        c = OverflowCounters.zeros("cuda")
        kw = dict(tile=128) if method != "cublas" else {}
        y = twell_gated_mlp(s.x, s.w_gate, s.w_up, s.w_down, method=method, counters=c, **kw)
        rel, row = errors(y, ref)
        assert rel < 1e-2 and row <= 2 * dense_row, (method, rel, row, dense_row)
        assert int(c.rows) >= 1


@pytest.mark.gpu
@pytest.mark.parametrize("dist", ["even", "heavy"])
@pytest.mark.parametrize("shape", ["wide", "narrow"])
def test_split_gpu_bf16_matches_the_fused_kernel(dist, shape):
    """At the real shape the split path gives the fused kernels' y bit for bit (two passes: M is
    above TWO_PASS_MIN_M), with their statistics, overflowed tiles included, at both split
    shapes (SPLIT_CONFIG and SPLIT_NARROW)."""
    from twell.inference.ops import DEFAULT_COMPRESSION, default_tile

    s = _gpu_case(dist)
    M, f = s.x.shape[0], s.w_gate.shape[0]
    assert M >= updown.TWO_PASS_MIN_M
    pre = s.x @ s.w_gate.T
    g = twell.kernels.pack_relu(pre, default_tile(f), DEFAULT_COMPRESSION)
    w = prepare_gated_weights(s.w_up, s.w_down)
    outs = {}
    for kernel in ("split", "token"):
        uc = torch.zeros(f, dtype=torch.int32, device="cuda")
        nnz = torch.full((M,), -1, dtype=torch.int32, device="cuda")
        c = OverflowCounters.zeros("cuda")
        out = torch.full_like(s.x, float("nan"))
        be, nw = (updown.SPLIT_CONFIG if shape == "wide" else updown.SPLIT_NARROW)[2048]
        y = ffn_from_twell(s.x, g, w.down_t, w_up=w.up, pre=pre, counters=c, unit_counts=uc, row_nnz=nnz,
                           kernel=kernel, block_e=be, num_warps=nw, out=out)
        outs[kernel] = (y, uc, nnz, c.buffer.clone())
    for a, b in zip(outs["split"], outs["token"]):
        assert torch.equal(a, b)
    assert torch.equal(outs["split"][1].long(), (pre > 0).sum(0))
    assert int(outs["split"][3][0]) > 0  # the dense row (and heavy rows) overflowed


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["split", "token"])
def test_overflowed_rows_dense_gpu_bf16(kernel):
    """At the real shape with heavy rows and a fully dense row, the listed rows (overflowed, or
    above DENSE_ROW_MIN) computed whole (pre_writable): errors within dense bf16's, statistics
    and counters as the exact launch's, y of the other rows as the first launch leaves them."""
    from twell.bench.inference import errors, reference_fp32
    from twell.inference.ops import DEFAULT_COMPRESSION, default_tile

    s = _gpu_case("heavy")
    M, f = s.x.shape[0], s.w_gate.shape[0]
    ref = reference_fp32(s.x, s.w_gate, s.w_up, s.w_down)
    _, dense_row = errors(torch.relu(s.x @ s.w_gate.T) * (s.x @ s.w_up.T) @ s.w_down.T, ref)
    pre = s.x @ s.w_gate.T
    g = twell.kernels.pack_relu(pre, default_tile(f), DEFAULT_COMPRESSION)
    overflowed = (g.counts > g.slots).any(dim=1)
    listed = overflowed | ((pre > 0).sum(dim=1) > updown.DENSE_ROW_MIN)
    assert int(overflowed.sum()) >= 2 and int((listed & ~overflowed).sum()) >= 2
    w = prepare_gated_weights(s.w_up, s.w_down)
    runs = {}
    for writable in (True, False):
        uc = torch.zeros(f, dtype=torch.int32, device="cuda")
        nnz = torch.full((M,), -1, dtype=torch.int32, device="cuda")
        c = OverflowCounters.zeros("cuda")
        y = ffn_from_twell(s.x, g, w.down_t, w_up=w.up, pre=pre.clone(), counters=c, unit_counts=uc, row_nnz=nnz,
                           kernel=kernel, out=torch.full_like(s.x, float("nan")), pre_writable=writable)
        rel, row = errors(y, ref)
        assert rel < 1e-2 and row <= 2 * dense_row, (writable, rel, row, dense_row)
        assert torch.equal(uc.long(), (pre > 0).sum(0)) and torch.equal(nnz.long(), (pre > 0).sum(1))
        assert int(c.rows) == int(overflowed.sum()) and int(c.tiles) == int((g.counts > g.slots).sum())
        runs[writable] = y
    assert torch.equal(runs[True][~listed], runs[False][~listed])


@pytest.mark.gpu
def test_mlp_gpu_bf16():
    from twell.bench.inference import errors

    s = _gpu_case("even")
    x, wu, wd = s.x, s.w_gate, s.w_down  # the gate weights make a sparse non-gated up projection
    ref = torch.relu(x.float() @ wu.float().T) @ wd.float().T
    y = twell_mlp(x, wu, wd)
    rel, _ = errors(y, ref)
    assert rel < 1e-2


@pytest.mark.gpu
def test_module_gpu_switches_to_kernels_without_sync():
    from twell.bench.inference import errors, reference_fp32

    M = 8195  # eager calls take the kernels from dispatch.EAGER_PREFILL_MIN_M tokens
    s = _gpu_case("even", M=M)
    s.x[7, 0] = 1.0  # no fully dense row here: the dispatcher would rightly keep cuBLAS
    m = twell.SparseGatedMLP(2048, 5632, device="cuda", dtype=torch.bfloat16).eval()
    m.track_stats = True
    with torch.no_grad():
        m.gate_proj.weight.copy_(s.w_gate)
        m.up_proj.weight.copy_(s.w_up)
        m.down_proj.weight.copy_(s.w_down)
        y0 = m(s.x)  # dense: no estimate yet
        stats0 = m.stats
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            torch.cuda.set_sync_debug_mode("error")
            try:
                y1 = m(s.x)  # kernels now, with no host sync, on the caller's stream
            finally:
                torch.cuda.set_sync_debug_mode(0)
        side.synchronize()
    assert m.last_path == "prefill"
    ref = reference_fp32(s.x, s.w_gate, s.w_up, s.w_down)
    assert errors(y1, ref)[0] < 1e-2 and errors(y0, ref)[0] < 1e-2
    assert torch.equal(m.stats.unit_counts, stats0.unit_counts)
    assert int(m.tokens_seen) == 2 * M
    # a dense layer goes back to cuBLAS
    with torch.no_grad():
        m.gate_proj.weight[:, 0] = 5.0
        for _ in range(2 * m._twell_layer.PROBE_EVERY + 2):  # estimates are taken every PROBE_EVERY calls
            m(s.x)
            torch.cuda.synchronize()
    assert m.last_path == "dense"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_module_on_a_gpu_that_is_not_current():
    """A layer on cuda:1 called while cuda:0 is current (as device_map="auto" spreads layers)
    launches its kernels on cuda:1's stream, ordered after its own cuBLAS gate."""
    from twell.bench.synthetic import make_ffn

    s = make_ffn(4099, 2048, 5632, 29, "even", dtype=torch.bfloat16, device="cuda:1", seed=5)
    m = twell.SparseGatedMLP(2048, 5632, device="cuda:1", dtype=torch.bfloat16).eval()
    with torch.no_grad():
        m.gate_proj.weight.copy_(s.w_gate)
        m.up_proj.weight.copy_(s.w_up)
        m.down_proj.weight.copy_(s.w_down)
        m.kernel_mode = "twell"
        torch.cuda.set_device(0)
        y = m(s.x)
        m.kernel_mode = "dense"
        y_dense = m(s.x)
    assert rel_err(y, y_dense) < 1e-2


def test_recomputed_tiles_round_the_gate_as_the_dense_path():
    """Overflowed tiles recomputed from x and w_first give, bit for bit, what reading the stored
    fp16 pre-activation gives: gates of 2049, 2051, ... are exact in fp32 and not in fp16 (a
    mutant that skipped the rounding survived every other test)."""
    M, d, f = 4, 16, 48
    gen = torch.Generator().manual_seed(1)
    x = torch.zeros(M, d, dtype=torch.float16)
    x[:, :2] = 1.0
    x[:, 2:] = torch.randint(-1, 2, (M, d - 2), generator=gen).half()
    wg = torch.zeros(f, d, dtype=torch.float16)
    wg[:, 0] = 2048.0
    wg[:, 1] = (torch.arange(f) % 7 * 2 + 1).half()
    wu = (torch.randn(f, d, generator=gen) / 4).half()
    wdt = (torch.randn(f, d, generator=gen) / 4).half()
    pre = (x.float() @ wg.float().T).half()
    g = twell.pack_twell(torch.relu(pre), 16, 4)
    g.overflow_index = g.overflow_values = None  # every tile overflows: the exact path does all
    assert bool(g.overflowed().all())
    y_pre = ffn_from_twell(x, g, wdt, w_up=wu, pre=pre)
    y_rec = ffn_from_twell(x, g, wdt, w_up=wu, w_first=wg)
    assert torch.equal(y_pre, y_rec), (y_pre.float() - y_rec.float()).abs().max()


def test_out_overlapping_x_is_refused_and_disjoint_halves_are_not():
    """out = x: the exact path and the split kernel's second launch read x's rows after other
    programs wrote out's, so the result depended on the order (it came out wrong); refused. The
    two halves of one [M, 2d] buffer share no element and still work."""
    M, d, f = 9, 24, 37
    x, wg, wu, wd = gate_case(M, d, f, seed=3)
    pre = x @ wg.T
    g = packed(pre, 16, 4)
    ref = R.gated_mlp(x, wg, wu, wd)
    w_down_t = wd.T.contiguous()
    for kernel in ("token", "split"):
        xx = x.clone()
        with pytest.raises(ValueError, match="out must not overlap x"):
            ffn_from_twell(xx, g, w_down_t, w_up=wu, pre=pre, out=xx, kernel=kernel)
        with pytest.raises(ValueError, match="out must not overlap x"):
            ffn_from_twell(xx, g, w_down_t, w_up=wu, pre=pre, out=xx[:, :].view(M, d), kernel=kernel)
        buf = torch.zeros(M, 2 * d)
        buf[:, :d] = x
        y = ffn_from_twell(buf[:, :d], g, w_down_t, w_up=wu, pre=pre, out=buf[:, d:], kernel=kernel)
        assert y.data_ptr() == buf[:, d:].data_ptr() and rel_err(y, ref) < TOL[torch.float32]
        assert torch.equal(buf[:, :d], x)


@pytest.mark.parametrize("knob, value", [("block_e", 2.0), ("block_e", True), ("block_e", 3), ("num_warps", 3),
                                          ("num_warps", 2.0), ("num_warps", 0)])
def test_launch_knobs_of_the_wrong_type_are_refused(knob, value):
    """A float (2.0 & 1.0 raised "unsupported operand"), a bool (True reached the kernel and
    crashed there) or a non power of two: a clear error naming the knob."""
    x, wg, wu, wd = gate_case(5, 24, 37, seed=1)
    pre = x @ wg.T
    with pytest.raises(ValueError, match=f"{knob} must be a power of two"):
        ffn_from_twell(x, packed(pre, 16, 4), wd.T.contiguous(), w_up=wu, pre=pre, **{knob: value})


def test_prepare_gated_weights_checks_its_arguments():
    """It copied w_down into w_up's dtype without a word (fp16 into fp32), read 1-D or non-tensor
    arguments with Python errors, and twell_gated_mlp took any object as weights."""
    _, _, wu, wd = gate_case(5, 24, 37, seed=2)
    with pytest.raises(TypeError, match="must match w_up"):
        prepare_gated_weights(wu, wd.half())
    with pytest.raises(ValueError, match="w_up must be 2-D"):
        prepare_gated_weights(wu[0], wd)
    with pytest.raises(TypeError, match="w_up must be a torch.Tensor"):
        prepare_gated_weights(wu.tolist(), wd)
    with pytest.raises(TypeError, match="w_up must have dtype"):
        prepare_gated_weights(wu.long(), wd.long())
    with pytest.raises(TypeError, match="weights must be a GatedWeights"):
        twell_gated_mlp(torch.randn(3, 24), torch.randn(37, 24), wu, wd, weights=(wu, wd))


def test_layers_with_no_units_give_zeros():
    """f = 0: y = 0 from the ops and ffn_from_twell (a one-tile empty TwELL was refused as
    inconsistent before any kernel)."""
    x = torch.randn(300, 16)
    w, w_down = torch.randn(0, 16), torch.randn(16, 0)
    assert torch.equal(twell_gated_mlp(x, w, w, w_down), torch.zeros(300, 16))
    assert torch.equal(twell_mlp(x, w, w_down), torch.zeros(300, 16))
    g = gate_pack_fused(x, w)
    out = torch.full((300, 16), float("nan"))
    assert torch.equal(ffn_from_twell(x, g, w.clone(), w_up=w, w_first=w, out=out), torch.zeros(300, 16))


def test_rows_kernel_full_rows_and_several_d_steps(monkeypatch):
    """The row-block kernel with d over several of its BK steps (BK lowered to 16: d 40 takes
    three, the last partial) and rows whose count is exactly the tile's slots (full, not
    overflowed: their entries are the kernel's to do) beside an overflowed one: every row of a
    NaN-filled y right. The other rows-kernel tests have d <= BK (one step) and no full row.
    Kills the mutants that treat a full row as overflowed (``cnt >= SLOTS``: its entries then
    done by nobody), that take the up product before its last d step (``kk == 0``) and that
    carry Y from one d step into the next (its reset at ``ch == 0`` dropped), and those that
    drop or misplace the per-unit counts' atomic add (no other test passes ``unit_counts`` to
    the rows kernel)."""
    from twell.format import twell_slots

    default = updown.ROWS_CONFIG
    monkeypatch.setattr(updown, "ROWS_CONFIG", (16, 64, 16, 4))
    M, d, f, tile, C = 20, 40, 100, 128, 4  # one tile; two token blocks, one partial
    slots = twell_slots(tile, C)
    x, wg, wu, wd = gate_case(M, d, f, torch.float32, seed=5, density=0.1, adversarial=False)
    pre = x @ wg.T
    order = torch.randn(M, f, generator=torch.Generator().manual_seed(6)).argsort(dim=1)
    for r, k in ((3, slots), (17, slots), (9, slots + 1)):  # full, full (second block), overflowed
        pre[r] = -pre[r].abs() - 0.1
        pre[r, order[r, :k]] = pre[r, order[r, :k]].abs() + 0.1
    g = packed(pre, tile, C)
    assert int(g.counts[3, 0]) == slots and int(g.counts[17, 0]) == slots and bool(g.overflowed()[9, 0])
    ref = (torch.relu(pre.double()) * (x.double() @ wu.double().T)) @ wd.double().T
    out = torch.full((M, d), float("nan"))
    y = ffn_from_twell(x, g, wd.T.contiguous(), w_up=wu, pre=pre, kernel="rows", out=out)
    assert rel_err(y, ref) < 1e-5
    assert rel_err(y[[3, 17]], ref[[3, 17]]) < 1e-5
    # non-gated: h = relu(pre) itself
    y_u = ffn_from_twell(x, g, wd.T.contiguous(), pre=pre, kernel="rows")
    assert rel_err(y_u, torch.relu(pre.double()) @ wd.double().T) < 1e-5
    # per-unit counts, each entry once: over three d steps, and at the default BK (one step)
    for config in ((16, 64, 16, 4), default):
        monkeypatch.setattr(updown, "ROWS_CONFIG", config)
        uc, nnz = torch.zeros(f, dtype=torch.int32), torch.full((M,), -1, dtype=torch.int32)
        y_c = ffn_from_twell(x, g, wd.T.contiguous(), w_up=wu, pre=pre, kernel="rows", unit_counts=uc, row_nnz=nnz)
        assert torch.equal(uc.long(), (pre > 0).sum(0)) and torch.equal(nnz.long(), (pre > 0).sum(1))
        assert rel_err(y_c, ref) < 1e-5


@pytest.mark.parametrize("kernel", ["token", "token-two-pass", "split"])
def test_non_finite_gates_in_overflowed_tiles(kernel, monkeypatch):
    """Overflowed tiles read from ``pre`` holding what an fp16 gate can hold: a NaN is active
    (torch.relu keeps it, so the dense MLP's row is NaN) and -inf is not (relu gives 0, so the row
    stays finite: 0 * u, never -inf * 0). A kernel that tested ``a > 0`` dropped the NaN and returned a
    finite row; one that multiplied by ``a`` instead of ``relu(a)`` (gated or non-gated) turned
    the -inf into NaN. All three survived every other test (mutation round on updown.py). Rows
    of NaN-filled y not overflowed, the partial last tile (f 37, tile 16) and an empty row are
    checked too."""
    if kernel == "token-two-pass":
        monkeypatch.setattr(updown, "TWO_PASS_MIN_M", 0)
        kernel = "token"
    M, d, f, tile, C = 6, 24, 37, 16, 4  # 3 slots a tile; tiles 0, 1 and a partial tile 2 (5 units)
    x, wg, wu, wd = gate_case(M, d, f, torch.float32, seed=12, adversarial=False)
    pre = x @ wg.T
    pre[1] = -1.0  # empty row
    for r, lo, hi in ((0, 0, 16), (2, 16, 32), (3, 32, 37), (4, 0, 16)):
        pre[r, lo:hi] = pre[r, lo:hi].abs() + 0.1  # the whole tile active: it overflows
        pre[r, lo + 2] = float("-inf")
    pre[4, 5] = float("nan")  # row 4: a NaN in an overflowed tile
    g = packed(pre, tile, C)
    assert bool(g.overflowed()[0, 0]) and bool(g.overflowed()[3, 2]) and bool(g.overflowed()[4, 0])
    ref = (torch.relu(pre.double()) * (x.double() @ wu.double().T)) @ wd.double().T
    finite = torch.arange(M) != 4
    out = torch.full((M, d), float("nan"))
    y = ffn_from_twell(x, g, wd.T.contiguous(), w_up=wu, pre=pre, kernel=kernel, out=out)
    assert torch.isnan(y[4]).all()
    assert rel_err(y[finite], ref[finite]) < 1e-5 and torch.all(y[1] == 0)
    if kernel != "split":  # non-gated (never split): h = relu(pre) itself
        y_u = ffn_from_twell(x, g, wd.T.contiguous(), pre=pre, kernel=kernel)
        ref_u = torch.relu(pre.double()) @ wd.double().T
        assert torch.isnan(y_u[4]).all() and rel_err(y_u[finite], ref_u[finite]) < 1e-5


def test_recomputed_gates_sum_exact_products():
    """Overflowed tiles recomputed from fp16 x and w_first take each product x_k w_jk exactly
    (in fp32) and round the sum once, as the dense pre-activation is rounded: bit for bit what
    reading that pre-activation gives. The inputs are multiples of 1/64 in [-1, 1] (d 64): every
    product and partial sum is exact in fp32, while the products themselves need up to 14
    significant bits, more than fp16's 11, so a kernel multiplying in fp16 (rounding each product)
    gets other gates. That mutant passed every tolerance-based test (mutation round on updown.py)."""
    M, d, f, tile, C = 5, 64, 40, 16, 4
    gen = torch.Generator().manual_seed(4)
    x, wg = ((torch.randint(-64, 65, s, generator=gen) / 64).half() for s in ((M, d), (f, d)))
    wu = (torch.randn(f, d, generator=gen) / 8).half()
    wdt = (torch.randn(f, d, generator=gen) / 8).half()
    pre = (x.double() @ wg.double().T).half()  # exact sums, then the one rounding
    g = packed(pre, tile, C)
    assert int(g.overflowed().sum()) >= 12  # about half the units fire: nearly every tile is recomputed
    y_pre = ffn_from_twell(x, g, wdt, w_up=wu, pre=pre)
    y_rec = ffn_from_twell(x, g, wdt, w_up=wu, w_first=wg)
    assert torch.equal(y_pre, y_rec), (y_pre.float() - y_rec.float()).abs().max()


def test_out_overlap_check_at_its_edges():
    """The overlap check between out and x, at the cases its arithmetic decides by one element:
    out right after x in one flat buffer shares nothing and is taken (and right); out starting on
    x's last element, out rows that wrap into the next row of x's buffer (a column window past
    the row stride), and out rows that overlap each other are refused. Moving the check by one
    element at each of these cases passed the other tests (mutation round on updown.py)."""
    M, d, f = 5, 24, 37
    x, wg, wu, wd = gate_case(M, d, f, seed=6)
    pre = x @ wg.T
    g = packed(pre, 16, 4)
    w_down_t = wd.T.contiguous()
    ref = ffn_from_twell(x, g, w_down_t, w_up=wu, pre=pre)
    flat = torch.full((2 * M * d,), float("nan"))
    flat[: M * d] = x.reshape(-1)
    y = ffn_from_twell(flat[: M * d].view(M, d), g, w_down_t, w_up=wu, pre=pre, out=flat[M * d :].view(M, d))
    assert torch.equal(y, ref) and torch.equal(flat[: M * d].view(M, d), x)
    overlapping = []
    flat = torch.zeros(2 * M * d)
    flat[: M * d] = x.reshape(-1)
    overlapping.append((flat[: M * d].view(M, d), flat[M * d - 1 : 2 * M * d - 1].view(M, d)))  # one element
    s = d + 4  # x's rows start 2 before the end of a row of stride s and run 22 into the next
    buf = torch.zeros((M + 1) * s)
    xs = buf.as_strided((M, d), (s, 1), s - 2)
    xs.copy_(x)
    overlapping.append((xs, buf.as_strided((M, d), (s, 1), 0)))
    for xx, out in overlapping:
        with pytest.raises(ValueError, match="out must not overlap x"):
            ffn_from_twell(xx, g, w_down_t, w_up=wu, pre=pre, out=out)
    for out in (torch.zeros(d).expand(M, d), torch.zeros(M * d).as_strided((M, d), (d - 1, 1))):
        with pytest.raises(ValueError, match="non-overlapping rows"):
            ffn_from_twell(x, g, w_down_t, w_up=wu, pre=pre, out=out)


def test_w_up_past_int32_offsets_takes_the_exact_launch(monkeypatch):
    """The dense-rows path is refused when w_up alone reaches past what the heavy-rows kernels'
    int32 offsets address (here a strided w_up and the limit lowered between the two weights'
    spans): pre is left as it was and y is the exact launch's. Checking only w_down_t passed the
    other tests, whose two weights always had the same span."""
    from twell.kernels import heavy_rows

    monkeypatch.setattr(updown, "TWO_PASS_MIN_M", 0)
    M, d, f = 13, 40, 100
    x, wg, wu, wd = gate_case(M, d, f, torch.float32, seed=5)
    w_down_t = wd.T.contiguous()  # reaches element f d - 1 = 3999
    wu_s = torch.zeros(2 * f, d)[::2]
    wu_s.copy_(wu)  # reaches element 2 d (f - 1) + d - 1 = 7959
    monkeypatch.setattr(heavy_rows, "_MAX_SPAN", 4000)
    pre = x @ wg.T
    g = packed(pre, 16, 2)
    assert bool(g.overflowed().any())
    p = pre.clone()
    y = ffn_from_twell(x, g, w_down_t, w_up=wu_s, pre=p, pre_writable=True)
    assert torch.equal(p, pre) and torch.equal(y, ffn_from_twell(x, g, w_down_t, w_up=wu, pre=pre))


@pytest.mark.parametrize("kernel", ["token", "token-two-pass", "split", "rows", "dense-rows"])
def test_y_written_only_in_its_rows_and_columns(kernel, monkeypatch):
    """out as a view into a NaN buffer with guard columns beside it and guard rows after it: every
    element of the view written and right, nothing outside it touched. d 40 pads to 64 and M 13
    is no multiple of the row-block kernel's 16 tokens: a store without its d or row mask lands
    in the guards here (elsewhere it wrote past the output's allocation, which the other tests
    caught only when the heap corruption happened to crash the process)."""
    from kernel_cases import GUARD

    writable = kernel == "dense-rows"
    if kernel in ("token-two-pass", "dense-rows"):
        monkeypatch.setattr(updown, "TWO_PASS_MIN_M", 0)
        kernel = "token"
    M, d, f = 13, 40, 100
    x, wg, wu, wd = gate_case(M, d, f, torch.float32, seed=8)
    pre = x @ wg.T
    g = packed(pre, 128 if kernel == "rows" else 32, 4)
    assert bool(g.overflowed().any())
    ref = R.gated_mlp(x.double(), wg.double(), wu.double(), wd.double())
    buf = torch.full((M + GUARD, d + 5), float("nan"))
    out = buf[:M, 2 : 2 + d]
    y = ffn_from_twell(x, g, wd.T.contiguous(), w_up=wu, pre=pre.clone(), out=out, kernel=kernel, pre_writable=writable)
    assert y.data_ptr() == out.data_ptr() and rel_err(y, ref) < 1e-5
    outside = torch.ones_like(buf, dtype=torch.bool)
    outside[:M, 2 : 2 + d] = False
    assert torch.isnan(buf[outside]).all()


@pytest.mark.parametrize("dtype,M,d,f,tile,C", CASES[:2] + CASES[-1:], ids=case_id)
@pytest.mark.parametrize("gated", [True, False])
def test_one_launch_takes_every_row(dtype, M, d, f, tile, C, gated, monkeypatch):
    """``one_launch``: from TWO_PASS_MIN_M tokens too, every row in the fused kernel's one launch,
    overflowed tiles and long rows included (the exact path inside the token's program): every
    row of a NaN-filled output right, the statistics and counters as the two-pass path gives
    them, ``pre`` only read although writable, no row listed or computed whole. Refused with the
    split or row-block kernels and with hot units."""
    monkeypatch.setattr(updown, "TWO_PASS_MIN_M", 0)
    monkeypatch.setattr(updown, "DENSE_ROW_MIN", 4)  # long rows too, not only overflowed ones
    x, wg, wu, wd = gate_case(M, d, f, dtype, seed=M + d + f + 7)
    pre = x @ wg.T
    g = packed(pre, tile, C)
    assert bool(g.overflowed().any()) and bool(((pre > 0).sum(1) > 4).any())
    if gated:
        ref = R.gated_mlp(x.double(), wg.double(), wu.double(), wd.double())
        w = prepare_gated_weights(wu, wd)
        args, kw = (x, g, w.down_t), dict(w_up=w.up)
    else:
        ref = R.mlp(x.double(), wg.double(), wd.double())
        args, kw = (x, g, wd.T.contiguous()), {}
    runs = {}
    for one in (True, False):
        if one:
            monkeypatch.setattr(updown, "launch_heavy_rows", lambda *a, **k: pytest.fail("a row was computed whole"))
        else:
            monkeypatch.undo()
            monkeypatch.setattr(updown, "TWO_PASS_MIN_M", 0)
            monkeypatch.setattr(updown, "DENSE_ROW_MIN", 4)
        p = pre.clone()
        c = OverflowCounters.zeros("cpu")
        uc, nnz = torch.zeros(f, dtype=torch.int32), torch.full((M,), -1, dtype=torch.int32)
        out = torch.full((M, d), float("nan"), dtype=dtype)
        y = ffn_from_twell(*args, pre=p, counters=c, unit_counts=uc, row_nnz=nnz, out=out, pre_writable=True,
                           kernel="token", one_launch=one, **kw)
        assert y.data_ptr() == out.data_ptr() and rel_err(y, ref) < TOL[dtype]
        assert int(c.tiles) == int(g.overflowed().sum()) and int(c.rows) == int(g.overflowed().any(1).sum())
        assert torch.equal(uc.long(), (pre > 0).sum(0)) and torch.equal(nnz.long(), (pre > 0).sum(1))
        runs[one] = p
    assert torch.equal(runs[True], pre) and not torch.equal(runs[False], pre)
    if gated:
        for bad in (dict(kernel="split"), dict(kernel="rows")):
            with pytest.raises(ValueError, match="one_launch"):
                ffn_from_twell(*args, pre=pre.clone(), one_launch=True, **bad, **kw)


def test_module_prefill_takes_one_launch_while_its_rows_are_short(monkeypatch):
    """The layer's prefill calls run the up/down in one launch while the last probe saw no row
    above DENSE_ROW_MIN and no overflowed tile (LayerState.rows_short), the two-pass path
    otherwise, and never with PREFILL_ONE_LAUNCH off; the output is the dense module's either
    way."""
    from twell.inference import dispatch
    from twell.inference.dispatch import row_stats

    class Done:
        def query(self):
            return True

    seen = []
    real = ffn_from_twell

    def spy(*args, **kw):
        seen.append(kw["one_launch"])
        return real(*args, **kw)

    monkeypatch.setattr(twell.kernels, "ffn_from_twell", spy)
    m = twell.SparseGatedMLP(40, 100).eval()
    m.kernel_mode = "prefill"
    x = torch.randn(6, 40)
    m.kernel_mode = "dense"
    with torch.no_grad():
        y_dense = m(x)
    m.kernel_mode = "prefill"
    layer = m._twell_layer
    assert layer.rows_short is False
    cases = [([3.0, 5.0, 4.0], 0.0, True), ([3.0, 500.0, 4.0], 0.0, False), ([3.0, 5.0, 4.0], 0.25, False),
             ([3.0, 5.0, 4.0], 0.0, True)]
    for per_row, over, short in cases:
        layer._host = row_stats(torch.tensor(per_row), torch.tensor(over))
        layer._event, layer._no_overflow = Done(), False
        layer._poll()
        assert layer.rows_short is short
        with torch.no_grad():
            y = m(x)
        assert seen[-1] is short and rel_err(y, y_dense) < 1e-5
    # a probe of a call with hot units (its counts are the cold units'): not known short
    layer._host = torch.cat([row_stats(torch.tensor([3.0, 5.0, 4.0]), torch.tensor(0.0)), torch.tensor([64.0, 0.0])])
    layer._event, layer._no_overflow = Done(), False
    layer._poll()
    assert layer.rows_short is False
    layer.rows_short = True
    monkeypatch.setattr(dispatch, "PREFILL_ONE_LAUNCH", False)
    with torch.no_grad():
        m(x)
    assert seen[-1] is False

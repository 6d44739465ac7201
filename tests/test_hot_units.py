"""Hot units (twell.kernels.hot_units): the pack that leaves them out of TwELL and writes their
gate values apart, the up/down with their dense block, and the module's choice of a hot set,
against the PyTorch references (Triton interpreter on the CPU; GPU tests in bf16 at real shapes)."""

from __future__ import annotations

import pytest
import torch

import twell
from kernel_cases import gate_case, rel_err
from test_kernels_pack import assert_same_twell_nan
from twell import reference as R
from twell.format import pack_twell
from twell.kernels import OverflowCounters, ffn_from_twell, pack_relu, updown
from twell.kernels.gate_pack import pack_relu_hot
from twell.kernels.hot_units import HotUnits, hot_units, hot_words_of
from twell.inference.ops import prepare_gated_weights

TOL = {torch.float32: 1e-5, torch.float16: 3e-3}


def _skewed_pre(M, d, f, dtype, seed, hot_cols):
    """gate_case's inputs (an all-zero row, a dense row, heavy rows) with ``hot_cols`` made to
    fire for about half of the tokens."""
    x, wg, wu, wd = gate_case(M, d, f, dtype, seed=seed)
    wg = wg.clone()
    wg[hot_cols, 0] = 0.0  # threshold 0: a hot unit fires for about half of the tokens
    return x, wg, wu, wd


def test_hot_set_forms():
    """units sorted, words the bit mask (bit 31 included, f not a multiple of 32), starts the
    hot units below each word's first column; no host synchronisation needed to build it
    (device ops only)."""
    f = 70
    hs = hot_units(torch.tensor([64, 3, 31, 32, 69]), f)
    assert hs.units.tolist() == [3, 31, 32, 64, 69] and hs.n == 5 and hs.f == f
    words = [(1 << 3) | (1 << 31), 1, (1 << 0) | (1 << 5)]
    assert hs.words.tolist() == [w - 2**32 if w >= 2**31 else w for w in words]
    assert torch.equal(hot_words_of(hs.units, f), hs.words)
    assert hs.starts.tolist() == [0, 2, 3, 5]
    hs.check(f, "cpu")
    with pytest.raises(ValueError, match="f = 70"):
        hs.check(71, "cpu")
    with pytest.raises(ValueError, match="int32"):
        HotUnits(hs.units, hs.words, hs.starts.long(), f).check(f, "cpu")
    with pytest.raises(ValueError, match="starts"):
        HotUnits(hs.units, hs.words, hs.starts[:-1], f).check(f, "cpu")
    empty = hot_units(torch.zeros(0, dtype=torch.int64), f)
    assert empty.n == 0 and int(empty.words.abs().sum()) == 0 and empty.starts.tolist() == [0] * 4
    with pytest.raises(IndexError):  # a unit past f (within the padded last word) is refused
        hot_units(torch.tensor([3, 70]), f)


# (M, f, tile, compression): several tiles with a partial last one, one tile wider than f, steps
# of the pack's 256 columns across a tile (700 / 512)
PACK_CASES = [(13, 100, 32, 4), (5, 37, 128, 8), (6, 700, 512, 4)]


@pytest.mark.parametrize("M,f,tile,C", PACK_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hot_block", [32, 2])
def test_pack_leaves_hot_units_out(M, f, tile, C, dtype, hot_block, monkeypatch):
    """The TwELL of the cold units is the reference pack of relu(a) with the hot columns zeroed
    (counts, entries; overflowed tiles by count); the hot values are relu(a[:, units]) exactly,
    NaN gates kept, every one written (into NaN); with an up projection, relu(a[:, units]) * up
    rounded once, in up's own storage (0 times an infinite up is NaN, as in the dense MLP)."""
    if dtype == torch.float16 and f > 100:
        pytest.skip("wide tiles in fp32 only (interpreter time)")
    if hot_block == 2 and dtype == torch.float16:
        pytest.skip("rounds of two places (several a step) in fp32 only")
    from twell.kernels import gate_pack

    monkeypatch.setattr(gate_pack, "HOT_BLOCK", hot_block)
    g_ = torch.Generator().manual_seed(M + f)
    a = (torch.randn(M, f, generator=g_) - 1.2).to(dtype)
    units = torch.tensor(sorted({0, 1, 31, 32, f - 1, f // 2, *torch.randperm(f, generator=g_)[:5].tolist()}))
    a[:, units[:3]] += 2.0  # hot units that fire for most tokens
    a[2] = 3.0  # a dense row: its tiles overflow
    a[3, units[1]] = float("nan")  # a NaN gate of a hot unit fires (relu keeps it)
    a[4, 5] = float("nan") if 5 not in units.tolist() else a[4, 5]
    hs = hot_units(units, f)
    g, g_hot = pack_relu_hot(a, hs, tile, C)
    cold = a.clone()
    cold[:, units] = 0.0
    ref = pack_twell(torch.relu(cold), tile, C)
    assert_same_twell_nan(g, ref)
    want = torch.where(~(a[:, units].float() <= 0), a[:, units], torch.zeros((), dtype=dtype))
    assert torch.allclose(g_hot, want, rtol=0, atol=0, equal_nan=True)
    assert bool(torch.isnan(g_hot[3, 1]))
    # every hot value is written: into a NaN-filled buffer, only the NaN gate stays NaN
    buf = torch.full((M, hs.n), float("nan"), dtype=dtype)
    assert_same_twell_nan(pack_relu(a, tile, C, method="bits", _hot=(hs, buf, False)), ref)
    assert torch.allclose(buf, want, rtol=0, atol=0, equal_nan=True) and int(torch.isnan(buf).sum()) == 1
    # gated: the up projection in place, times relu(a), rounded once from fp32
    up = torch.randn(M, hs.n, generator=g_).to(dtype)
    up[0, 0] = float("inf")
    a[0, units[0]] = -1.0  # a unit that does not fire, times inf
    want_up = (torch.relu(a[:, units]).float() * up.float()).to(dtype)
    g2, h = pack_relu_hot(a, hs, tile, C, up=up)
    assert h.data_ptr() == up.data_ptr()
    assert torch.allclose(h, want_up, rtol=0, atol=0, equal_nan=True)
    assert bool(torch.isnan(h[0, 0])) and bool(torch.isnan(h[3, 1]))
    assert_same_twell_nan(g2, ref)
    # without hot units: the plain pack; an empty hot set packs every unit
    g0, h0 = pack_relu_hot(a, hot_units(torch.zeros(0, dtype=torch.int64), f), tile, C)
    assert h0.shape == (M, 0)
    assert_same_twell_nan(g0, pack_relu(a, tile, C, method="bits"))


def test_pack_hot_writes_only_its_rows():
    """A partial block of rows (two rows a program, an odd M) writes the hot values of its rows
    only: the row after the last, in the same storage, keeps what it held."""
    M, f = 5, 70
    g_ = torch.Generator().manual_seed(0)
    a_big = torch.randn(M + 1, f, generator=g_)
    a_big[M] = 2.0
    hs = hot_units(torch.tensor([0, 33, 69]), f)
    up_big = torch.randn(M + 1, hs.n, generator=g_)
    up_big[M] = 7.0
    a, up = a_big[:M], up_big[:M]
    want = torch.relu(a[:, hs.units]) * up
    _, h = pack_relu_hot(a, hs, 32, 4, config=(2, 32, 1), up=up)
    assert torch.equal(h, want) and torch.equal(up_big[M], torch.full((hs.n,), 7.0))


def test_pack_hot_refuses_bad_sets():
    a = torch.randn(4, 40)
    with pytest.raises(TypeError, match="HotUnits"):
        pack_relu_hot(a, torch.tensor([1]), 32, 4)
    with pytest.raises(ValueError, match="f = 41"):
        pack_relu_hot(a, hot_units(torch.tensor([1]), 41), 32, 4)
    with pytest.raises(ValueError, match="tile >= 32"):
        pack_relu_hot(a, hot_units(torch.tensor([1]), 40), 16, 4)
    hs = hot_units(torch.tensor([1, 2]), 40)
    for up in (torch.zeros(4, 3), torch.zeros(4, 2, dtype=torch.float16), torch.zeros(2, 4).t()):
        with pytest.raises(ValueError, match="up must be"):
            pack_relu_hot(a, hs, 32, 4, up=up)


SHAPES = [(13, 40, 100, 32, 4), (9, 24, 70, 128, 8)]  # M, d, f, tile, C


@pytest.mark.parametrize("M,d,f,tile,C", SHAPES)
@pytest.mark.parametrize("kernel", ["token", "split"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("gated", [True, False])
def test_ffn_with_hot_units(M, d, f, tile, C, kernel, dtype, gated, monkeypatch):
    """Cold units from TwELL, hot ones as a dense block, rows computed whole written over: y
    equals the reference MLP on every row of a NaN-filled output (the all-zero row, the dense
    row whose tiles overflow, rows above the dense-row limit with hot units firing); the
    statistics count every unit once (the rows computed whole count their hot units
    themselves); the counters as without hot units."""
    if not gated and kernel == "split":
        pytest.skip("the split path is the gated FFN's")
    monkeypatch.setattr(updown, "TWO_PASS_MIN_M", 0)
    monkeypatch.setattr(updown, "LIST_ROWS_BLOCK", 4)
    hot_cols = torch.tensor([0, 5, f // 3, f - 1])
    x, wg, wu, wd = _skewed_pre(M, d, f, dtype, M + d + f, hot_cols)
    pre = x @ wg.T  # (non-gated: the gate weights as the sparse up projection)
    ref = (R.gated_mlp(x.double(), wg.double(), wu.double(), wd.double()) if gated
           else R.mlp(x.double(), wg.double(), wd.double()))
    hs = hot_units(hot_cols, f)
    g, h_hot = pack_relu_hot(pre, hs, tile, C, up=(x @ wu[hs.units].T).contiguous() if gated else None)
    fire = pre > 0
    active = fire.sum(dim=1)
    cold_active = active - fire[:, hot_cols].sum(dim=1)
    over = g.counts > g.slots
    # rows with more cold units than most rows that fit their tiles are listed too
    monkeypatch.setattr(updown, "DENSE_ROW_MIN", int(cold_active[~over.any(dim=1)].median()))
    listed = over.any(dim=1) | (cold_active > updown.DENSE_ROW_MIN)
    assert bool(over.any()) and bool((listed & ~over.any(dim=1)).any()) and bool((~listed & fire[:, hot_cols].any(1)).any())
    w = prepare_gated_weights(wu, wd)
    uc = torch.zeros(f, dtype=torch.int32)
    nnz = torch.full((M,), -1, dtype=torch.int32)
    c = OverflowCounters.zeros("cpu")
    out = torch.full((M, d), float("nan"), dtype=dtype)
    kw = dict(w_up=w.up) if gated else {}
    y = ffn_from_twell(x, g, w.down_t if gated else wd.T.contiguous(), pre=pre.clone(), counters=c, unit_counts=uc,
                       row_nnz=nnz, kernel=kernel, out=out, pre_writable=True, hot=(h_hot, hs), **kw)
    assert y.data_ptr() == out.data_ptr()
    assert rel_err(y, ref) < TOL[dtype]
    assert rel_err(y[listed], ref[listed]) < TOL[dtype] and rel_err(y[~listed], ref[~listed]) < TOL[dtype]
    assert torch.all(y[1] == 0)  # the all-zero row
    assert torch.equal(uc.long(), fire.sum(0)) and torch.equal(nnz.long(), active)
    assert int(c.tiles) == int(over.sum()) and int(c.rows) == int(over.any(dim=1).sum())


@pytest.mark.parametrize("units,nan_at", [([3], None), ([3, 40], (0, 40))])
def test_ffn_one_hot_unit_and_a_nan_hot_gate(units, nan_at, monkeypatch):
    """A hot set of one unit still writes its block first (the kernels add to it); a NaN gate of
    a hot unit makes its row NaN, as in the dense MLP, and counts as active."""
    monkeypatch.setattr(updown, "TWO_PASS_MIN_M", 0)
    M, d, f = 9, 16, 70
    x, wg, wu, wd = gate_case(M, d, f, seed=3)
    pre = x @ wg.T
    if nan_at is not None:
        pre[nan_at] = float("nan")
    hs = hot_units(torch.tensor(units), f)
    g, h = pack_relu_hot(pre, hs, 32, 4, up=(x @ wu[hs.units].T).contiguous())
    w = prepare_gated_weights(wu, wd)
    uc, nnz = torch.zeros(f, dtype=torch.int32), torch.full((M,), -1, dtype=torch.int32)
    y = ffn_from_twell(x, g, w.down_t, w_up=w.up, pre=pre.clone(), unit_counts=uc, row_nnz=nnz, kernel="token",
                       pre_writable=True, out=torch.full((M, d), float("nan")), hot=(h, hs))
    fire = ~(pre <= 0)
    assert torch.equal(uc.long(), fire.sum(0)) and torch.equal(nnz.long(), fire.sum(1))
    a = torch.nan_to_num(pre, nan=0.0)  # the reference on the finite rows
    ref = (torch.relu(a.double()) * (x.double() @ wu.double().T)) @ wd.double().T
    rows = torch.ones(M, dtype=torch.bool)
    if nan_at is not None:
        assert bool(torch.isnan(y[nan_at[0]]).all())
        rows[nan_at[0]] = False
    assert rel_err(y[rows], ref[rows]) < 1e-5


def test_hot_units_need_the_dense_rows_path(monkeypatch):
    """Where an overflowed tile would go to the per-token exact launch (which reads all its
    units from pre, the hot ones too), hot units are refused, as are an h_hot of the wrong shape,
    an out that overlaps it and a set for another f."""
    M, d, f = 6, 16, 40
    x, wg, wu, wd = gate_case(M, d, f, seed=1)
    pre = x @ wg.T
    hs = hot_units(torch.tensor([1, 2]), f)
    g, g_hot = pack_relu_hot(pre, hs, 32, 4, up=(x @ wu[hs.units].T).contiguous())
    w = prepare_gated_weights(wu, wd)
    monkeypatch.setattr(updown, "TWO_PASS_MIN_M", 0)
    for kw in (dict(pre=pre.clone(), pre_writable=False), dict(w_first=wg, pre_writable=True)):
        with pytest.raises(ValueError, match="dense-rows path"):
            ffn_from_twell(x, g, w.down_t, w_up=w.up, hot=(g_hot, hs), **kw)
    with pytest.raises(ValueError, match="h_hot"):
        ffn_from_twell(x, g, w.down_t, w_up=w.up, pre=pre.clone(), pre_writable=True, hot=(g_hot[:, :1].contiguous(), hs))
    both = torch.zeros(M * d)  # out's first rows are h_hot's storage
    with pytest.raises(ValueError, match="overlap h_hot"):
        ffn_from_twell(x, g, w.down_t, w_up=w.up, pre=pre.clone(), pre_writable=True, out=both.view(M, d),
                       hot=(both[: 2 * M].view(M, 2), hs))
    with pytest.raises(ValueError, match="f = 41"):
        ffn_from_twell(x, g, w.down_t, w_up=w.up, pre=pre.clone(), pre_writable=True, hot=(g_hot, hot_units(torch.tensor([1, 2]), 41)))
    with pytest.raises(ValueError, match="one_launch"):
        ffn_from_twell(x, g, w.down_t, w_up=w.up, pre=pre.clone(), pre_writable=True, hot=(g_hot, hs), one_launch=True)
    monkeypatch.setattr(updown, "TWO_PASS_MIN_M", M + 1)
    with pytest.raises(ValueError, match="dense-rows path"):
        ffn_from_twell(x, g, w.down_t, w_up=w.up, pre=pre.clone(), pre_writable=True, hot=(g_hot, hs))


class _Done:
    def query(self):
        return True


def test_poll_takes_the_hot_set_from_a_prefill_probe(monkeypatch):
    """A prefill probe's two hot-unit figures: the units used price the hot block into the
    estimate (HOT_UNIT_COST each, the row counts being the cold units'); the count of units at
    HOT_MIN_RATE or more sets the next hot set, the most frequent ones, at most HOT_MAX_UNITS, none
    below HOT_MIN_UNITS; a probe without the figures (the dense path's) leaves the set alone."""
    from twell.inference import dispatch
    from twell.inference.dispatch import LayerState, row_stats

    m = twell.SparseGatedMLP(8, 200)
    s = m._twell_layer
    per_row = torch.tensor([10.0, 10.0, 10.0, 10.0])
    freq = torch.arange(200, dtype=torch.float32).flip(0)  # unit j fires 199 - j times
    freq[[150, 160]] = 500.0  # two frequent units far from the others
    def poll():
        s._poll()
        if s._hot_pending is not None:  # what the next eager prefill call does first
            s._set_hot(s._hot_pending)
            s._hot_pending = None

    s._unit_freq = freq.clone()
    s._host, s._event, s._no_overflow = torch.cat([row_stats(per_row, torch.tensor(0.0)), torch.tensor([64.0, 127.0])]), _Done(), False
    poll()
    assert s.estimate == pytest.approx((10.0 + 64 * dispatch.HOT_UNIT_COST, 10.0))
    # 127 units at the rate: the 64 most frequent (a multiple of HOT_UNIT_STEP)
    assert s.hot is not None and s.hot.units.tolist() == sorted([150, 160, *range(62)]) and s._unit_freq is None
    monkeypatch.setattr(dispatch, "HOT_UNIT_STEP", 1)
    monkeypatch.setattr(dispatch, "HOT_MIN_UNITS", 32)
    monkeypatch.setattr(dispatch, "HOT_MAX_UNITS", 33)
    s._unit_freq = freq.clone()
    s._host, s._event = torch.cat([row_stats(per_row, torch.tensor(0.0)), torch.tensor([40.0, 40.0])]), _Done()
    poll()
    assert s.hot.units.tolist() == sorted([150, 160, *range(31)])
    s._unit_freq = freq.clone()
    s._host, s._event = torch.cat([row_stats(per_row, torch.tensor(0.0)), torch.tensor([0.0, 31.0])]), _Done()
    poll()
    assert s.hot is None and s.estimate == pytest.approx((10.0, 10.0))
    # the hot block's price adds to the cold rows' cost, and leaves their rms term as it is
    uneven = torch.tensor([10.0, 10.0, 10.0, 50.0])
    rms = float(uneven.square().mean().sqrt())
    s._host, s._event = torch.cat([row_stats(uneven, torch.tensor(0.0)), torch.tensor([128.0, 0.0])]), _Done()
    poll()
    assert s.estimate == pytest.approx((20.0 + LayerState.RMS_WEIGHT * (rms - 20.0) + 128 * dispatch.HOT_UNIT_COST, 50.0))
    s.hot = hot_units(torch.tensor([1, 2]), 200)
    s._host, s._event, s._no_overflow = row_stats(per_row), _Done(), True  # a dense probe
    poll()
    assert s.hot is not None and s.hot.n == 2


def test_module_prefill_with_hot_units(monkeypatch):
    """The module's prefill path with a hot set: the dense module's output and statistics (every
    unit counted once), through pack_relu_hot; never inside a capture, below HOT_MIN_M tokens,
    with HOT_UNITS off, or for a set of another f."""
    from twell.inference import dispatch
    from twell.kernels import gate_pack

    M, d, f = 12, 24, 70
    monkeypatch.setattr(dispatch, "HOT_MIN_M", 10)
    monkeypatch.setattr(updown, "TWO_PASS_MIN_M", 0)
    hot_cols = torch.tensor([3, 40, 69])
    x, wg, wu, wd = _skewed_pre(M, d, f, torch.float32, 7, hot_cols)
    mods = {}
    for mode in ("dense", "prefill"):
        m = twell.SparseGatedMLP(d, f).eval()
        with torch.no_grad():
            m.gate_proj.weight.copy_(wg)
            m.up_proj.weight.copy_(wu)
            m.down_proj.weight.copy_(wd)
        m.kernel_mode, m.track_stats = mode, True
        mods[mode] = m
    s = mods["prefill"]._twell_layer
    s.hot = hot_units(hot_cols, f)
    calls = []
    real = gate_pack.pack_relu_hot
    monkeypatch.setattr(gate_pack, "pack_relu_hot", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.no_grad():
        y = mods["prefill"](x)
        y_dense = mods["dense"](x)
    assert calls and mods["prefill"].last_path == "prefill" and s.last_hot_units == 3
    assert rel_err(y, y_dense) < 1e-5
    st, sd = mods["prefill"].stats, mods["dense"].stats
    assert torch.equal(st.unit_counts, sd.unit_counts) and int(st.active_max) == int(sd.active_max)
    w_down_t = mods["prefill"].down_proj.weight.t()
    assert s._hot_for(x, w_down_t, wu, M, f, False) is s.hot
    assert s._hot_for(x, w_down_t, wu, M, f, True) is None  # capturing
    assert s._hot_for(x, w_down_t, wu, 9, f, False) is None  # below HOT_MIN_M
    assert s._hot_for(x, w_down_t, wu, M, f + 1, False) is None
    # not in float16, where the hot part's own rounding could overflow (dense rounds once)
    assert s._hot_for(x.half(), w_down_t.half(), wu.half(), M, f, False) is None
    # a new set waits for an eager call: the compiled op's calls (keep False) leave it pending
    s._hot_pending, s._unit_freq = 64, torch.zeros(f)
    before = s.hot
    with torch.no_grad():
        s._prefill(mods["prefill"], x, wg, w_down_t, wu, False, False, keep=False)
    assert s._hot_pending == 64 and s.hot is before and len(calls) == 2
    with torch.no_grad():
        s._prefill(mods["prefill"], x, wg, w_down_t, wu, False, False)
    assert s._hot_pending is None and s.hot is not before and s.hot.n == 64
    monkeypatch.setattr(dispatch, "HOT_UNITS", False)
    s.hot = before
    assert s._hot_for(x, w_down_t, wu, M, f, False) is None
    with torch.no_grad():
        mods["prefill"](x)
    assert len(calls) == 3 and s.last_hot_units == 0


@pytest.mark.gpu
@pytest.mark.parametrize("M", [65536, 131072])
def test_gpu_module_takes_hot_units_on_a_skewed_layer(M):
    """Real shape, bf16, skewed units (with a fully dense row and an all-zero row): after its
    first prefill probe the layer holds a hot set of HOT_MIN_UNITS to HOT_MAX_UNITS units and its calls
    use it; the output within dense bf16's error (overall and worst row), the statistics every
    unit's once. An evenly spread layer gets no hot set. No host synchronisation anywhere."""
    from twell.inference import dispatch
    from twell.bench.inference import errors, reference_fp32
    from twell.bench.synthetic import make_ffn

    for dist in ("skewed", "even"):
        s = make_ffn(M, 2048, 5632, 29, dist, dtype=torch.bfloat16, device="cuda", seed=5)
        s.x[5] = 0
        s.x[7, 0] = -50.0
        m = twell.SparseGatedMLP(2048, 5632, device="cuda", dtype=torch.bfloat16).eval()
        with torch.no_grad():
            m.gate_proj.weight.copy_(s.w_gate)
            m.up_proj.weight.copy_(s.w_up)
            m.down_proj.weight.copy_(s.w_down)
            m.track_stats = False
            lay = m._twell_layer
            for _ in range(2 * dispatch.LayerState.PROBE_EVERY + 2):  # a prefill probe, then its poll
                m(s.x)
                torch.cuda.synchronize()
            if dist == "even":
                assert lay.hot is None
                continue
            assert lay.hot is not None and dispatch.HOT_MIN_UNITS <= lay.hot.n <= dispatch.HOT_MAX_UNITS
            assert lay.hot.n % dispatch.HOT_UNIT_STEP == 0
            torch.cuda.set_sync_debug_mode("error")
            try:
                y = m(s.x)
            finally:
                torch.cuda.set_sync_debug_mode(0)
            assert m.last_path == "prefill" and lay.last_hot_units == lay.hot.n
            ref = reference_fp32(s.x, s.w_gate, s.w_up, s.w_down)
            _, dense_row = errors(torch.relu(s.x @ s.w_gate.T) * (s.x @ s.w_up.T) @ s.w_down.T, ref)
            rel, row = errors(y, ref)
            assert rel < 1e-2 and row <= 2 * dense_row, (rel, row, dense_row)
            assert torch.all(y[5] == 0) and bool(torch.isfinite(y).all())
            m.track_stats = True
            m(s.x)
            fire = s.x @ s.w_gate.T > 0
            assert torch.equal(m.stats.unit_counts, fire.sum(0)) and int(m.stats.active_max) == int(fire.sum(1).max())

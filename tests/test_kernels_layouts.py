"""Kernels on inputs laid out as callers really pass them, and on the pattern that hides spills.

Every other kernel test passes contiguous tensors whose row strides equal their row lengths, and
weights with equal strides: a kernel that indexes one tensor with another's stride, or with the
row length, passes those. Here each input is a view into a wider buffer (NaN outside the view)
with its own stride; and a row whose last tile overflows is followed by a row with entries in
its first tile, the one place where a write one slot past a tile's capacity lands in a slot
that no later write repairs.
"""

from __future__ import annotations

import pytest
import torch

from kernel_cases import gate_case, packed, rel_err
from test_kernels_pack import assert_same_twell
from twell import reference as R
from twell.format import pack_twell
from twell.kernels import OverflowCounters, ffn_from_twell, gate_pack_fused, pack_relu, updown


def strided(t: torch.Tensor, pad: int, every: int = 1) -> torch.Tensor:
    """A copy of 2-D ``t`` as rows ``every`` apart of a NaN buffer ``pad`` columns wider."""
    buf = torch.full((t.shape[0] * every, t.shape[1] + pad), float("nan"), dtype=t.dtype)
    view = buf[::every, pad // 2 : pad // 2 + t.shape[1]]
    view.copy_(t)
    return view


def spill_case(f: int, tile: int, compression: int, dtype=torch.float32):
    """Pre-activations whose row 0 overflows only its last tile and whose row 1 has entries
    (not overflowing) in its first tile; other rows random."""
    slots = tile // compression - 1
    a = -torch.rand(4, f, dtype=torch.float64) - 0.1
    last = (f - 1) // tile * tile
    a[0, last : last + slots + 1] = torch.rand(slots + 1, dtype=torch.float64) + 0.5  # one entry too many
    a[1, : max(1, slots - 1)] = torch.rand(max(1, slots - 1), dtype=torch.float64) + 0.5
    a[2, ::3] = 1.0
    return a.to(dtype)


@pytest.mark.parametrize("method", ["scan", "bits"])
@pytest.mark.parametrize("f,tile,compression", [(96, 32, 4), (200, 64, 8)])
def test_pack_last_tile_overflow_then_a_clean_row(method, f, tile, compression):
    a = spill_case(f, tile, compression)
    out = pack_relu(a, tile, compression, method=method)
    ref = pack_twell(torch.relu(a), tile, compression)
    assert bool(out.overflowed()[0, -1]) and not bool(out.overflowed()[1].any())
    assert_same_twell(out, ref)


def test_fused_gate_pack_last_tile_overflow_then_a_clean_row():
    """Through the fused gate kernel: x = identity rows pick the pre-activations exactly."""
    f, tile, compression = 96, 32, 4
    a = spill_case(f, tile, compression)
    M, d = a.shape[0], 16
    x = torch.zeros(M, d)
    x[:, :M] = torch.eye(M)
    w = torch.zeros(f, d)
    w[:, :M] = a.T
    out = gate_pack_fused(x, w, tile=tile, compression=compression, block_m=16, block_k=16, num_warps=4, num_stages=1)
    assert_same_twell(out, pack_twell(torch.relu(x @ w.T), tile, compression))


@pytest.mark.parametrize("method", ["scan", "bits"])
def test_pack_reads_rows_by_their_stride(method):
    # 6 rows: a row read at the wrong offset shows from the second row on; two 64-column tiles
    # and a partial third
    x, w, _, _ = gate_case(6, 24, 150, torch.float32, seed=5)
    a = x @ w.T
    for view in (strided(a, 13), strided(a, 0, every=3)):
        assert view.stride(0) != a.shape[1]
        assert_same_twell(pack_relu(view, 64, 4, method=method), pack_twell(torch.relu(a), 64, 4))


@pytest.mark.parametrize("kernel", ["token", "token-two-pass", "rows"])
@pytest.mark.parametrize("gated", [True, False])
def test_ffn_from_twell_with_every_input_strided(kernel, gated, monkeypatch):
    """x, w_up, w_down_t, w_first and pre each with a different row stride, none equal to d or f."""
    if kernel == "token-two-pass":  # overflowed tiles in a second launch, as for large M
        monkeypatch.setattr(updown, "TWO_PASS_MIN_M", 0)
        kernel = "token"
    M, d, f = 13, 40, 100
    x, wg, wu, wd = gate_case(M, d, f, torch.float32, seed=6)
    pre = x @ wg.T
    g = packed(pre, 128 if kernel == "rows" else 32, 4)  # the rows kernel takes one tile per row
    assert bool(g.overflowed().any())
    xs, wus, wdts, wgs, pres = strided(x, 3), strided(wu, 7), strided(wd.T.contiguous(), 11), strided(wg, 0, every=2), strided(pre, 5)
    assert len({xs.stride(0), wus.stride(0), wdts.stride(0), wgs.stride(0), pres.stride(0), d, f}) == 7
    ref = R.gated_mlp(x.double(), wg.double(), wu.double(), wd.double()) if gated else R.mlp(x.double(), wg.double(), wd.double())
    for kw in (dict(pre=pres), dict(w_first=wgs)):
        c = OverflowCounters.zeros("cpu")
        y = ffn_from_twell(xs, g, wdts, w_up=wus if gated else None, counters=c, kernel=kernel, **kw)
        assert rel_err(y, ref) < 1e-5, kw.keys()
        assert int(c.tiles) == int(g.overflowed().sum())

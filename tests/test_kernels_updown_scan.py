"""The FFN straight from the pre-activation (``twell.kernels.updown_scan.ffn_from_pre``: each
token's program lists its own active units) against the PyTorch reference: Triton interpreter
on the CPU in fp32/fp16, bf16 at the real shape on the GPU."""

from __future__ import annotations

import pytest
import torch

from kernel_cases import case_id, gate_case, rel_err
from twell import reference as R
from twell.kernels import OverflowCounters
from twell.kernels.updown_scan import default_cap, ffn_from_pre

TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1e-2}
# M, d, f, cap, (columns per scan step, units per gather step, warps): scan steps narrower and
# wider than f, a partial last step, d padded, lists of one slot and lists that never overflow
SHAPES = [
    (13, 40, 100, 6, (32, 2, 1)),
    (8, 72, 70, 1, (16, 4, 2)),
    (5, 24, 37, 37, (64, 1, 1)),
    (9, 40, 130, 12, (256, 8, 4)),
]
CASES = [(torch.float32, *s) for s in SHAPES] + [(torch.float16, *SHAPES[0])]


def _nan_out(M, d, dtype):
    return torch.full((M, d), float("nan"), dtype=dtype)


@pytest.mark.parametrize("dtype,M,d,f,cap,config", CASES, ids=case_id)
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "mlp"])
def test_matches_reference(dtype, M, d, f, cap, config, gated):
    x, w1, wu, wd = gate_case(M, d, f, dtype, seed=M + d + f)
    pre = x @ w1.T
    if gated:
        ref = R.gated_mlp(x.double(), w1.double(), wu.double(), wd.double())
    else:
        ref = R.mlp(x.double(), w1.double(), wd.double())
    c = OverflowCounters.zeros("cpu")
    uc = torch.zeros(f, dtype=torch.int32)
    nnz = torch.empty(M, dtype=torch.int32)
    y = ffn_from_pre(x, pre, wd.T.contiguous(), w_up=wu if gated else None, out=_nan_out(M, d, dtype),
                     counters=c, unit_counts=uc, row_nnz=nnz, cap=cap, config=config)
    assert y.dtype == dtype and y.shape == (M, d)
    assert rel_err(y, ref) < TOL[dtype]
    assert torch.all(y[1] == 0)  # the all-zero row: no unit, y written as zeros
    fires = ~(pre <= 0)
    assert torch.equal(nnz.long(), fires.sum(1)) and torch.equal(uc.long(), fires.sum(0))
    over = fires.sum(1) > cap
    assert int(over.sum()) >= (1 if cap < f else 0)
    assert int(c.rows) == int(over.sum()) and int(c.tiles) == int(over.sum())
    # counters accumulate; the outputs do not depend on the statistics
    y2 = ffn_from_pre(x, pre, wd.T.contiguous(), w_up=wu if gated else None, counters=c, cap=cap, config=config)
    assert int(c.rows) == 2 * int(over.sum())
    assert torch.equal(y, y2)


def test_lists_cut_short_are_wrong_without_the_exact_launch(monkeypatch):
    """Without the second launch, rows past the list would come back zero: the test above,
    whose cases overflow, can fail."""
    from twell.kernels import updown_scan

    x, w1, wu, wd = gate_case(13, 40, 100, torch.float32, seed=3)
    pre = x @ w1.T
    real = updown_scan._ffn_from_twell_kernel

    class Skip:
        def __getitem__(self, grid):
            return lambda *a, **k: None

    monkeypatch.setattr(updown_scan, "_ffn_from_twell_kernel", Skip())
    y = ffn_from_pre(x, pre, wd.T.contiguous(), w_up=wu, cap=6, config=(32, 2, 1))
    monkeypatch.setattr(updown_scan, "_ffn_from_twell_kernel", real)
    assert rel_err(y, R.gated_mlp(x, w1, wu, wd)) > 1e-2


def test_nan_gate_gives_dense_nan():
    """A NaN gate fires (relu passes it on), so its token's row is NaN as in the dense MLP, both
    within the list and past it; other rows stay finite."""
    x, w1, wu, wd = gate_case(9, 40, 100, torch.float32, seed=4)
    pre = x @ w1.T
    pre[4, 17] = float("nan")  # one unit of a light row
    pre[6] = float("nan")  # a whole row: past any list
    y = ffn_from_pre(x, pre, wd.T.contiguous(), w_up=wu, cap=8, config=(32, 2, 1))
    assert torch.isnan(y[4]).all() and torch.isnan(y[6]).all()
    rest = [i for i in range(9) if i not in (4, 6)]
    h = torch.relu(pre[rest]) * (x[rest] @ wu.T)
    assert rel_err(y[rest], h @ wd.T) < 1e-5


def test_default_cap_and_validation():
    assert default_cap(5632) == 1023 and default_cap(100) == 15 and default_cap(3) == 1
    x, w1, wu, wd = gate_case(4, 16, 20, torch.float32, seed=2)
    pre = x @ w1.T
    wdt = wd.T.contiguous()
    with pytest.raises(TypeError, match="dtype"):
        ffn_from_pre(x, pre.half(), wdt, w_up=wu)
    with pytest.raises(ValueError, match="pre must be"):
        ffn_from_pre(x, pre[:3], wdt, w_up=wu)
    with pytest.raises(ValueError, match="cap"):
        ffn_from_pre(x, pre, wdt, w_up=wu, cap=0)
    with pytest.raises(ValueError, match="power of two"):
        ffn_from_pre(x, pre, wdt, w_up=wu, config=(24, 2, 1))
    with pytest.raises(ValueError, match="together"):
        ffn_from_pre(x, pre, wdt, w_up=wu, unit_counts=torch.zeros(20, dtype=torch.int32))
    with pytest.raises(ValueError, match="w_down_t"):
        ffn_from_pre(x, pre, wd, w_up=wu)  # [d, f], not [f, d]
    assert ffn_from_pre(x[:0], pre[:0], wdt, w_up=wu).shape == (0, 16)


@pytest.mark.gpu
@pytest.mark.parametrize("dist", ["even", "skewed", "heavy"])
def test_gpu_bf16(dist):
    from twell.bench.inference import errors, reference_fp32
    from twell.bench.synthetic import make_ffn

    s = make_ffn(4099, 2048, 5632, 29, dist, dtype=torch.bfloat16, device="cuda", seed=3)
    s.x[5] = 0  # an all-zero row
    s.x[7, 0] = -50.0  # a fully dense row: past the list
    ref = reference_fp32(s.x, s.w_gate, s.w_up, s.w_down)
    dense = torch.relu(s.x @ s.w_gate.T) * (s.x @ s.w_up.T) @ s.w_down.T
    _, dense_row = errors(dense, ref)
    c = OverflowCounters.zeros("cuda")
    pre = s.x @ s.w_gate.T
    y = ffn_from_pre(s.x, pre, s.w_down.T.contiguous(), w_up=s.w_up, counters=c,
                     out=torch.full_like(s.x, float("nan")))
    rel, row = errors(y, ref)
    assert rel < 1e-2 and row <= 2 * dense_row, (rel, row, dense_row)
    assert int(c.rows) >= 1 and torch.all(y[5] == 0)

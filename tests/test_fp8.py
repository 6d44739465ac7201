"""FP8 rows (twell.fp8): the per-row quantisation, the dense FP8 baseline, and the TwELL up/down
kernels reading FP8 rows with per-unit scales against the plain PyTorch reference (Triton
interpreter on the CPU, in fp32 and fp16)."""

from __future__ import annotations

import pytest
import torch

from kernel_cases import case_id, gate_case, packed, rel_err
from twell import fp8
from twell.kernels import OverflowCounters, ffn_from_twell, updown

SHAPES = [(13, 40, 100, 32, 4), (5, 24, 37, 64, 2)]  # M, d, f, tile, C


def test_quantize_rows_keeps_each_row_within_half_a_step():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(37, 50, generator=g) * torch.logspace(-6, 3, 37)[:, None]  # rows of very different size
    w[5] = 0.0
    r = fp8.quantize_rows(w)
    assert r.q.dtype == fp8.E4M3 and r.scale.dtype == torch.float32 and r.scale.shape == (37,)
    back = r.dequantize()
    assert torch.all(back[5] == 0)
    # each row's largest magnitude lands on 448 exactly; e4m3 has 3 mantissa bits: relative error
    # at most 2^-4 of the value for normal numbers, plus the subnormal floor of the row's scale
    assert torch.equal(r.q.float().abs().amax(dim=1)[torch.arange(37) != 5], torch.full((36,), 448.0))
    floor = r.scale[:, None] * 2.0 ** -9
    assert torch.all((back - w).abs() <= w.abs() * 2.0 ** -4 + floor)


def test_quantize_rows_refuses_what_it_cannot_represent():
    with pytest.raises(ValueError, match="NaN or inf"):
        fp8.quantize_rows(torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(ValueError, match="2-D"):
        fp8.quantize_rows(torch.ones(3))
    with pytest.raises(TypeError, match="floating"):
        fp8.quantize_rows(torch.ones(2, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"\[f, d\]"):
        fp8.fp8_gated_weights(torch.ones(4, 3), torch.ones(4, 3), torch.ones(4, 3))


def test_dense_fp8_baseline_is_the_rowwise_scaled_math():
    x, wg, wu, wd = gate_case(9, 32, 48, torch.float32, seed=3, adversarial=False)
    G, U, D = fp8.quantize_rows(wg), fp8.quantize_rows(wu), fp8.quantize_rows(wd)
    y = fp8.dense_fp8_gated_mlp(x, G, U, D)
    xq = fp8.quantize_tokens(x)
    xd = xq.dequantize()
    h = torch.relu(xd @ G.dequantize().t()) * (xd @ U.dequantize().t())
    ref = fp8.quantize_tokens(h).dequantize() @ D.dequantize().t()
    assert y.dtype == x.dtype and rel_err(y, ref) < 1e-5


@pytest.mark.parametrize("dtype,M,d,f,tile,C", [(torch.float32, *s) for s in SHAPES] + [(torch.float16, *SHAPES[0])],
                         ids=case_id)
@pytest.mark.parametrize("kernel", ["token", "token-two-pass", "split", "dense-rows"])
def test_ffn_from_twell_reads_fp8_rows(dtype, M, d, f, tile, C, kernel, monkeypatch):
    writable = kernel == "dense-rows"  # overflowed and long rows whole, on tensor cores (heavy_rows)
    if kernel in ("token-two-pass", "dense-rows"):  # overflowed tiles in a second launch, as for large M
        monkeypatch.setattr(updown, "TWO_PASS_MIN_M", 0)
        kernel = "token"
    x, wg, wu, wd = gate_case(M, d, f, torch.float32, seed=M + f)
    w = fp8.fp8_gated_weights(wg, wu, wd)
    x = x.to(dtype)
    pre = fp8.scaled_mm_rows(fp8.quantize_tokens(x), w.gate, dtype)
    g = packed(pre, tile, C)
    assert bool(g.overflowed().any())  # the exact path is exercised
    ref = fp8.twell_fp8_reference(x, w)
    c = OverflowCounters.zeros("cpu")
    out = torch.full((M, d), float("nan"), dtype=dtype)
    y = ffn_from_twell(x, g, w.down_t.q, w_up=w.up.q, pre=pre.clone(), counters=c, kernel=kernel, out=out,
                       w_scales=(w.up.scale, w.down_t.scale), pre_writable=writable)
    assert y.data_ptr() == out.data_ptr() and not torch.isnan(y).any()
    assert rel_err(y, ref) < (1e-5 if dtype == torch.float32 else 3e-3)
    over = g.overflowed()
    assert int(c.tiles) == int(over.sum())
    if writable:  # the rows computed whole are the overflowed ones and the long ones
        assert int(c.rows) == int(over.any(dim=1).sum())
    # the same y as the bf16-path kernels given the dequantised rows (scales folded in)
    y_plain = ffn_from_twell(x, g, w.down_t.dequantize(dtype), w_up=w.up.dequantize(dtype), pre=pre, kernel=kernel)
    assert rel_err(y, y_plain) < (1e-5 if dtype == torch.float32 else 3e-3)


def test_non_gated_fp8_rows():
    M, d, f, tile, C = 13, 40, 100, 32, 4
    x, w_up, _, wd = gate_case(M, d, f, torch.float32, seed=5)
    up, down_t = fp8.quantize_rows(w_up), fp8.quantize_rows(wd.t())
    pre = fp8.scaled_mm_rows(fp8.quantize_tokens(x), up, torch.float32)
    g = packed(pre, tile, C)
    y = ffn_from_twell(x, g, down_t.q, pre=pre, w_scales=(None, down_t.scale))
    ref = torch.relu(pre) @ down_t.dequantize()
    assert rel_err(y, ref) < 1e-5


def test_fp8_rows_are_checked_before_any_kernel():
    M, d, f, tile, C = 5, 24, 37, 64, 2
    x, wg, wu, wd = gate_case(M, d, f, torch.float32, seed=1)
    w = fp8.fp8_gated_weights(wg, wu, wd)
    pre = fp8.scaled_mm_rows(fp8.quantize_tokens(x), w.gate, torch.float32)
    g = packed(pre, tile, C)
    scales = (w.up.scale, w.down_t.scale)
    with pytest.raises(TypeError, match="must have dtype"):  # FP8 rows without their scales
        ffn_from_twell(x, g, w.down_t.q, w_up=w.up.q, pre=pre)
    with pytest.raises(TypeError, match="float8"):  # scales for bf16 rows
        ffn_from_twell(x, g, wd.t().contiguous(), w_up=wu, pre=pre, w_scales=scales)
    with pytest.raises(ValueError, match="need pre"):
        ffn_from_twell(x, g, w.down_t.q, w_up=w.up.q, w_first=wg, w_scales=scales)
    with pytest.raises(ValueError, match="contiguous"):
        ffn_from_twell(x, g, w.down_t.q, w_up=w.up.q, pre=pre, w_scales=(w.up.scale[:-1], w.down_t.scale))
    with pytest.raises(ValueError, match="up_scale exactly when"):
        ffn_from_twell(x, g, w.down_t.q, w_up=w.up.q, pre=pre, w_scales=(None, w.down_t.scale))
    with pytest.raises(ValueError, match="neither hot units nor"):
        ffn_from_twell(x, g, w.down_t.q, w_up=w.up.q, pre=pre, w_scales=scales, kernel="rows")


@pytest.mark.parametrize("dependent_launch", [False, True], ids=["plain", "dependent"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M,d", [(1, 1), (2, 40), (7, 40), (70, 100), (130, 300)])
def test_quantize_kernel_matches_the_reference(dtype, M, d, dependent_launch):
    """Rows of any count (one program of fewer rows than 64, several programs) and width; asked
    for a dependent launch where none can be made (the interpreter, a GPU before Hopper), the
    kernel runs as a plain one."""
    from twell.kernels.quantize import quantize_rows_fp8

    g = torch.Generator().manual_seed(M + d)
    x = (torch.randn(M, d, generator=g) * torch.logspace(-3, 2, M)[:, None]).to(dtype)
    x[M // 2] = 0.0
    if torch.cuda.is_available():
        x = x.cuda()
    q, s = quantize_rows_fp8(x, dependent_launch=dependent_launch)
    x = x.cpu()
    q, s = q.cpu(), s.cpu()
    ref = fp8.quantize_tokens(x)
    assert torch.equal(s, ref.scale)
    assert torch.equal(q.view(torch.uint8), ref.q.view(torch.uint8))


def test_quantize_kernel_rounds_every_midpoint_as_torch_does():
    from twell.kernels.quantize import quantize_rows_fp8

    grid = torch.arange(256, dtype=torch.uint8).view(fp8.E4M3).float()
    grid = grid[torch.isfinite(grid) & (grid >= 0)].unique()  # the 127 non-negative e4m3 values, sorted
    mids = (grid[1:] + grid[:-1]) / 2  # ties: even mantissa wins
    nudged = torch.cat([mids, mids.nextafter(torch.tensor(0.0)), mids.nextafter(torch.tensor(1e3))])
    row = torch.cat([torch.tensor([448.0]), nudged, -nudged])[None, :]  # amax 448: the scale is 1
    q, s = quantize_rows_fp8(row)
    assert float(s) == 1.0
    assert torch.equal(q.view(torch.uint8), row.to(fp8.E4M3).view(torch.uint8))


def test_fp8_ops_match_their_references():
    from twell.inference.fp8_ops import dense_fp8_ffn, dense_fp8_weights, twell_gated_mlp_fp8

    x, wg, wu, wd = gate_case(13, 40, 100, torch.float32, seed=8)
    c = OverflowCounters.zeros("cpu")
    with torch.no_grad():
        y = twell_gated_mlp_fp8(x, fp8.fp8_gated_weights(wg, wu, wd), counters=c)
        assert rel_err(y, fp8.twell_fp8_reference(x, fp8.fp8_gated_weights(wg, wu, wd))) < 1e-5
        assert int(c.tiles) > 0  # the adversarial rows overflowed and were recomputed
        dense = dense_fp8_ffn(x, dense_fp8_weights(wg, wu, wd))
        ref = fp8.dense_fp8_gated_mlp(x, fp8.quantize_rows(wg), fp8.quantize_rows(wu), fp8.quantize_rows(wd))
        assert torch.equal(dense, ref)
        # twell's FP8 error against fp32 math on the dequantised weights is at most dense FP8's
        exact = R_gated(x, wg, wu, wd)
        assert rel_err(y, exact) <= rel_err(dense, exact)
    with pytest.raises(TypeError, match="Fp8GatedWeights"):
        twell_gated_mlp_fp8(x, (wg, wu, wd))
    with pytest.raises(RuntimeError, match="inference only"):
        twell_gated_mlp_fp8(x.requires_grad_(True), fp8.fp8_gated_weights(wg, wu, wd))


def R_gated(x, wg, wu, wd):
    """fp32 gated MLP with the weights each variant quantises (here: dequantised per-row rounding
    of the same bf16 weights differs between layouts, so the bar is the unquantised math)."""
    return (torch.relu(x.double() @ wg.double().t()) * (x.double() @ wu.double().t())) @ wd.double().t()


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 5, 300, 4096, 70000])
@pytest.mark.parametrize("dist", ["even", "heavy"])
def test_fp8_path_on_the_gpu(M, dist):
    from twell.bench.inference import errors
    from twell.bench.synthetic import make_ffn
    from twell.inference.fp8_ops import dense_fp8_ffn, dense_fp8_weights, twell_fp8_ffn

    s = make_ffn(M, 2048, 5632, 29, dist, dtype=torch.bfloat16, device="cuda", seed=M)
    w = fp8.fp8_gated_weights(s.w_gate, s.w_up, s.w_down)
    c = OverflowCounters.zeros("cuda")
    with torch.no_grad():
        y = twell_fp8_ffn(s.x, w, counters=c)
        ref = fp8.twell_fp8_reference(s.x, w)
        assert y.dtype == torch.bfloat16 and not torch.isnan(y).any()
        assert errors(y, ref)[1] < 1e-2  # bf16 output rounding
        dw = dense_fp8_weights(s.w_gate, s.w_up, s.w_down)
        dref = (torch.relu(s.x.float() @ dw.gate.dequantize().t()) * (s.x.float() @ dw.up.dequantize().t())) @ dw.down.dequantize().t()
        assert errors(y, ref)[1] <= errors(dense_fp8_ffn(s.x, dw), dref)[1]


@pytest.mark.parametrize("M,dtype,prequant", [(1, torch.float32, None), (6, torch.float16, None), (8, torch.bfloat16, None),
                                              (1, torch.float16, True), (3, torch.float32, False)])
def test_fp8_decode_kernel(M, dtype, prequant):
    from twell.kernels.decode_fp8 import ffn_decode_fp8
    from twell.kernels.decode_fused import DecodeScratch

    x, wg, wu, wd = gate_case(M, 40, 100, torch.float32, seed=M)
    w = fp8.fp8_gated_weights(wg, wu, wd)
    x = x.to(dtype)
    ref = fp8.twell_fp8_reference(x, w)
    y, counts = ffn_decode_fp8(x, w, prequant=prequant)
    tol = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1e-2}[dtype]
    assert y.dtype == dtype and rel_err(y, ref) < tol
    # the active set is the dense FP8 gate's
    a = fp8.scaled_mm_rows(fp8.quantize_tokens(x), w.gate, dtype)
    assert int(counts.sum()) == int((a > 0).any(dim=0).sum())
    # x quantised in every program or by a kernel of its own first: the same sums, in the same order
    other = not (prequant if prequant is not None else False)  # (no CUDA graph capture here: in registers)
    assert torch.equal(ffn_decode_fp8(x, w, config=(4, 2), prequant=other)[0], ffn_decode_fp8(x, w, config=(4, 2), prequant=not other)[0])
    scratch = DecodeScratch(40, "cpu")
    for _ in range(2):  # the kept accumulator is left zeroed
        assert torch.equal(ffn_decode_fp8(x, w, scratch, prequant=prequant)[0], y)
    assert torch.all(scratch.acc == 0)
    with pytest.raises(ValueError, match="at most"):
        ffn_decode_fp8(torch.zeros(9, 40, dtype=dtype), w)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 2, 8])
def test_fp8_decode_kernel_in_a_cuda_graph(M):
    """Captured in a CUDA graph (where from FP8_PREQUANT_MIN_M tokens x is quantised by a kernel of
    its own, a dependent launch on Hopper) the decode kernel gives the reference's y, replayed on
    new inputs too."""
    from twell.bench.inference import errors
    from twell.bench.synthetic import make_ffn
    from twell.kernels.decode_fp8 import ffn_decode_fp8
    from twell.kernels.decode_fused import DecodeScratch

    s = make_ffn(2 * M, 2048, 5632, 29, "even", dtype=torch.bfloat16, device="cuda", seed=M)
    w = fp8.fp8_gated_weights(s.w_gate, s.w_up, s.w_down)
    scratch = DecodeScratch(2048, "cuda")
    x = s.x[:M].clone()
    ffn_decode_fp8(x, w, scratch)  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = ffn_decode_fp8(x, w, scratch)[0]
    for rows in (slice(0, M), slice(M, 2 * M)):
        x.copy_(s.x[rows])
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert errors(y, fp8.twell_fp8_reference(x, w))[1] < 1e-2
    assert torch.all(scratch.acc == 0)


@pytest.fixture
def fp8_nn(monkeypatch):
    """twell.fp8_nn with its path constants restored after the test."""
    from twell import fp8_nn as mod

    for name in ("PREFILL_MIN_M", "EAGER_PREFILL_MIN_M", "HEAVY_PREFILL_MIN_M", "MAX_WHOLE_ROWS", "MAX_DENSITY"):
        monkeypatch.setattr(mod, name, getattr(mod, name))
    return mod


def test_sparsify_fp8_makes_inference_modules_that_match_the_reference(fp8_nn):
    from transformers import LlamaConfig, LlamaForCausalLM

    import twell
    from twell.fp8_nn import Fp8SparseGatedMLP

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                      hidden_act="relu")
    model = LlamaForCausalLM(cfg).eval()
    mlp = model.model.layers[0].mlp
    w = fp8.fp8_gated_weights(mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
    twell.sparsify(model, fp8=True)
    mods = [m for m in model.modules() if isinstance(m, Fp8SparseGatedMLP)]
    assert len(mods) == 2 and not any(isinstance(m, torch.nn.Linear) for m in mods[0].modules())
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        mods[0](x)  # 10 tokens, fewer than PREFILL_MIN_M: dense FP8
        assert mods[0].last_path == "dense"
        fp8_nn.PREFILL_MIN_M = fp8_nn.EAGER_PREFILL_MIN_M = 10  # (restored by the fixture)
        y = mods[0](x)  # 10 tokens now the prefill path
        assert mods[0].last_path == "prefill"
        assert rel_err(y.reshape(10, 32), fp8.twell_fp8_reference(x.reshape(10, 32), w)) < 1e-5
        y1 = mods[0](x[:1, :3])  # 3 tokens: the decode kernel
        assert mods[0].last_path == "decode"
        assert rel_err(y1.reshape(3, 32), fp8.twell_fp8_reference(x[0, :3], w)) < 1e-5
        logits = model(torch.randint(0, 64, (1, 7))).logits
    assert torch.isfinite(logits).all()
    state = mods[0].state_dict()
    assert state["gate_q"].dtype == fp8.E4M3 and state["down_scale"].shape == (80,)
    with pytest.raises(RuntimeError, match="inference only"):
        mods[0](x.requires_grad_(True))


def test_fp8_module_compiles_without_graph_breaks():
    from twell.fp8_nn import Fp8SparseGatedMLP

    x, wg, wu, wd = gate_case(12, 40, 100, torch.float32, seed=2)
    m = Fp8SparseGatedMLP.from_weights(wg, wu, wd)
    torch._dynamo.reset()
    compiled = torch.compile(m, fullgraph=True, backend="eager")
    with torch.no_grad():
        assert torch.equal(compiled(x), m(x))
        assert torch.equal(compiled(x[:2]), m(x[:2]))


def test_fp8_custom_op_passes_opcheck():
    from twell.inference.fp8_ops import ffn_fp8

    x, wg, wu, wd = gate_case(10, 40, 100, torch.float32, seed=4)
    w = fp8.fp8_gated_weights(wg, wu, wd)
    with pytest.warns(RuntimeWarning, match="no twell module owns"):  # (rows of no module: by size alone)
        torch.library.opcheck(ffn_fp8, (x, w.gate.q, w.gate.scale, w.up.q, w.up.scale, w.down_t.q, w.down_t.scale),
                              test_utils=("test_faketensor",))  # (test_schema multiplies the inputs: no float8 CPU kernel)


def plain(x, w):
    """The FP8 module's dense path in plain PyTorch, fp32 throughout: the down rows' per-unit
    scales folded into the up product, h quantised per token, the e4m3 down rows."""
    xq = fp8.quantize_tokens(x)
    u = xq.dequantize() @ w.up.dequantize().t() * w.down_t.scale
    h = torch.relu(xq.dequantize() @ w.gate.dequantize().t()) * u
    return fp8.quantize_tokens(h).dequantize() @ w.down_t.q.float()


def test_fp8_module_dense_path_is_the_per_unit_scaled_math_and_follows_new_weights():
    """A layer too dense for the sparse path (k_est above MAX_DENSITY f) computes dense FP8 from
    its own rows: the down rows' per-unit scales folded into the up product, h quantised per
    token, the e4m3 down rows. Its kept copies are remade when new weights are loaded."""
    from twell.fp8_nn import Fp8SparseGatedMLP

    x, wg, wu, wd = gate_case(12, 40, 100, torch.float32, seed=6)
    m = Fp8SparseGatedMLP.from_weights(wg, wu, wd)
    m.k_est = float(m.intermediate_size)  # as a layer that measured every unit active
    with torch.no_grad():
        y = m(x)
        assert m.last_path == "dense"
        assert rel_err(y, plain(x, m.weights())) < 1e-5
        _, wg2, wu2, wd2 = gate_case(12, 40, 100, torch.float32, seed=7)
        m.load_state_dict(Fp8SparseGatedMLP.from_weights(wg2, wu2, wd2).state_dict())
        y2 = m(x)
        assert m.last_path == "dense"
        assert rel_err(y2, plain(x, m.weights())) < 1e-5


def test_fp8_module_path_choice(fp8_nn):
    """Decode kernel up to 8 tokens; dense FP8 below PREFILL_MIN_M (EAGER_PREFILL_MIN_M outside a
    capture); from it the prefill path while the measured layer is sparse enough and, below
    HEAVY_PREFILL_MIN_M tokens, few of its rows are computed whole. A layer never measured takes
    the prefill path in an eager call (which measures it on a GPU), dense in a capture."""
    from twell.fp8_nn import Fp8SparseGatedMLP

    _, wg, wu, wd = gate_case(4, 40, 1000, torch.float32, seed=3)
    m = Fp8SparseGatedMLP.from_weights(wg, wu, wd)
    lo, eager, heavy = fp8_nn.PREFILL_MIN_M, fp8_nn.EAGER_PREFILL_MIN_M, fp8_nn.HEAVY_PREFILL_MIN_M
    assert 8 < lo < eager < heavy
    pays = m._prefill_pays
    assert not pays(eager - 1) and pays(eager)  # not measured yet: an eager call measures
    assert not pays(lo, capturing=True) and not pays(heavy, capturing=True)  # a capture would not
    m.k_est, m.whole_rows = 0.5 * fp8_nn.MAX_DENSITY * 1000, 0.0
    assert pays(lo, capturing=True) and not pays(lo - 1, capturing=True)
    assert not pays(lo) and pays(eager) and pays(heavy)
    m.whole_rows = 2 * fp8_nn.MAX_WHOLE_ROWS  # heavy-tailed rows: prefill from HEAVY_PREFILL_MIN_M only
    assert not pays(lo, capturing=True) and not pays(heavy - 1, capturing=True) and pays(heavy, capturing=True)
    assert not pays(eager) and pays(heavy)
    m.k_est, m.whole_rows = 2 * fp8_nn.MAX_DENSITY * 1000, 0.0  # too dense at any size
    assert not pays(heavy) and not pays(10 * heavy, capturing=True)
    x = torch.randn(12, 40)
    with torch.no_grad():
        fp8_nn.PREFILL_MIN_M = fp8_nn.EAGER_PREFILL_MIN_M = 12
        m(x)
        assert m.last_path == "dense"
        m.k_est = None
        m(x)
        assert m.last_path == "prefill"
        m(x[:8])
        assert m.last_path == "decode"


def test_fp8_compiled_op_calls_its_module(fp8_nn):
    """Under torch.compile the op finds its module from the gate rows and takes the module's
    path, also for a deep copy (new storage) and after .to(); rows no module owns take the
    size-only function."""
    import copy

    from twell.fp8_nn import Fp8SparseGatedMLP, module_of_gate

    x, wg, wu, wd = gate_case(12, 40, 100, torch.float32, seed=5)
    m = Fp8SparseGatedMLP.from_weights(wg, wu, wd)
    m2 = copy.deepcopy(m)
    assert module_of_gate(m.gate_q) is m and module_of_gate(m2.gate_q) is m2
    old = m2.gate_q
    m2._apply(lambda t: t.clone())  # new storage, as .to(other device) gives
    assert m2.gate_q.data_ptr() != old.data_ptr() and module_of_gate(m2.gate_q) is m2
    assert module_of_gate(m.gate_q.clone()) is None
    torch._dynamo.reset()
    compiled = torch.compile(m, fullgraph=True, backend="eager")
    with torch.no_grad():
        m.last_path = None
        y = compiled(x)  # 12 tokens: dense FP8, as eager
        assert m.last_path == "dense" and torch.equal(y, m(x))
        fp8_nn.PREFILL_MIN_M = fp8_nn.EAGER_PREFILL_MIN_M = 12
        m.last_path = None
        y = compiled(x)
        assert m.last_path == "prefill" and torch.equal(y, m(x))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fp8_module_measures_its_rows_on_the_gpu():
    """d 2048, f 5632, k 20 in bf16: the first call of 4096 tokens (dense in eager mode) measures
    the layer (waited for); a layer with heavy-tailed rows then computes dense FP8 at 8192 tokens
    and in a CUDA graph of 4096, and the prefill path at HEAVY_PREFILL_MIN_M, one with even rows
    the prefill path at all three; each output within rounding of the math of its path."""
    from twell.bench.inference import errors
    from twell.bench.synthetic import make_ffn
    from twell.fp8_nn import EAGER_PREFILL_MIN_M, HEAVY_PREFILL_MIN_M, MAX_WHOLE_ROWS, PREFILL_MIN_M, Fp8SparseGatedMLP

    assert PREFILL_MIN_M <= 4096 < EAGER_PREFILL_MIN_M <= 8192

    for dist in ("even", "heavy"):
        # k 20: the heavy-tailed rows' sampled mean stays under MAX_DENSITY f (k 29 read 40 here)
        s = make_ffn(HEAVY_PREFILL_MIN_M, 2048, 5632, 20, dist, dtype=torch.bfloat16, device="cuda", seed=8)
        m = Fp8SparseGatedMLP.from_weights(s.w_gate, s.w_up, s.w_down)
        w = m.weights()
        x4, x = s.x[:4096].contiguous(), s.x[:8192]
        heavy = dist == "heavy"
        with torch.no_grad():
            y = m(x4)  # fewer than EAGER_PREFILL_MIN_M tokens: dense, and the first measurement
            assert m.last_path == "dense" and m.k_est is not None and 10 < m.k_est < 30
            assert (m.whole_rows > MAX_WHOLE_ROWS) == heavy
            assert errors(y, plain(x4, w))[0] < 5e-2  # g and u rounded to bf16 before h is quantised
            y = m(x)
            assert m.last_path == ("dense" if heavy else "prefill")
            if not heavy:
                assert errors(y, fp8.twell_fp8_reference(x, w))[1] < 1e-2  # bf16 output rounding
            m(s.x)
            assert m.last_path == "prefill"
            # a CUDA graph of 4096 tokens records the prefill path where the measurement allows
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                y = m(x4)
            assert m.last_path == ("dense" if heavy else "prefill")
            graph.replay()
            torch.cuda.synchronize()
            ref = plain(x4, w) if heavy else fp8.twell_fp8_reference(x4, w)
            assert errors(y, ref)[0] < (5e-2 if heavy else 1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_fp8_module_compiled_on_the_gpu(mode):
    """A compiled Fp8SparseGatedMLP, compiled before any eager call, takes the eager call's path
    at 1, 16 and 16384 tokens and returns its output (reduce-overhead: its warm-up, an eager call,
    measures the layer before the capture)."""
    from twell.bench.synthetic import make_ffn
    from twell.fp8_nn import Fp8SparseGatedMLP

    s = make_ffn(16384, 2048, 5632, 29, "even", dtype=torch.bfloat16, device="cuda", seed=9)
    m = Fp8SparseGatedMLP.from_weights(s.w_gate, s.w_up, s.w_down)
    torch._dynamo.reset()
    compiled = torch.compile(m, fullgraph=True, mode=mode, dynamic=False)
    with torch.no_grad():
        for M, path in ((16384, "prefill"), (16, "dense"), (1, "decode")):
            x = s.x[:M].contiguous()
            for _ in range(3):  # (reduce-overhead: warm-up, capture, replay)
                y = compiled(x).clone()
            assert m.last_path == path
            want = m(x)
            assert m.last_path == path
            torch.testing.assert_close(y, want, rtol=2e-2, atol=2e-2)


def test_fp8_module_weights_follow_its_buffers():
    """The module keeps its Fp8GatedWeights and the dense path's copies between calls: a buffer
    replaced (assigned, or moved by .to()) is what the next call reads, on the decode and the
    dense path, and the custom op still finds the module by its new gate rows."""
    from twell.fp8_nn import Fp8SparseGatedMLP, module_of_gate

    x, wg, wu, wd = gate_case(3, 40, 100, torch.float32, seed=11)
    m = Fp8SparseGatedMLP.from_weights(wg, wu, wd)
    w = m.weights()
    assert m.weights() is w and w.gate.q is m.gate_q and w.down_t.scale is m.down_scale
    other = Fp8SparseGatedMLP.from_weights(*gate_case(3, 40, 100, torch.float32, seed=12)[1:])
    m.up_q = other.up_q.clone()
    assert m.weights().up.q is m.up_q
    with torch.no_grad():  # the decode kernel reads the new up rows
        torch.testing.assert_close(m(x), fp8.twell_fp8_reference(x, m.weights()), rtol=1e-5, atol=1e-5)
    m._apply(lambda t: t.clone())
    assert m.weights().gate.q is m.gate_q and module_of_gate(m.gate_q) is m
    # the dense path's kept copies follow the buffers too
    m.k_est = float(m.intermediate_size)  # as a layer that measured every unit active
    x = torch.randn(12, 40)
    with torch.no_grad():
        m(x)
        assert m.last_path == "dense" and m._down_cm is not None
        m.down_t_q, m.down_scale = other.down_t_q.clone(), other.down_scale.clone()
        m.gate_q = other.gate_q.clone()
        y = m(x)
        assert m.last_path == "dense" and rel_err(y, plain(x, m.weights())) < 1e-5
        assert module_of_gate(m.gate_q) is m


@pytest.mark.parametrize("f", [100, 300])
def test_dense_call_measures_the_rows_prefill_would_compute_whole(f, monkeypatch):
    """The FP8 module's probe of a dense call (on its gate product) counts the rows that the
    prefill path computes whole: an overflowed TwELL tile (as pack_relu packs the gate) or more
    than DENSE_ROW_MIN active units. f 100: one partial tile per row; f 300 with 64-wide tiles:
    whole tiles and a partial one."""
    from twell.fp8_nn import _rows_of_gate
    from twell.inference import ops
    from twell.kernels import pack_relu

    if f == 300:
        monkeypatch.setattr(ops, "default_tile", lambda f: 64)
    g = torch.Generator().manual_seed(f)
    gate = torch.randn(40, f, generator=g) - 2.0
    gate[3] = 1.0  # every unit of row 3 active
    gate[5, :12] = 1.0  # a dozen in row 5's first tile
    per_row, whole = _rows_of_gate(gate, dense_row_min=20)
    t = pack_relu(gate, ops.default_tile(f), ops.DEFAULT_COMPRESSION)
    assert torch.equal(per_row, (gate > 0).sum(dim=1))
    want = (t.counts > t.values.shape[2]).any(dim=1) | (t.counts.sum(dim=1) > 20)
    assert torch.equal(whole, want) and bool(whole[3]) and 0 < int(whole.sum()) < 40


def test_fp8_module_copies_and_pickles_without_its_kept_state():
    """copy.deepcopy and torch.save of a module leave out what a call keeps (a CUDA event in
    flight, which neither can copy, and copies of the buffers); the copy computes as the
    original, and the original keeps its state."""
    import copy
    import io
    import threading

    from twell.fp8_nn import Fp8SparseGatedMLP, module_of_gate

    x, wg, wu, wd = gate_case(3, 40, 100, torch.float32, seed=13)
    m = Fp8SparseGatedMLP.from_weights(wg, wu, wd)
    with torch.no_grad():
        y = m(x)
    lock = threading.Lock()  # (stands for an event: neither deep-copies nor pickles)
    m._event = lock
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    for c in (copy.deepcopy(m), torch.load(buf, weights_only=False)):
        assert c._event is None and c._weights is None and module_of_gate(c.gate_q) is c
        with torch.no_grad():
            assert torch.equal(c(x), y)
    assert m._event is lock and m._weights is not None

"""Decode kernels (small batches) against the PyTorch references: Triton interpreter on the CPU
in fp32/fp16 over odd shapes, adversarial patterns, strided inputs and every block shape in use;
GPU tests in bf16 at real shapes."""

from __future__ import annotations

import pytest
import torch

from kernel_cases import I16, case_id, gate_case, guard_empty, rel_err, untouched
from twell import reference as R
from twell.kernels import decode
from twell.kernels.decode import ffn_decode
from twell.kernels.decode_fused import ffn_decode_fused
from twell.kernels.decode_fused import GemvConfig

TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1e-2}
# M, d, f and a block configuration (BM, BU, BK, warps, BD, BE, warps, shares); None: the default
CASES = [
    (1, 40, 100, None),
    (5, 72, 70, (16, 16, 32, 4, 32, 16, 4, 3)),  # 3 shares of the entries, a partial last one
    (21, 24, 37, (16, 16, 16, 4, 16, 16, 4, 2)),  # two token chunks, f not a multiple of BU
    (40, 40, 100, (32, 32, 32, 4, 16, 32, 4, 4)),
    (70, 24, 37, None),  # more tokens than the largest chunk
]
# Every case in fp32; fp16 (h rounded to it, tf32 dots, partial sums cast back) with one share
# (y written by the down kernel) and with several (by the sum kernel): the chunking and shares of
# the other cases do not depend on the dtype.
DTYPE_CASES = [(torch.float32, *case) for case in CASES] + [(torch.float16, *case) for case in CASES[:2]]


def _reference(x, wg, wu, wd, gated: bool = True):
    """The FFN in float64: gated ``relu(x wg^T) * (x wu^T)``, else ``relu(x wg^T)``, times ``wd^T``."""
    if gated:
        return R.gated_mlp(x.double(), wg.double(), wu.double(), wd.double())
    return R.mlp(x.double(), wg.double(), wd.double())


def _counts(x, w_first):
    active = (x.double() @ w_first.double().T) > 0
    return active.sum(0), active.sum(1)


@pytest.mark.parametrize("dtype,M,d,f,config", DTYPE_CASES, ids=case_id)
@pytest.mark.parametrize("gated", [True, False])
def test_decode_matches_reference(dtype, M, d, f, config, gated):
    x, wg, wu, wd = gate_case(M, d, f, dtype, seed=M + d + f)
    if gated:
        ref = R.gated_mlp(x.double(), wg.double(), wu.double(), wd.double())
        w_first, w_up = wg, wu
    else:
        ref = R.mlp(x.double(), wg.double(), wd.double())
        w_first, w_up = wg, None
    uc = torch.zeros(f, dtype=torch.int32)
    nnz = torch.zeros(M, dtype=torch.int32)
    y = ffn_decode(x, w_first, wd.T.contiguous(), w_up=w_up, unit_counts=uc, row_nnz=nnz, config=config)
    assert y.shape == (M, d) and y.dtype == dtype
    assert rel_err(y, ref) < TOL[dtype]
    units, rows = _counts(x, w_first)
    assert torch.equal(uc.long(), units) and torch.equal(nnz.long(), rows)
    if M > 3:
        assert torch.all(y[1] == 0)  # the all-zero row
        assert rows[2] >= f - 1  # the dense row (all units but the hot one, which it turns off)


def test_every_config_in_use_is_exact():
    """Each tuned block shape (they differ in chunking and in shares) on a case it serves."""
    for top, config in decode.DECODE_CONFIGS.items():
        M = max(1, min(top, 20))
        x, wg, wu, wd = gate_case(M, 48, 90, torch.float32, seed=top)
        small = (min(config[0], 32), 16, 32, 4, 16, 16, 4, config[7])  # interpreter-sized blocks, same shares
        y = ffn_decode(x, wg, wd.T.contiguous(), w_up=wu, config=small)
        assert rel_err(y, R.gated_mlp(x.double(), wg.double(), wu.double(), wd.double())) < 1e-5, top


def test_strided_and_mixed_layout_inputs():
    """Rows with strides larger than d, and different strides for every weight: a kernel that
    used one tensor's stride for another, or the row length for a stride, fails here."""
    M, d, f = 9, 24, 50
    x, wg, wu, wd = gate_case(M, d, f, torch.float32, seed=3)
    xs = torch.full((M, d + 5), float("nan"))[:, 2 : 2 + d]
    xs.copy_(x)
    big = torch.full((3 * f, d + 11), float("nan"))
    wg_s = big[0::3, 1 : 1 + d]
    wu_s = torch.full((f, 2 * d), float("nan"))[:, d:]
    wdt_s = torch.full((f, d + 3), float("nan"))[:, :d]
    wg_s.copy_(wg)
    wu_s.copy_(wu)
    wdt_s.copy_(wd.T)
    assert len({wg_s.stride(0), wu_s.stride(0), wdt_s.stride(0), xs.stride(0), d}) == 5
    out = torch.full((M, d + 7), float("nan"))[:, :d]
    y = ffn_decode(xs, wg_s, wdt_s, w_up=wu_s, out=out, config=(16, 16, 16, 4, 16, 16, 4, 2))
    assert y.data_ptr() == out.data_ptr()
    assert rel_err(y, R.gated_mlp(x.double(), wg.double(), wu.double(), wd.double())) < 1e-5


@pytest.mark.parametrize("M", [0, 1])
def test_empty_and_single_token(M):
    x, wg, wu, wd = gate_case(M, 24, 37, torch.float32, seed=4)
    y = ffn_decode(x, wg, wd.T.contiguous(), w_up=wu)
    assert y.shape == (M, 24)
    if M:
        assert rel_err(y, R.gated_mlp(x.double(), wg.double(), wu.double(), wd.double())) < 1e-5


def test_no_active_unit_gives_zeros():
    x, wg, wu, wd = gate_case(6, 24, 37, torch.float32, seed=5, adversarial=False)
    wg[:, 0] = -100.0  # x[:, 0] = 1: every pre-activation is about -100
    y = ffn_decode(x, wg, wd.T.contiguous(), w_up=wu)
    assert torch.equal(y, torch.zeros_like(y))


def test_validation():
    x, wg, wu, wd = gate_case(5, 24, 37, torch.float32)
    wdt = wd.T.contiguous()
    with pytest.raises(ValueError, match="w_down_t must be"):
        ffn_decode(x, wg, wd, w_up=wu)
    with pytest.raises(ValueError, match="unit-stride"):
        ffn_decode(x, wg, wd.T, w_up=wu)
    with pytest.raises(TypeError, match="must match x"):
        ffn_decode(x.half(), wg.half(), wdt, w_up=wu.half())
    with pytest.raises(ValueError, match="together"):
        ffn_decode(x, wg, wdt, unit_counts=torch.zeros(37, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"row_nnz must be a contiguous \[5\]"):
        ffn_decode(x, wg, wdt, unit_counts=torch.zeros(37, dtype=torch.int32), row_nnz=torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="out must be"):
        ffn_decode(x, wg, wdt, out=torch.empty(5, 23))
    with pytest.raises(TypeError, match="dtype"):
        ffn_decode(x.long(), wg, wdt)
    meta = [t.to("meta") for t in (x, wg, wdt, wu)]  # under the interpreter too: no data to run on
    with pytest.raises(ValueError, match="x is on the meta device"):
        ffn_decode(*meta[:3], w_up=meta[3])
    with pytest.raises(ValueError, match="x is on the meta device"):
        ffn_decode_fused(*meta[:3], w_up=meta[3])


# --- GPU, bf16, real shapes --------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 4, 16, 64, 100])
@pytest.mark.parametrize("k", [29, 280])
def test_decode_gpu_bf16(M, k):
    from twell.bench.inference import dense_gated, errors, reference_fp32
    from twell.bench.synthetic import make_ffn

    s = make_ffn(4096, 2048, 5632, k, "even", dtype=torch.bfloat16, device="cuda", seed=M)
    x = s.x[:M].clone()
    if M > 8:
        x[3] = 0  # an all-zero row
        x[5, 0] = -50.0  # a fully dense row
    ref = reference_fp32(x, s.w_gate, s.w_up, s.w_down)
    _, dense_row = errors(dense_gated(x, s.w_gate, s.w_up, s.w_down), ref)
    y = ffn_decode(x, s.w_gate, s.w_down.T.contiguous(), w_up=s.w_up)
    rel, row = errors(y, ref)
    assert rel < 1e-2 and row <= 2 * dense_row + 1e-6, (rel, row, dense_row)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_decode_gpu_partials_past_int32_offsets():
    """150000 tokens at d 2048 (``kernel_mode="decode"`` takes any M): the eighth share of the
    fp32 partials ``[8, M, d]`` starts past 2^31 elements, where offsets computed in int32
    wrapped (an audit, 2026-12-04). About 10 GB of partials."""
    from twell.bench.inference import dense_gated, errors, reference_fp32

    M, d, f = 150_000, 2048, 256
    assert 7 * M * d >= 2**31 and decode.decode_config(M)[-1] == 8
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, d, device="cuda", generator=g).to(torch.bfloat16)
    w_gate, w_up = (torch.randn(f, d, device="cuda", generator=g).div(d**0.5).to(torch.bfloat16) for _ in range(2))
    w_down = torch.randn(d, f, device="cuda", generator=g).div(f**0.5).to(torch.bfloat16)
    y = ffn_decode(x, w_gate, w_down.T.contiguous(), w_up=w_up)
    ref = reference_fp32(x, w_gate, w_up, w_down)
    _, dense_row = errors(dense_gated(x, w_gate, w_up, w_down), ref)
    rel, row = errors(y, ref)
    assert rel < 1e-2 and row <= 2 * dense_row + 1e-6, (rel, row, dense_row)


# --- the fused decode kernel (twell.kernels.decode_fused) ----------------------------------------

# M, d, f, (BU, BK, BD, warps, stages) or a GemvConfig (the CUDA-core variant); None: the default
# (the CUDA-core variant up to GEMV_MAX_M tokens, the tensor-core one above)
FUSED_CASES = [(1, 40, 100, (16, 16, 16, 4, 1)), (5, 72, 70, (32, 32, 32, 4, 1)), (16, 24, 37, None),
               (3, 48, 64, (16, 16, 32, 2, 1)),
               (1, 40, 100, GemvConfig(4, 16, 4, 1)),  # d in three steps, the last partial
               (3, 72, 70, GemvConfig(8, 128, 2, 1)),  # one step wider than d; M not a power of 2
               (7, 24, 37, GemvConfig(16, 16, 4, 2)),  # 8-row blocks with a masked row
               (1, 40, 100, None), (2, 48, 64, None), (4, 33, 45, None),  # the shipped CUDA-core shapes
               (21, 40, 70, (16, 16, 16, 4, 1)),  # a 32-row tile with masked rows
               (64, 24, 37, None)]  # a full 64-row tile


@pytest.mark.parametrize("M,d,f,config", FUSED_CASES, ids=case_id)
@pytest.mark.parametrize("gated", [True, False])
def test_decode_fused_matches_reference(M, d, f, config, gated):
    """Against the reference, fp32, two different batches in a row; blocks smaller than d and f
    (every loop runs more than once; partial last blocks); the statistics against the pattern."""
    from twell.kernels.decode_fused import ffn_decode_fused

    x, wg, wu, wd = gate_case(M, d, f, torch.float32, seed=M + d + f + 1)
    for call in range(2):
        xi = x if call == 0 else x.flip(0).contiguous()
        uc = torch.full((f,), -7, dtype=torch.int32)  # overwritten
        nnz = torch.zeros(M, dtype=torch.int32)
        if gated:
            y = ffn_decode_fused(xi, wg, wd.T.contiguous(), w_up=wu, unit_counts=uc, row_nnz=nnz, config=config)
            ref = R.gated_mlp(xi.double(), wg.double(), wu.double(), wd.double())
        else:
            y = ffn_decode_fused(xi, wg, wd.T.contiguous(), unit_counts=uc, row_nnz=nnz, config=config)
            ref = R.mlp(xi.double(), wg.double(), wd.double())
        assert y.shape == (M, d) and y.dtype == torch.float32 and rel_err(y, ref) < 1e-5, call
        pattern = (xi @ wg.T) > 0
        assert torch.equal(uc.long(), pattern.sum(0)) and torch.equal(nnz.long(), pattern.sum(1))


@pytest.mark.parametrize("config", [(16, 16, 16, 4, 1), GemvConfig(16, 16, 2, 1), GemvConfig(8, 64, 4, 1)], ids=str)
def test_decode_fused_block_counts_fp16_and_no_active_unit(config):
    from twell.kernels.decode_fused import decode_fused_launch, ffn_decode_fused

    BU = config[0]
    x, wg, wu, wd = gate_case(7, 40, 100, torch.float16, seed=3)
    y, counts, chunk = decode_fused_launch(x, wg, wd.T.contiguous(), wu, config=config)
    ref = R.gated_mlp(x.double(), wg.double(), wu.double(), wd.double())
    assert rel_err(y, ref) < TOL[torch.float16] and chunk == 7
    active = ((x.float() @ wg.float().T) > 0).any(0)
    nb = -(-100 // BU)
    expect = torch.nn.functional.pad(active, (0, nb * BU - 100)).view(nb, BU).sum(1)
    assert torch.equal(counts.long(), expect)
    x, wg, wu, wd = gate_case(7, 40, 100, torch.float16, seed=3, adversarial=False)
    wg[:, 0] = -100.0  # x[:, 0] = 1: every pre-activation is about -100
    assert torch.equal(ffn_decode_fused(x, wg, wd.T.contiguous(), w_up=wu, config=config), torch.zeros(7, 40, dtype=torch.float16))


def test_fused_config_by_tokens():
    """The CUDA-core variant up to GEMV_MAX_M tokens, the tensor-core kernel above it."""
    from twell.kernels.decode_fused import FUSED_MAX_M, GEMV_MAX_M, fused_config

    for M in range(1, FUSED_MAX_M + 1):
        assert isinstance(fused_config(M), GemvConfig) == (M <= GEMV_MAX_M), M


def test_decode_fused_validation():
    from twell.kernels.decode_fused import ffn_decode_fused

    x, wg, wu, wd = gate_case(4, 24, 37, torch.float32, seed=5)
    with pytest.raises(ValueError, match="at most 64"):
        ffn_decode_fused(torch.zeros(65, 24), wg, wd.T.contiguous(), w_up=wu)
    with pytest.raises(ValueError, match="w_down_t must be"):
        ffn_decode_fused(x, wg, wd, w_up=wu)
    with pytest.raises(ValueError, match="both"):
        ffn_decode_fused(x, wg, wd.T.contiguous(), w_up=wu, unit_counts=torch.zeros(37, dtype=torch.int32))
    with pytest.raises(ValueError, match="row_nnz must be"):
        ffn_decode_fused(x, wg, wd.T.contiguous(), w_up=wu, unit_counts=torch.zeros(37, dtype=torch.int32),
                         row_nnz=torch.zeros(5, dtype=torch.int32))
    with pytest.raises(TypeError):
        ffn_decode_fused(x.double(), wg, wd.T.contiguous(), w_up=wu)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("M", [1, 2, 4, 16, 40, 64])
@pytest.mark.parametrize("mode", ["fresh", "scratch"])
@pytest.mark.parametrize("kind", ["dot", "default"])
def test_decode_fused_gpu_bf16(M, mode, kind):
    """bf16 at the real shape, repeated (a wrong ordering of the adds would show as a varying or
    wrong sum), against fp32 and dense's row error; with a scratch, which must be left zeroed."""
    from twell.bench.inference import errors, reference_fp32
    from twell.bench.synthetic import make_ffn
    from twell.kernels.decode_fused import FUSED_CONFIG, DecodeScratch, ffn_decode_fused

    s = make_ffn(64, 2048, 5632, 29, "even", dtype=torch.bfloat16, device="cuda", seed=M)
    x = s.x[:M].contiguous()
    ref = reference_fp32(x, s.w_gate, s.w_up, s.w_down)
    dense = (torch.relu(x @ s.w_gate.T) * (x @ s.w_up.T)) @ s.w_down.T
    _, dense_row = errors(dense, ref)
    wdt = s.w_down.T.contiguous()
    scratch = DecodeScratch(2048, "cuda") if mode == "scratch" else None
    for _ in range(5):
        y = ffn_decode_fused(x, s.w_gate, wdt, w_up=s.w_up, config=FUSED_CONFIG if kind == "dot" else None, scratch=scratch)
        rel, row = errors(y, ref)
        assert rel < 1e-2 and row <= 2 * dense_row, (rel, row, dense_row)
    if scratch is not None:
        assert torch.all(scratch.acc == 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("M", [3, 7, 40, 64])
def test_decode_fused_gpu_other_dtypes_and_tiles(dtype, M):
    """fp16 and fp32 on both kernels and on 64-row tiles (fp32 there needs its smaller pipeline
    to fit shared memory), gated and non-gated, statistics against the pattern, with the kept
    accumulator and with programmatic dependent launch off: every result the same."""
    from twell.kernels.decode_fused import DecodeScratch, ffn_decode_fused

    x, wg, wu, wd = _gpu_bias_case(M, dtype, -1.28)  # about 10% of the units fire per token
    scratch = DecodeScratch(x.shape[1], "cuda")
    tol = 1e-2 if dtype == torch.float16 else 1e-4
    _check_gpu_variants(lambda *a, **kw: ffn_decode_fused(*a, scratch=scratch, **kw), x, wg, wu, wd, tol,
                        lambda: bool(torch.all(scratch.acc == 0)))


def _gpu_bias_case(M: int, dtype, bias: float):
    """``x [M, 512]``, ``w_gate``, ``w_up [1408, 512]``, ``w_down [512, 1408]`` on the GPU with a
    bias input: x[:, 0] = 1 and w_gate[:, 0] = ``bias`` set how many units fire per token."""
    torch.manual_seed(M)
    d, f = 512, 1408
    x = torch.randn(M, d, device="cuda", dtype=dtype)
    wg = torch.randn(f, d, device="cuda", dtype=dtype) / d**0.5
    x[:, 0], wg[:, 0] = 1.0, bias
    wu = torch.randn(f, d, device="cuda", dtype=dtype) / d**0.5
    wd = torch.randn(d, f, device="cuda", dtype=dtype) / f**0.5
    return x, wg, wu, wd


def _check_gpu_variants(call, x, wg, wu, wd, tol, scratch_clean) -> None:
    """``call(x, w_first, w_down_t, unit_counts=, row_nnz=[, w_up=])`` gated and non-gated, with
    programmatic dependent launch on and off: against the reference, the statistics against the
    pattern, ``scratch_clean()`` after each call, and both launch modes agreeing."""
    from twell.kernels import _launch

    M, f = x.shape[0], wg.shape[0]
    pattern = (x.double() @ wg.double().T) > 0
    for gated in (True, False):
        kw = dict(w_up=wu) if gated else {}
        ref = _reference(x, wg, wu, wd, gated)
        outs = []
        for pdl in (True, False):
            _launch.USE_PDL = pdl
            try:
                uc = torch.full((f,), -7, dtype=torch.int32, device="cuda")
                nnz = torch.zeros(M, dtype=torch.int32, device="cuda")
                y = call(x, wg, wd.T.contiguous(), unit_counts=uc, row_nnz=nnz, **kw)
                torch.cuda.synchronize()
            finally:
                _launch.USE_PDL = True
            assert y.dtype == x.dtype and rel_err(y, ref) < tol, (gated, pdl, rel_err(y, ref))
            # a pre-activation within fp32 rounding of zero may take either sign
            assert (uc.long() - pattern.sum(0)).abs().sum() <= 2 and (nnz.long() - pattern.sum(1)).abs().sum() <= 2
            assert scratch_clean()
            outs.append(y)
        assert rel_err(outs[0], outs[1].double()) < tol


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("config", [(16, 16, 16, 4, 1), GemvConfig(4, 16, 2, 1)], ids=str)
def test_decode_fused_scratch_is_left_zeroed_and_reused(gated, config):
    """With a DecodeScratch: two launches per call, the same results as without, and the
    scratch all zeros after each call (calls of different batches on one scratch; 20 tokens,
    more than its 16 rows, take a fresh buffer and must leave it untouched; a 64-row scratch,
    as the dispatcher keeps beside the split kernels, serves them)."""
    from twell.kernels.decode_fused import DecodeScratch, ffn_decode_fused

    x, wg, wu, wd = gate_case(9, 40, 100, torch.float32, seed=11)
    x20 = torch.cat([x, x.flip(0), x[:2]])  # 20 tokens: more than the scratch's 16 rows
    batches = (x, x[:3].flip(0).contiguous(), x20, x[1:2].contiguous())
    if isinstance(config, GemvConfig):  # the CUDA-core variant serves a few tokens
        batches = (x[:3], x[4:5], x[:5].flip(0).contiguous())
    for rows in (16, 64):
        scratch = DecodeScratch(40, "cpu", rows=rows)
        scratch.acc[20:].fill_(float("nan"))  # rows past the calls' tokens are never touched
        for call, xi in enumerate(batches):
            xi = xi.contiguous()
            kw = dict(w_up=wu) if gated else {}
            y = ffn_decode_fused(xi, wg, wd.T.contiguous(), scratch=scratch, config=config, **kw)
            ref = ffn_decode_fused(xi, wg, wd.T.contiguous(), config=config, **kw)
            assert y.shape == xi.shape and rel_err(y, ref) < 1e-6, (rows, call)
            assert torch.all(scratch.acc[:20] == 0) and torch.all(scratch.acc[20:].isnan()), (rows, call)
    with pytest.raises(ValueError, match="scratch must be"):
        ffn_decode_fused(x, wg, wd.T.contiguous(), w_up=wu, scratch=DecodeScratch(32, "cpu"))
    with pytest.raises(ValueError, match="scratch must be"):
        ffn_decode_fused(x, wg, wd.T.contiguous(), w_up=wu, scratch=DecodeScratch(40, "cpu", rows=8))


# --- the split decode kernels (twell.kernels.decode_split) ---------------------------------------

# M, d, f, SplitConfig (BU, BK, warps, stages, P, BD, up/down warps), list capacity: blocks
# smaller than d and f (every loop runs more than once, partial last blocks; BD < d: the up/down
# walks d in steps); fewer programs than fires (each walks several); one program; more programs
# than fires; 32- and 64-token tiles; lists too short for the batch's fires (the gate does the
# rest itself), down to one entry, and one entry short (capacity -1: the fires less one); the
# default shapes on 16-token tiles (pointer loads) and on a 64-token tile (descriptor loads,
# SPLIT_DESC_CONFIG)
SPLIT_CASES = [(1, 40, 100, (16, 16, 4, 1, 3, 16, 4), 8192), (7, 72, 70, (32, 32, 4, 1, 5, 32, 2), 8192),
               (16, 24, 37, (16, 16, 4, 1, 1, 16, 4), 8192), (5, 33, 45, (16, 64, 4, 1, 200, 64, 4), 8192),
               (16, 40, 100, None, 8192), (40, 24, 37, (16, 16, 4, 1, 7, 32, 4), 8192), (64, 33, 50, (16, 16, 4, 1, 9, 64, 4), 8192),
               (7, 72, 70, (32, 32, 4, 1, 5, 32, 2), 37), (64, 33, 50, (16, 16, 4, 1, 9, 16, 4), 100), (3, 40, 100, None, 1),
               (16, 24, 37, (16, 16, 4, 1, 5, 16, 4), -1), (50, 40, 100, None, 8192)]


@pytest.mark.parametrize("M,d,f,config,capacity", SPLIT_CASES, ids=case_id)
@pytest.mark.parametrize("gated", [True, False])
def test_decode_split_matches_reference(M, d, f, config, capacity, gated):
    """Against the reference, fp32, three different batches in a row on one scratch (the list
    and the accumulator must be emptied by each call), list slots pre-filled with entries that
    point at real units and NaN gate values (a slot a call did not fill must never be read); the
    statistics, the block counts and the number of fires against the pattern. The list sits in
    larger buffers whose tails must stay untouched (no write past its capacity)."""
    from twell.kernels import decode_split as S
    from twell.kernels.decode_split import SplitConfig, SplitScratch, decode_split_launch

    cfg = SplitConfig(*config) if config else None
    x, wg, wu, wd = gate_case(M, d, f, torch.float32, seed=M + d + f + 2)
    if capacity < 0:  # the three batches below have the same number of fires
        capacity += int(((x @ wg.T) > 0).sum())
    scratch = SplitScratch(d, f, torch.float32, "cpu", capacity=capacity)
    entries = torch.full((capacity + 8,), -5, dtype=torch.int32)
    gates = torch.full((capacity + 8,), 7.0)
    scratch.entries, scratch.gates = entries[:capacity], gates[:capacity]
    scratch.gates.fill_(float("nan"))
    scratch.entries.copy_(torch.arange(capacity, dtype=torch.int32) % (f * 64))
    for call in range(3):
        xi = (x, x.flip(0), x * 0.5)[call].contiguous()
        uc = torch.full((f,), -7, dtype=torch.int32)  # overwritten
        nnz = torch.zeros(M, dtype=torch.int32)
        y, counts, chunk = decode_split_launch(xi, wg, wd.T.contiguous(), wu if gated else None, uc, nnz, scratch=scratch,
                                               config=cfg)
        if gated:
            ref = R.gated_mlp(xi.double(), wg.double(), wu.double(), wd.double())
        else:
            ref = R.mlp(xi.double(), wg.double(), wd.double())
        assert y.shape == (M, d) and y.dtype == torch.float32 and rel_err(y, ref) < 1e-5, call
        pattern = (xi @ wg.T) > 0
        assert torch.equal(uc.long(), pattern.sum(0)) and torch.equal(nnz.long(), pattern.sum(1))
        # the default shape: by descriptors on a 64-token tile (SPLIT_DESC_CONFIG), else SPLIT_CONFIG
        BU = (cfg or (S.SPLIT_DESC_CONFIG if M > 32 else S.SPLIT_CONFIG)).BU
        nb = -(-f // BU)
        expect = torch.nn.functional.pad(pattern.any(0), (0, nb * BU - f)).view(nb, BU).sum(1)
        assert chunk == M and torch.equal(counts.long(), expect)
        assert torch.all(scratch.acc == 0) and int(scratch.count[0]) == 0, call
        assert int(scratch.fires()) == int(pattern.sum()), call
        assert torch.all(entries[capacity:] == -5) and torch.all(gates[capacity:] == 7.0), call


@pytest.mark.parametrize("M,d,f,config", [(16, 40, 100, (16, 16, 4, 1, 3, 16, 4)), (40, 24, 37, (16, 16, 4, 2, 7, 32, 4)),
                                           (5, 72, 70, (32, 32, 4, 1, 5, 32, 2))], ids=case_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_split_gate_loads_descriptors_or_pointers(M, d, f, config, dtype, monkeypatch):
    """The gate reads x and w_first through tensor descriptors where their rows allow it (from
    GATE_DESC_MIN_ROWS tokens), through pointers otherwise: both give the reference's y and the
    same pattern; descriptors are made only on the descriptor path, never for a misaligned x."""
    from triton.tools import tensor_descriptor

    from twell.kernels import decode_split
    from twell.kernels.decode_split import SplitConfig, SplitScratch, decode_split_launch

    made = []
    real = tensor_descriptor.TensorDescriptor.from_tensor
    monkeypatch.setattr(tensor_descriptor.TensorDescriptor, "from_tensor",
                        staticmethod(lambda t, block: made.append(tuple(block)) or real(t, block)))
    x, wg, wu, wd = gate_case(M, d, f, dtype, seed=M + d)
    ref = R.gated_mlp(x.double(), wg.double(), wu.double(), wd.double())
    pattern = (x.float() @ wg.float().T) > 0
    tol = 1e-5 if dtype == torch.float32 else 3e-3
    rows = max(16, 1 << (M - 1).bit_length())
    for min_rows, want in ((1, [(rows, config[1]), (config[0], config[1])]), (rows + 1, [])):
        monkeypatch.setattr(decode_split, "GATE_DESC_MIN_ROWS", min_rows)
        made.clear()
        scratch = SplitScratch(d, f, dtype, "cpu")
        uc, nnz = torch.zeros(f, dtype=torch.int32), torch.zeros(M, dtype=torch.int32)
        y = decode_split_launch(x, wg, wd.T.contiguous(), wu, uc, nnz, scratch=scratch, config=SplitConfig(*config))[0]
        assert made == want
        assert rel_err(y, ref) < tol and torch.equal(nnz.long(), pattern.sum(1)) and torch.equal(uc.long(), pattern.sum(0))
    # a row stride that descriptors cannot take (not a multiple of 16 bytes): pointer loads
    monkeypatch.setattr(decode_split, "GATE_DESC_MIN_ROWS", 1)
    made.clear()
    wide = torch.zeros(M, d + 1, dtype=dtype)
    wide[:, :d] = x
    y = decode_split_launch(wide[:, :d], wg, wd.T.contiguous(), wu, None, None, scratch=SplitScratch(d, f, dtype, "cpu"),
                            config=SplitConfig(*config))[0]
    assert made == [] and rel_err(y, ref) < tol


@pytest.mark.parametrize("capacity", [8192, 3])
@pytest.mark.parametrize("BD", [16, 32], ids=["steps", "one_step"])  # d 24: the last step partial
@pytest.mark.parametrize("gated", [True, False])
def test_decode_split_nan_gate_fires_listed_or_past_the_list(capacity, BD, gated):
    """A NaN gate fires (relu keeps it): a token whose input has a NaN gets a NaN row, through
    the list or, past its capacity, through the gate program's own exact path, gated and
    non-gated, with the up/down walking d in steps (BD < d) or in one; the other tokens get the
    reference's rows (none of the NaN spilling into the next token's row), the counts count the
    NaN token's units, and the list is left empty.

    From the mutation round: kills S3 (_add_fire_in_steps adding with ``mask=cols <= d``: column
    d of the NaN row is column 0 of the next row, and 0 * NaN is NaN) and, at the kernel level,
    S13 (the listed gate stored as ``tl.maximum(a, 0.0)``, which drops NaN: non-gated, nothing
    else makes the row NaN)."""
    from twell.kernels.decode_split import SplitConfig, SplitScratch, decode_split_launch

    M, d, f = 6, 24, 37
    x, wg, wu, wd = gate_case(M, d, f, torch.float32, seed=11)
    x[2, 5] = float("nan")
    uc, nnz = torch.zeros(f, dtype=torch.int32), torch.zeros(M, dtype=torch.int32)
    scratch = SplitScratch(d, f, torch.float32, "cpu", capacity=capacity)
    y = decode_split_launch(x, wg, wd.T.contiguous(), wu if gated else None, uc, nnz, scratch=scratch,
                            config=SplitConfig(16, 16, 4, 1, 3, BD, 4))[0]
    rest = torch.arange(M) != 2
    assert torch.isnan(y[2]).all() and rel_err(y[rest], _reference(x[rest], wg, wu, wd, gated)) < 1e-5
    fired = ~((x @ wg.T) <= 0)
    assert int(nnz[2]) == f and torch.equal(nnz.long(), fired.sum(1)) and torch.equal(uc.long(), fired.sum(0))
    assert int(scratch.fires()) == int(fired.sum()) and (capacity > int(fired.sum())) == (capacity == 8192)
    assert torch.all(scratch.acc == 0) and int(scratch.count[0]) == 0


def test_decode_split_fp16_no_active_unit_and_a_failed_call():
    """fp16 against the reference; a batch with no active unit gives exact zeros; a call that
    fails after the gate launch, or after the up/down launch has added into the accumulator,
    leaves the scratch zeroed and empty for the next one, also when the scratch was made under
    torch.inference_mode (a serving loop's first call) and the failing call runs outside it."""
    from twell.kernels import decode_split
    from twell.kernels.decode_split import SplitConfig, SplitScratch, ffn_decode_split

    cfg = SplitConfig(16, 16, 4, 1, 4, 16, 4)
    x, wg, wu, wd = gate_case(7, 40, 100, torch.float16, seed=3)
    with torch.inference_mode():
        scratch = SplitScratch(40, 100, torch.float16, "cpu")
    y = ffn_decode_split(x, wg, wd.T.contiguous(), w_up=wu, scratch=scratch, config=cfg)
    assert rel_err(y, R.gated_mlp(x.double(), wg.double(), wu.double(), wd.double())) < TOL[torch.float16]
    x0, wg0, wu0, wd0 = gate_case(7, 40, 100, torch.float16, seed=3, adversarial=False)
    wg0[:, 0] = -100.0  # x[:, 0] = 1: every pre-activation is about -100
    assert torch.equal(ffn_decode_split(x0, wg0, wd0.T.contiguous(), w_up=wu0, scratch=scratch, config=cfg),
                       torch.zeros(7, 40, dtype=torch.float16))

    class Broken:  # a kernel (kernel[grid](...)) or a launcher (launch(...)) that fails
        def __getitem__(self, grid):
            return self

        def __call__(self, *args, **kwargs):
            raise RuntimeError("launch failed")

    for name in ("_fire_updown_kernel", "launch_write_out"):  # the list, then also the sums, left behind
        real = getattr(decode_split, name)
        setattr(decode_split, name, Broken())
        try:
            with torch.no_grad(), pytest.raises(RuntimeError, match="launch failed"):
                ffn_decode_split(x, wg, wd.T.contiguous(), w_up=wu, scratch=scratch, config=cfg)
        finally:
            setattr(decode_split, name, real)
        assert torch.all(scratch.acc == 0) and torch.all(scratch.count == 0), name  # fires() reads 0
        assert torch.equal(ffn_decode_split(x, wg, wd.T.contiguous(), w_up=wu, scratch=scratch, config=cfg), y), name


@pytest.mark.parametrize("M,gated,capacity", [(5, True, 8192), (37, False, 8192), (64, True, 8192), (37, True, 9)])
def test_decode_split_with_buffers_of_one_call(M, gated, capacity, monkeypatch):
    """SplitScratch.for_one_call (twell.inference.dispatch.DECODE_SCRATCH off): an accumulator of exactly
    M rows and the list's length zeroed in one allocation, the list itself left as the allocator
    gave it (here: entries that point at real units, NaN gate values, which must never be read;
    every torch.empty NaN- or I16-filled with guard rows after it, y's included); the dense
    answer and the number of fires (with a list of 9 entries, most fires past it: the gate's own
    exact path adds them into the M-row accumulator); the launcher's check takes it for at most
    M tokens."""
    from twell.kernels.decode_split import SplitScratch, decode_split_launch, ffn_decode_split

    d, f = 24, 37
    x, wg, wu, wd = gate_case(M, d, f, torch.float32, seed=M + 11)
    handed = guard_empty(monkeypatch)
    sc = SplitScratch.for_one_call(M, d, f, torch.float32, "cpu", capacity=capacity)
    assert sc.acc.shape == (M, d) and sc.count.dtype == torch.int32 and torch.all(sc.count == 0)
    sc.entries.copy_(torch.arange(sc.capacity, dtype=torch.int32) % (f * 64))
    sc.gates.fill_(float("nan"))
    y = decode_split_launch(x, wg, wd.T.contiguous(), wu if gated else None, None, None, scratch=sc)[0]
    ref = R.gated_mlp(x.double(), wg.double(), wu.double(), wd.double()) if gated else R.mlp(x.double(), wg.double(), wd.double())
    assert rel_err(y, ref) < 1e-5
    assert int(sc.fires()) == int(((x @ wg.T) > 0).sum())
    small = SplitScratch.for_one_call(M - 1, d, f, torch.float32, "cpu")
    with pytest.raises(ValueError, match="scratch must be"):
        ffn_decode_split(x, wg, wd.T.contiguous(), w_up=wu, scratch=small)
    assert rel_err(ffn_decode_split(x[:M - 1], wg, wd.T.contiguous(), w_up=wu, scratch=small),
                   R.gated_mlp(x[:M - 1].double(), wg.double(), wu.double(), wd.double())) < 1e-5
    with pytest.raises(ValueError, match="capacity"):
        SplitScratch.for_one_call(M, d, f, torch.float32, "cpu", capacity=0)
    assert handed and all(bool(untouched(g).all()) for h in handed for g in h.guards)


def test_decode_split_validation():
    from twell.kernels.decode_split import SplitScratch, decode_split_launch, ffn_decode_split

    x, wg, wu, wd = gate_case(4, 24, 37, torch.float32, seed=5)
    sc = SplitScratch(24, 37, torch.float32, "cpu")
    with pytest.raises(ValueError, match="at most 64"):
        ffn_decode_split(torch.zeros(65, 24), wg, wd.T.contiguous(), w_up=wu, scratch=sc)
    with pytest.raises(ValueError, match="at most 64"):  # also the unchecked launcher
        decode_split_launch(torch.zeros(65, 24), wg, wd.T.contiguous(), wu, None, None, scratch=sc)
    with pytest.raises(ValueError, match="acc must be"):
        SplitScratch(24, 37, torch.float32, "cpu", acc=torch.zeros(16, 24))
    with pytest.raises(ValueError, match="capacity"):
        SplitScratch(24, 37, torch.float32, "cpu", capacity=0)
    with pytest.raises(ValueError, match="w_down_t must be"):
        ffn_decode_split(x, wg, wd, w_up=wu, scratch=sc)
    with pytest.raises(ValueError, match="both"):
        ffn_decode_split(x, wg, wd.T.contiguous(), w_up=wu, scratch=sc, unit_counts=torch.zeros(37, dtype=torch.int32))
    for bad in (SplitScratch(24, 36, torch.float32, "cpu"), SplitScratch(24, 37, torch.float16, "cpu"), None):
        with pytest.raises(ValueError, match="scratch must be"):
            ffn_decode_split(x, wg, wd.T.contiguous(), w_up=wu, scratch=bad)
    with pytest.raises(TypeError):
        ffn_decode_split(x.double(), wg, wd.T.contiguous(), w_up=wu, scratch=sc)


# --- host-side choices of the decode launchers (mutants that survived the tests above: each test
# below fails on a single-line change of decode_split.py / decode_fused.py) ---


def test_gate_loads_from_the_descriptor_tile():
    """Descriptors (and SPLIT_DESC_CONFIG) from a token tile of GATE_DESC_MIN_ROWS, pointers (and
    SPLIT_CONFIG) below it or for a row stride descriptors cannot take."""
    from twell.kernels.decode_split import GATE_DESC_MIN_ROWS, SPLIT_CONFIG, SPLIT_DESC_CONFIG, gate_loads

    w = torch.zeros(100, 40)
    assert gate_loads(torch.zeros(GATE_DESC_MIN_ROWS, 40), w) == (True, SPLIT_DESC_CONFIG)
    assert gate_loads(torch.zeros(GATE_DESC_MIN_ROWS // 2 + 1, 40), w) == (True, SPLIT_DESC_CONFIG)  # same tile
    assert gate_loads(torch.zeros(GATE_DESC_MIN_ROWS // 2, 40), w) == (False, SPLIT_CONFIG)
    assert gate_loads(torch.zeros(GATE_DESC_MIN_ROWS, 41)[:, :40], w) == (False, SPLIT_CONFIG)


def test_split_gate_stages_never_below_one(monkeypatch):
    """A GPU whose shared memory holds no whole stage still gets one (the compiler decides)."""
    from types import SimpleNamespace

    from twell.kernels import decode_split as S

    monkeypatch.setattr(S, "_shared_memory", lambda idx: 48 * 1024)
    fake = SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0), dtype=torch.float32, element_size=lambda: 4)
    assert S._gate_stages(fake, 64, S.SPLIT_CONFIG, 128) == 1  # 64 KB a stage


def test_split_scratch_on_another_device_is_refused():
    from twell.kernels.decode_split import SplitScratch, ffn_decode_split

    x, wg, wu, wd = gate_case(4, 24, 37, torch.float32, seed=5)
    with pytest.raises(ValueError, match="scratch must be"):
        ffn_decode_split(x, wg, wd.T.contiguous(), w_up=wu, scratch=SplitScratch(24, 37, torch.float32, "meta"))


def test_fused_config_takes_the_smallest_fitting_gemv_shape():
    from twell.kernels.decode_fused import GEMV_CONFIGS, GEMV_MAX_M, fused_config

    for M in range(1, GEMV_MAX_M + 1):
        assert fused_config(M) == GEMV_CONFIGS[min(k for k in GEMV_CONFIGS if k >= M)], M
    assert fused_config(1) != fused_config(GEMV_MAX_M)


def test_decode_fused_scratch_serves_its_full_rows_and_a_failed_call(monkeypatch):
    """A DecodeScratch serves calls of as many tokens as its rows (two launches, the write-out
    zeroing it); a call that fails after the kernel added into it leaves it zeroed, also when it
    was made under torch.inference_mode and the failing call runs outside it."""
    from twell.kernels import decode_fused
    from twell.kernels.decode_fused import SCRATCH_ROWS, DecodeScratch, ffn_decode_fused

    cfg = (16, 16, 16, 4, 1)
    x, wg, wu, wd = gate_case(SCRATCH_ROWS, 40, 100, torch.float32, seed=12)
    wdt = wd.T.contiguous()
    with torch.inference_mode():
        scratch = DecodeScratch(40, "cpu")
    assert scratch.acc.shape[0] == SCRATCH_ROWS
    real, used = decode_fused.launch_write_out, []
    monkeypatch.setattr(decode_fused, "launch_write_out", lambda acc, M, *a, **k: used.append(acc is scratch.acc) or real(acc, M, *a, **k))
    y = ffn_decode_fused(x, wg, wdt, w_up=wu, scratch=scratch, config=cfg)
    assert used == [True] and torch.all(scratch.acc == 0)
    assert rel_err(y, R.gated_mlp(x.double(), wg.double(), wu.double(), wd.double())) < 1e-5

    def broken(*a, **k):
        raise RuntimeError("launch failed")

    monkeypatch.setattr(decode_fused, "launch_write_out", broken)
    with torch.no_grad(), pytest.raises(RuntimeError, match="launch failed"):
        ffn_decode_fused(x, wg, wdt, w_up=wu, scratch=scratch, config=cfg)
    assert torch.all(scratch.acc == 0)
    monkeypatch.setattr(decode_fused, "launch_write_out", real)
    assert torch.equal(ffn_decode_fused(x, wg, wdt, w_up=wu, scratch=scratch, config=cfg), y)



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("M,capacity", [(1, 8192), (2, 8192), (8, 8192), (16, 8192), (33, 8192), (64, 8192), (64, 700)])
@pytest.mark.parametrize("k", [8, 29, 56])
def test_decode_split_gpu_bf16(M, capacity, k):
    """bf16 at the real shape, five calls in a row on one scratch and a CUDA graph replay,
    against fp32 and dense's row error (a wrong ordering of the list or the adds would show as
    a varying or wrong sum); a list too short for 64 tokens' fires at k 29 and 56 (the gate's own
    path; at k 8 their 512 fires fit); the
    scratch left zeroed and empty, its number of fires the pattern's."""
    from twell.bench.inference import errors, reference_fp32
    from twell.bench.synthetic import make_ffn
    from twell.bench.timing import capture
    from twell.kernels.decode_split import SplitScratch, ffn_decode_split

    s = make_ffn(64, 2048, 5632, k, "even", dtype=torch.bfloat16, device="cuda", seed=M + k)
    x = s.x[:M].contiguous()
    wdt = s.w_down.T.contiguous()
    ref = reference_fp32(x, s.w_gate, s.w_up, s.w_down)
    dense = (torch.relu(x @ s.w_gate.T) * (x @ s.w_up.T)) @ s.w_down.T
    _, dense_row = errors(dense, ref)
    scratch = SplitScratch(2048, 5632, torch.bfloat16, "cuda", capacity=capacity)
    for _ in range(5):
        y = ffn_decode_split(x, s.w_gate, wdt, w_up=s.w_up, scratch=scratch)
        rel, row = errors(y, ref)
        assert rel < 1e-2 and row <= 2 * dense_row + 1e-6, (rel, row, dense_row)
    torch.cuda.synchronize()
    fires = int(((x @ s.w_gate.T) > 0).sum())
    assert torch.all(scratch.acc == 0) and int(scratch.count[0]) == 0 and int(scratch.fires()) == fires
    assert capacity > fires or fires > capacity + 100  # the short list does overflow
    out = {}
    graph = capture(lambda: out.__setitem__("y", ffn_decode_split(x, s.w_gate, wdt, w_up=s.w_up, scratch=scratch)), warmup=1)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        rel, row = errors(out["y"], ref)
        assert rel < 1e-2 and row <= 2 * dense_row + 1e-6, (rel, row, dense_row)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("M", [6, 40])
def test_decode_split_gpu_dtypes_gated_and_statistics(dtype, M):
    """Each dtype (fp32 on its smaller pipeline), gated and non-gated, with the statistics
    against the pattern, programmatic dependent launch on and off: every result the same, the
    scratch left zeroed and empty."""
    from twell.kernels.decode_split import SplitScratch, ffn_decode_split

    x, wg, wu, wd = _gpu_bias_case(M, dtype, -2.3)  # about 1% of the units fire per token
    scratch = SplitScratch(x.shape[1], wg.shape[0], dtype, "cuda")
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    _check_gpu_variants(lambda *a, **kw: ffn_decode_split(*a, scratch=scratch, **kw), x, wg, wu, wd, tol,
                        lambda: bool(torch.all(scratch.acc == 0)) and int(scratch.count[0]) == 0)


def _rounding_case(d: int):
    """fp16, one token, whose exact output depends on every rounding the dense path does (written
    after a mutation run: dropping any of them passed every other test,
    which run in fp32 or compare within a tolerance that a missing rounding improves on).

    - Units 0 and 1 (gate 3): up = 1 + 3 * 2^-13, which fp16 rounds to 1, and up = -1; both add
      into column 0, so y[0] is 0 only if up is rounded before h = gate * up.
    - Units 2 and 3 (gate 5): up = 1 + 2^-10 and -1; h = 5 + 5 * 2^-10 rounds to 5 + 2^-8 in fp16,
      so y[1] is 2^-8 only if h is rounded before the down product.
    - Unit 4: its gate is 2^-26, positive in fp32 but 0 in fp16: it must not fire.
    Every other unit's gate is -1."""
    f = 16
    x = torch.zeros(1, d)
    wg, wu, wdt = torch.zeros(f, d), torch.zeros(f, d), torch.zeros(f, d)
    x[0, :4] = torch.tensor([1.0, 3 * 2**-13, 2**-10, 2**-13])
    wg[:, 0] = -1.0
    wg[0, 0], wu[0, 0], wu[0, 1], wdt[0, 0] = 3.0, 1.0, 1.0, 1.0
    wg[1, 0], wu[1, 0], wdt[1, 0] = 3.0, -1.0, 1.0
    wg[2, 0], wu[2, 0], wu[2, 2], wdt[2, 1] = 5.0, 1.0, 1.0, 1.0
    wg[3, 0], wu[3, 0], wdt[3, 1] = 5.0, -1.0, 1.0
    wg[4, 0], wg[4, 3], wu[4, 0], wdt[4, 2] = 0.0, 2**-13, 1.0, 1.0
    half = lambda t: t.to(torch.float16)  # noqa: E731
    expect = torch.zeros(1, d, dtype=torch.float16)
    expect[0, 1] = 2**-8
    return half(x), half(wg), half(wu), half(wdt), expect, torch.tensor([1, 1, 1, 1] + [0] * (f - 4), dtype=torch.int32)


@pytest.mark.parametrize("path", ["split_one_step", "split_steps", "split_past_capacity", "split_desc", "fused_dot", "fused_gemv"])
def test_decode_kernels_round_as_the_dense_path(path, monkeypatch):
    from twell.kernels import decode_split
    from twell.kernels.decode_fused import decode_fused_launch
    from twell.kernels.decode_split import SplitConfig, SplitScratch, decode_split_launch

    if path == "split_desc":  # the gate's tensor-descriptor loads must round as the pointer loads do
        monkeypatch.setattr(decode_split, "GATE_DESC_MIN_ROWS", 1)

    d = 16
    x, wg, wu, wdt, expect, expect_counts = _rounding_case(d)
    uc = torch.full((16,), -7, dtype=torch.int32)
    nnz = torch.zeros(1, dtype=torch.int32)
    if path.startswith("split"):
        capacity = 1 if path == "split_past_capacity" else 64
        BD = 64 if path == "split_one_step" else 8  # one step of d, or steps of 8 columns
        scratch = SplitScratch(d, 16, torch.float16, "cpu", capacity=capacity)
        y = decode_split_launch(x, wg, wdt, wu, uc, nnz, scratch=scratch, config=SplitConfig(16, 16, 4, 1, 3, BD, 4))[0]
    elif path == "fused_dot":
        y = decode_fused_launch(x, wg, wdt, wu, uc, nnz, config=(16, 16, 16, 4, 1))[0]
    else:
        y = decode_fused_launch(x, wg, wdt, wu, uc, nnz, config=GemvConfig(4, 16, 2, 1))[0]
    assert torch.equal(y, expect), y[0, :3].tolist()
    assert torch.equal(uc, expect_counts) and int(nnz[0]) == 4, (uc.tolist(), nnz.tolist())


@pytest.mark.skipif(torch.cuda.is_available(), reason="the Triton interpreter's tl.dot (CPU)")
@pytest.mark.parametrize("path", ["three-launch", "fused-dot", "split", "split-desc", "gate-pack-fused", "rows"])
def test_bf16_dots_under_the_interpreter(path, monkeypatch):
    """The interpreter's tl.dot reads bf16 operands as their raw bits (Triton 3.9): the decode
    kernels and the rows kernel returned values off by 1e10 in bf16 on the CPU (a module with
    kernel_mode forced: no error, garbage). Every kernel's dot operands go to it in fp32 there
    (twell.kernels._dot); the products of bf16 values are exact in fp32. The fused gate-pack
    is checked with them."""
    from twell.kernels import decode_split, gate_pack_fused, pack_relu, ffn_from_twell
    from twell.kernels.decode_split import SplitScratch, ffn_decode_split

    dt = torch.bfloat16
    M, d, f = 6, 40, 100
    x, wg, wu, wd = gate_case(M, d, f, dt, seed=11)
    ref = R.gated_mlp(x.float(), wg.float(), wu.float(), wd.float())
    wdt = wd.T.contiguous()
    if path == "three-launch":
        y = ffn_decode(x, wg, wdt, w_up=wu)
    elif path == "fused-dot":
        y = ffn_decode_fused(x, wg, wdt, w_up=wu, config=(16, 16, 16, 4, 1))
    elif path.startswith("split"):
        if path == "split-desc":
            monkeypatch.setattr(decode_split, "GATE_DESC_MIN_ROWS", 1)
        y = ffn_decode_split(x, wg, wdt, w_up=wu, scratch=SplitScratch(d, f, dt, "cpu"))
    elif path == "gate-pack-fused":
        g = gate_pack_fused(x, wg, tile=64, compression=4, block_m=16, block_k=16)
        y = ffn_from_twell(x, g, wdt, w_up=wu, w_first=wg, kernel="token")
    else:
        pre = x @ wg.T
        y = ffn_from_twell(x, pack_relu(pre, 128, 8), wdt, w_up=wu, pre=pre, kernel="rows")
    # (the interpreter's fp32 -> bf16 cast truncates where torch rounds: about 1% here, where the
    # dense bf16 path is 0.4% off; the bits read raw were off by 1e10)
    assert rel_err(y, ref) < 3e-2, rel_err(y, ref)


def _decode_call(kind, x, wg, wd_t, wu, config):
    from twell.kernels.decode_split import SplitScratch, ffn_decode_split

    if kind == "decode":
        return ffn_decode(x, wg, wd_t, w_up=wu, config=config)
    if kind == "fused":
        return ffn_decode_fused(x, wg, wd_t, w_up=wu, config=config)
    return ffn_decode_split(x, wg, wd_t, w_up=wu, config=config, scratch=SplitScratch(x.shape[1], wg.shape[0], x.dtype, "cpu"))


@pytest.mark.parametrize("kind, config, match", [
    ("decode", (16, 16, 16, 4, 16, 16, 4), r"config must be a tuple \(BM, BU"),
    ("decode", (8, 16, 16, 4, 16, 16, 4, 1), "config's BM must be a power of two in"),
    ("decode", (16, 16, 16, 4, 16, 16, 4, 0), "config's shares must be an int in"),
    ("fused", (1, 16, 2, 1), r"config must be a tuple \(BU, BK, BD"),
    ("fused", (16, 16, 24, 4, 2), "config's BD must be a power of two"),
    ("fused", GemvConfig(3, 16, 2, 1), "config's BU must be a power of two"),
    ("split", (16, 16, 4, 2, 7, 16), r"config must be a tuple \(BU, BK, num_warps"),
    ("split", (16, 16, 4, 2, 0, 16, 4), "config's P must be an int in"),
    ("split", (16, 16, 4, 2.0, 7, 16, 4), "config's num_stages must be an int in"),
], ids=lambda v: v if isinstance(v, str) and len(v) < 8 else None)
def test_decode_configs_of_the_wrong_form_are_refused(kind, config, match):
    """Wrong configs failed with Python errors inside the launchers (a short tuple's unpacking, a
    plain tuple's missing attributes) or inside Triton; each knob is now named before a launch."""
    x, wg, wu, wd = (torch.randn(s, generator=torch.Generator().manual_seed(i)) for i, s in
                     enumerate([(3, 32), (40, 32), (40, 32), (40, 32)]))
    with pytest.raises(ValueError, match=match):
        _decode_call(kind, x, wg, wd, wu, config)


@pytest.mark.parametrize("kind, config", [
    ("decode", (16, 16, 16, 4, 16, 16, 4, 3)),  # three shares over 3 blocks of units
    ("fused", (16, 16, 16, 4, 2)),
    ("fused", GemvConfig(1, 16, 2, 1)),
    ("split", (16, 16, 4, 2, 7, 16, 4)),  # a plain tuple (it needed a SplitConfig's attributes)
])
def test_decode_configs_at_the_knobs_edges_are_exact(kind, config):
    g = torch.Generator().manual_seed(5)
    x, wg, wu, wd = (torch.randn(s, generator=g) for s in [(3, 32), (40, 32), (40, 32), (40, 32)])
    want = (torch.relu(x @ wg.T) * (x @ wu.T)) @ wd
    assert rel_err(_decode_call(kind, x, wg, wd, wu, config), want) < 1e-5


# From a mutation round on the decode kernels' bodies: each
# test below failed on a single-line change of a kernel body that every test above passed.


@pytest.mark.parametrize("kind,config", [
    ("decode", (16, 16, 16, 4, 16, 16, 4, 1)),  # y written by the down kernel
    ("decode", (16, 16, 16, 4, 16, 16, 4, 3)),  # y written by the sum kernel
    ("fused", (16, 16, 16, 4, 1)),  # tensor-core kernel
    ("fused", GemvConfig(4, 16, 2, 1)),  # CUDA-core kernel
], ids=str)
@pytest.mark.parametrize("gated", [True, False])
def test_decode_nan_gate_fires_in_the_three_launch_and_fused_kernels(kind, config, gated):
    """A NaN gate fires (relu keeps it) in ffn_decode and both fused kernels, as the split test
    above checks for the split kernels: the NaN token's row is NaN, the others the reference's,
    the statistics count every unit of the NaN token.

    Kills F19 (_decode_fused_kernel passing ``tl.where(a > 0, a, 0.0)`` as h) and F16 (the same
    as ``tl.maximum(a, 0.0)``, which drops NaN, in the interpreter as on the GPU): no test ran
    the tensor-core fused kernel on a NaN. Also D6 (_decode_up_kernel ``on = a > 0``) and F14
    (_decode_gemv_kernel ``h = tl.where(a > 0, a, 0.0)``), which only test_runtime's NaN test
    (through the dispatcher) caught."""
    M, d, f = 5, 24, 37
    x, wg, wu, wd = gate_case(M, d, f, torch.float32, seed=13)
    x[2, 5] = float("nan")
    uc, nnz = torch.zeros(f, dtype=torch.int32), torch.zeros(M, dtype=torch.int32)
    w_up = wu if gated else None
    fn = ffn_decode if kind == "decode" else ffn_decode_fused
    y = fn(x, wg, wd.T.contiguous(), w_up=w_up, unit_counts=uc, row_nnz=nnz, config=config)
    rest = torch.arange(M) != 2
    ref = _reference(x[rest], wg, wu, wd, gated)
    assert torch.isnan(y[2]).all() and rel_err(y[rest], ref) < 1e-5
    fired = ~((x @ wg.T) <= 0)
    assert int(nnz[2]) == f and torch.equal(nnz.long(), fired.sum(1)) and torch.equal(uc.long(), fired.sum(0))


@pytest.mark.parametrize("shares", [1, 2])
def test_decode_three_launch_rounds_as_the_dense_path(shares):
    """ffn_decode on the fp16 case whose exact output depends on every rounding of the dense path
    (_rounding_case; test_decode_kernels_round_as_the_dense_path covers only the fused and split
    kernels): the up product rounded to fp16 before h = gate * up.

    Kills D15 (_decode_up_kernel ``g = g * u``: up not rounded, y[0, 0] = 3 * 3 * 2^-13 instead
    of 0)."""
    d = 16
    x, wg, wu, wdt, expect, expect_counts = _rounding_case(d)
    uc, nnz = torch.zeros(16, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    y = ffn_decode(x, wg, wdt, w_up=wu, unit_counts=uc, row_nnz=nnz, config=(16, 16, 16, 4, 16, 16, 4, shares))
    assert torch.equal(y, expect), y[0, :3].tolist()
    assert torch.equal(uc, expect_counts) and int(nnz[0]) == 4, (uc.tolist(), nnz.tolist())


@pytest.mark.parametrize("shares", [1, 3])
def test_decode_writes_only_its_rows_of_a_strided_out(shares):
    """``out`` a strided view into a larger NaN buffer, with one share (the down kernel stores y
    itself) and several (the sum kernel does): y is the reference's and nothing outside the view
    is written (test_strided_and_mixed_layout_inputs covers a strided out with 2 shares only).

    Kills D23 (_decode_down_kernel ``omask = (rows <= M)...``: row M of the buffer written) and
    D24 (the one-share store with ``d`` as the row stride of y)."""
    M, d, f = 5, 24, 37
    x, wg, wu, wd = gate_case(M, d, f, torch.float32, seed=17)
    big = torch.full((M + 3, d + 7), float("nan"))
    out = big[:M, :d]
    y = ffn_decode(x, wg, wd.T.contiguous(), w_up=wu, out=out, config=(16, 16, 16, 4, 16, 16, 4, shares))
    assert y.data_ptr() == out.data_ptr()
    assert rel_err(y, R.gated_mlp(x.double(), wg.double(), wu.double(), wd.double())) < 1e-5
    assert torch.isnan(big[:, d:]).all() and torch.isnan(big[M:]).all()


@pytest.mark.parametrize("kind,config,capacity", [
    ("fused", (16, 16, 16, 4, 1), None),  # tensor-core kernel
    ("fused", GemvConfig(4, 16, 2, 1), None),  # CUDA-core kernel, d in steps
    ("fused", GemvConfig(2, 64, 2, 1), None),  # CUDA-core kernel, d in one step
    ("split", (16, 16, 4, 1, 3, 32, 4), 8192),  # up/down with d in one step
    ("split", (16, 16, 4, 1, 3, 16, 4), 8192),  # up/down with d in steps
    ("split", (16, 16, 4, 1, 3, 32, 4), 3),  # most fires past the list: the gate's own path
], ids=str)
@pytest.mark.parametrize("gated", [True, False])
def test_decode_fused_and_split_strided_and_mixed_layout_inputs(kind, config, capacity, gated):
    """ffn_decode_fused (both kernels) and the split kernels (every up/down path) on x and
    weights whose row strides all differ from d and from each other, their padding NaN: a kernel
    that used one tensor's stride for another, or d for a stride, fails here
    (test_strided_and_mixed_layout_inputs checks ffn_decode only; the split test of descriptor
    loads strides x only).

    Kills F10 (gemv x row ``m * d``), F11 (gemv gate/up rows ``* d``), F12 (gemv down rows
    ``* d``), F17 (tensor-core gate rows with stride d), F18 (tensor-core x rows ``* d``), S18
    (one-step down row ``u * d``), S19 (split gate rows ``* d``), S20 (steps' up row ``u * d``)."""
    from twell.kernels.decode_split import SplitConfig, SplitScratch, decode_split_launch

    M, d, f = 5, 24, 50
    x, wg, wu, wd = gate_case(M, d, f, torch.float32, seed=3)
    xs = torch.full((M, d + 5), float("nan"))[:, 2 : 2 + d]
    wg_s = torch.full((3 * f, d + 11), float("nan"))[0::3, 1 : 1 + d]
    wu_s = torch.full((f, 2 * d), float("nan"))[:, d:]
    wdt_s = torch.full((f, d + 3), float("nan"))[:, :d]
    for dst, src in ((xs, x), (wg_s, wg), (wu_s, wu), (wdt_s, wd.T)):
        dst.copy_(src)
    assert len({wg_s.stride(0), wu_s.stride(0), wdt_s.stride(0), xs.stride(0), d}) == 5
    uc, nnz = torch.zeros(f, dtype=torch.int32), torch.zeros(M, dtype=torch.int32)
    w_up = wu_s if gated else None
    if kind == "fused":
        y = ffn_decode_fused(xs, wg_s, wdt_s, w_up=w_up, unit_counts=uc, row_nnz=nnz, config=config)
    else:
        scratch = SplitScratch(d, f, torch.float32, "cpu", capacity=capacity)
        y = decode_split_launch(xs, wg_s, wdt_s, w_up, uc, nnz, scratch=scratch, config=SplitConfig(*config))[0]
    ref = _reference(x, wg, wu, wd, gated)
    assert rel_err(y, ref) < 1e-5
    pattern = (x @ wg.T) > 0
    assert torch.equal(uc.long(), pattern.sum(0)) and torch.equal(nnz.long(), pattern.sum(1))


@pytest.mark.parametrize("shares", [2, 3])
def test_decode_shares_add_in_fp32(shares):
    """fp16, one token, every unit firing with h = 1 over three blocks of 16 units: column 0 of y
    sums 1 (unit 0), 2^-11 (unit 1) and -1 (unit 47), which land in different shares of the
    entries. In fp32 the sum is 2^-11, as the dense path gives it; a share's partial rounded to
    fp16 (1 + 2^-11 rounds to 1) loses it. The fp16 cases above compare within a tolerance that
    such a rounding stays inside.

    Kills D25 (_decode_down_kernel storing its partial rounded to y's dtype)."""
    d, f = 16, 48
    x, wg, wdt = torch.zeros(1, d), torch.zeros(f, d), torch.zeros(f, d)
    x[0, 0] = 1.0
    wg[:, 0] = 1.0
    wdt[0, 0], wdt[1, 0], wdt[f - 1, 0] = 1.0, 2**-11, -1.0
    x, wg, wdt = x.half(), wg.half(), wdt.half()
    y = ffn_decode(x, wg, wdt, config=(16, 16, 16, 4, 16, 16, 4, shares))
    expect = torch.zeros(1, d, dtype=torch.float16)
    expect[0, 0] = 2**-11
    assert torch.equal(torch.relu(x @ wg.T) @ wdt, expect)  # the dense path
    assert torch.equal(y, expect), y[0, :2].tolist()


# From a second mutation round on the decode kernels (75 single-line mutants of decode.py,
# decode_fused.py, decode_split.py and _activity.py, named R2-...): each test below fails on a
# mutant that every test above passed, or caught only when the interpreter happened to crash on
# an out-of-bounds access (a write landing in mapped memory would not crash).

# Every launch path of the decode kernels: (kind, config, list capacity of the split kernels)
_PATHS = [
    ("decode", (16, 16, 16, 4, 16, 16, 4, 1), None),  # y written by the down kernel
    ("decode", (16, 16, 16, 4, 16, 16, 4, 3), None),  # by the sum kernel
    ("fused", (16, 16, 16, 4, 1), None),  # tensor-core kernel
    ("fused", GemvConfig(4, 16, 2, 1), None),  # CUDA-core kernel
    ("split", (16, 16, 4, 1, 3, 32, 4), 8192),  # up/down with d in one step
    ("split", (16, 16, 4, 1, 3, 8, 4), 8192),  # up/down with d in steps
    ("split", (16, 16, 4, 1, 3, 32, 4), 2),  # most fires past the list: the gate's own path
]


def _run_path(kind, config, capacity, x, w_first, w_down_t, w_up, uc=None, nnz=None, scratch=None):
    """One call of the decode kernels of ``kind`` (see _PATHS) on x; ``scratch``: the fused
    kernels' DecodeScratch or the split kernels' SplitScratch (None: none, or a new one)."""
    from twell.kernels.decode_split import SplitConfig, SplitScratch, decode_split_launch

    if kind == "decode":
        return ffn_decode(x, w_first, w_down_t, w_up=w_up, unit_counts=uc, row_nnz=nnz, config=config)
    if kind == "fused":
        return ffn_decode_fused(x, w_first, w_down_t, w_up=w_up, unit_counts=uc, row_nnz=nnz, config=config,
                                scratch=scratch)
    if scratch is None:
        scratch = SplitScratch(x.shape[1], w_first.shape[0], x.dtype, "cpu", capacity=capacity)
    return decode_split_launch(x, w_first, w_down_t, w_up, uc, nnz, scratch=scratch, config=SplitConfig(*config))[0]


def _dead_units_case():
    """``(x [5, 24], w_first, w_up [37, 24], w_down [24, 37])`` fp32 in which unit 3 fires for
    every token and is the only active unit of units 0 to 15 (a block of 4 or 16 units with a
    single active unit); unit 36, the last, and some others fire for no token; f 37: the last
    block of 16 units partial."""
    M, d, f = 5, 24, 37
    x, wg, wu, wd = gate_case(M, d, f, torch.float32, seed=19, adversarial=False)
    wg[:16, 0] = wg[f - 1, 0] = -30.0  # dead: x[:, 0] = 1
    wg[3, 0] = 30.0  # hot
    active = ((x @ wg.T) > 0).any(0)
    assert active[:16].nonzero().flatten().tolist() == [3] and not active[f - 1] and 4 < int(active[16:].sum()) < 16
    return x, wg, wu, wd


@pytest.mark.parametrize("kind,config,capacity", _PATHS, ids=str)
def test_decode_reads_only_firing_units_rows_and_writes_only_its_statistics(kind, config, capacity):
    """The up and down rows of a unit that fires for no token of the batch are never read, nor
    the rows past f: they hold NaN here (w_up and w_down_t are the first f rows of larger NaN
    buffers), and y must be the reference's with those rows taken as zeros (a kernel that loads
    them multiplies NaN by a zero h: NaN). Unit 0 is one of them (a masked lane that reads "unit
    0" reads it). The first block of units has a single active unit. The statistics are the
    first f and M elements of larger sentinel buffers whose tails must stay as they were.

    Kills R2-D19 (_decode_down_kernel loading down rows without the entries' mask: unit 0's row
    for the lanes past the list) and R2-F25 (_decode_fused_kernel skipping a block with one
    active unit: no block of the other tests' tensor-core cases has one), which every other test
    passed; deterministically (the other tests caught them by chance, reading past the weights
    or writing past the statistics) R2-F8 (_up_down_block loading the down rows of inactive
    units), R2-F18 (_units_times_rows loading the up rows of inactive units), R2-S8 (the
    overflow path loading every unit's rows), R2-D2 (_rows_times_units loading the up rows of
    inactive units: the tensor-core fused kernel) and R2-F1 (_block_activity storing
    unit_counts without the unit mask: zeros written past f)."""
    x, wg, wu, wd = _dead_units_case()
    (M, d), f = x.shape, wg.shape[0]
    fired = (x @ wg.T) > 0
    dead = ~fired.any(0)
    assert capacity is None or (int(fired.sum()) > capacity) == (capacity == 2)  # the short list overflows
    wu0, wdt0 = wu.clone(), wd.T.contiguous()
    wu0[dead], wdt0[dead] = 0.0, 0.0
    wu_nan = torch.full((f + 16, d), float("nan"))
    wdt_nan = torch.full((f + 16, d), float("nan"))
    wu_nan[:f][~dead], wdt_nan[:f][~dead] = wu0[~dead], wdt0[~dead]
    uc_big = torch.full((f + 16,), I16, dtype=torch.int32)  # past the last block's units
    nnz_big = torch.full((M + 16,), I16, dtype=torch.int32)  # past the tile's rows
    uc, nnz = uc_big[:f].zero_(), nnz_big[:M].zero_()
    y = _run_path(kind, config, capacity, x, wg, wdt_nan[:f], wu_nan[:f], uc, nnz)
    assert rel_err(y, _reference(x, wg, wu0, wdt0.T)) < 1e-5
    assert torch.equal(uc.long(), fired.sum(0)) and torch.equal(nnz.long(), fired.sum(1))
    assert bool((uc_big[f:] == I16).all()) and bool((nnz_big[M:] == I16).all()), (uc_big[f:], nnz_big[M:])


@pytest.mark.parametrize("kind", ["decode", "fused", "split"])
def test_decode_without_units_gives_zeros(kind):
    """A layer of no units (f = 0): y is zeros, also into an ``out`` pre-filled with NaN
    (ffn_decode), not memory as torch.empty left it (NaN under the tests' fixture).

    Kills R2-D24 (decode_launch returning ``out`` without zeroing it), R2-F24 and R2-S23 (the fused and
    split launchers returning ``torch.empty`` for the empty call)."""
    from twell.kernels.decode_split import SplitScratch, ffn_decode_split

    x = torch.randn(3, 24, generator=torch.Generator().manual_seed(0))
    w = torch.zeros(0, 24)
    if kind == "decode":
        out = torch.full((3, 24), float("nan"))
        y = ffn_decode(x, w, w, w_up=w, out=out)
        assert y.data_ptr() == out.data_ptr()
        assert torch.equal(ffn_decode(x, w, w), torch.zeros(3, 24))
    elif kind == "fused":
        y = ffn_decode_fused(x, w, w, w_up=w)
    else:
        y = ffn_decode_split(x, w, w, w_up=w, scratch=SplitScratch(24, 0, torch.float32, "cpu"))
    assert torch.equal(y, torch.zeros(3, 24))


@pytest.mark.parametrize("kind", ["fused", "split"])
def test_decode_write_out_past_one_block_of_columns(kind):
    """d 1100: the write-out (y from the kept accumulator, which it zeroes) runs in blocks of
    1024 columns, two per row here; every other test has d below 1024 (one block). y is the
    reference's in every column and the scratch is left zeroed.

    Kills R2-F15 (launch_write_out with one block of columns per row: columns from 1024 left as
    torch.empty left them, and the accumulator's not zeroed for the next call)."""
    from twell.kernels.decode_fused import DecodeScratch
    from twell.kernels.decode_split import SplitConfig, SplitScratch, decode_split_launch

    M, d, f = 2, 1100, 20
    x, wg, wu, wd = gate_case(M, d, f, torch.float32, seed=23)
    if kind == "fused":
        scratch = DecodeScratch(d, "cpu")
        y = ffn_decode_fused(x, wg, wd.T.contiguous(), w_up=wu, scratch=scratch, config=GemvConfig(4, 2048, 2, 1))
    else:
        scratch = SplitScratch(d, f, torch.float32, "cpu")
        y = decode_split_launch(x, wg, wd.T.contiguous(), wu, None, None, scratch=scratch,
                                config=SplitConfig(16, 512, 4, 1, 3, 2048, 4))[0]
    ref = _reference(x, wg, wu, wd)
    assert rel_err(y[:, 1024:], ref[:, 1024:]) < 1e-5 and rel_err(y, ref) < 1e-5
    assert torch.all(scratch.acc == 0)


def _product_case():
    """fp16, one token, whose output is exact only if each product of x with a gate or up row is
    taken in fp32 (as the dense path's fp16 matmul accumulates): (1 + 2^-10)^2 - (1 + 2^-9) is
    2^-20 in fp32, 0 with each product rounded to fp16 (1 + 2^-9 + 2^-20 rounds to 1 + 2^-9).

    - Unit 0: gate 1, up that difference: y[0] = 2^-20 * 2^10.
    - Unit 1: gate that difference (it fires only if it is taken in fp32), up 1: y[1] = 2^-10.
    Every other unit's gate is -1."""
    d, f = 16, 16
    x = torch.zeros(1, d)
    wg, wu, wdt = torch.zeros(f, d), torch.zeros(f, d), torch.zeros(f, d)
    x[0, :3] = torch.tensor([1 + 2**-10, 1.0, 1.0])
    wg[:, 2] = -1.0
    wg[0, 2], wu[0, 0], wu[0, 1], wdt[0, 0] = 1.0, 1 + 2**-10, -(1 + 2**-9), 2.0**10
    wg[1, 0], wg[1, 1], wg[1, 2], wu[1, 2], wdt[1, 1] = 1 + 2**-10, -(1 + 2**-9), 0.0, 1.0, 2.0**10
    expect = torch.zeros(1, d)
    expect[0, :2] = 2**-10
    return *(t.half() for t in (x, wg, wu, wdt)), expect.half()


@pytest.mark.parametrize("kind,config,capacity", _PATHS, ids=str)
def test_decode_products_of_fp16_inputs_in_fp32(kind, config, capacity):
    """Every kernel takes each fp16 product of x with a gate or up row in fp32 and sums in fp32
    before rounding, as the dense path does (_product_case: exact only so). The fp16 cases above
    compare within a tolerance that products rounded to fp16 stay inside.

    Kills R2-F22 (_units_times_rows multiplying in the input dtype: the CUDA-core fused kernel's
    gate and up), R2-S13 (_add_fire_in_steps's up product in the input dtype) and R2-S12 (the
    one-step up/down's, which only the bf16 test above caught, within its tolerance)."""
    x, wg, wu, wdt, expect = _product_case()
    assert torch.equal(((torch.relu(x @ wg.T) * (x @ wu.T)) @ wdt), expect)  # the dense path
    y = _run_path(kind, config, capacity, x, wg, wdt, wu)
    assert torch.equal(y, expect), y[0, :2].tolist()


def test_decode_more_than_sixteen_blocks_of_units():
    """f 300 in blocks of 16 units: 19 blocks, more than the 16 lanes the down kernel's prefix
    sum over the blocks' counts takes at least (NBP, the next power of two: 32); every test
    above has at most 7 blocks. One share and two.

    Kills R2-D27 (NBP fixed at 16: the entries of blocks 16 to 18 dropped)."""
    M, d, f = 3, 24, 300
    x, wg, wu, wd = gate_case(M, d, f, torch.float32, seed=29)
    fired = (x @ wg.T) > 0
    assert fired[:, 256:].any()  # units of the blocks past 16 fire
    for shares in (1, 2):
        y = ffn_decode(x, wg, wd.T.contiguous(), w_up=wu, config=(16, 16, 16, 4, 16, 16, 4, shares))
        assert rel_err(y, _reference(x, wg, wu, wd)) < 1e-5, shares


def test_decode_config_takes_the_smallest_key_at_or_above_m():
    """ffn_decode's block shapes: the entry of the smallest key at or above M (a call of exactly
    a key's tokens takes that key's shapes), the largest key's above them all.

    Kills R2-D28 (``M < key``: a call of 4 tokens took the 16-token shapes, 8 shares)."""
    keys = sorted(decode.DECODE_CONFIGS)
    for M in range(1, keys[-1] + 3):
        want = decode.DECODE_CONFIGS[min((k for k in keys if k >= M), default=keys[-1])]
        assert decode.decode_config(M) == want, M


@pytest.mark.parametrize("kind,config,capacity,M", [(*p, 5) for p in _PATHS if p[2] != 8192] + [(*_PATHS[1], 21)], ids=str)
def test_decode_writes_nothing_around_its_buffers(kind, config, capacity, M, monkeypatch):
    """Every buffer a decode call makes with torch.empty (the three-launch kernels' h columns,
    unit lists, block counts, fp32 partials and y; the fused and split kernels' block counts and
    y, written from a kept accumulator) sits between two guards of 8192 elements, NaN or 0, which
    must stay as they were: a store that drops its mask writes there (a block whose first unit
    does not fire has slot -1 for it: unit 0 does not fire here). The split kernels' list of 2
    entries, which the batch's fires overflow, sits in buffers long enough for every fire, whose
    tails must stay as they were too. A read of a slot no call wrote, or past a buffer, finds a
    NaN h or gate (the int buffers hold 0: unit 0, a count of 0), which y shows; the up/down walk
    must stop at the list's capacity. 5 tokens, and 21 (two chunks of the three-launch kernels).

    Without the guards each mutant below showed only as a crash of the interpreter (a heap
    corruption, or an index read from the fixture's poison), which a write or read landing in
    mapped memory would not give. Kills, by assertion: R2-D9 and R2-D10 (_decode_up_kernel
    storing h and the unit list without the active mask: slot -1 of block 0, before the buffer),
    R2-D4 (its gate read without the unit mask: units past f fire), R2-D5 and R2-D11 (a chunk's
    block counts or entries at chunk 0's place), R2-D7 (a block with one active unit skipped: its
    count read, its slot never written), R2-D12, R2-D15 and R2-D16 (_decode_down_kernel reading a
    count or entries past its chunk or share), R2-S4 (the list's stores not bounded by its
    capacity), R2-S9 (_fire_updown_kernel walking the list's whole count, past its capacity);
    also R2-F12 (the write-out's column mask ``cols <= d``: one element past y)."""
    from twell.kernels.decode_fused import DecodeScratch
    from twell.kernels.decode_split import SplitScratch

    x, wg, wu, wd = _dead_units_case()
    x = torch.cat([x, x.flip(0), x, x, x])[:M]  # 21 tokens: two chunks of 16 (three-launch)
    (M, d), f = x.shape, wg.shape[0]
    ref = _reference(x, wg, wu, wd)
    scratch = None
    if kind == "fused":
        scratch = DecodeScratch(d, "cpu")
    elif kind == "split":
        scratch = SplitScratch(d, f, torch.float32, "cpu", capacity=capacity)
        # the tails: entry 0 (unit 0, token 0: unit 0 never fires, no fire is listed as 0) with a
        # NaN gate, which a walk past the list's capacity would add into y's row 0
        entries, gates = torch.zeros(M * f, dtype=torch.int32), torch.full((M * f,), float("nan"))
        scratch.entries, scratch.gates = entries[:capacity], gates[:capacity]
    # NaN, or 0 (unit 0, which never fires here; a count of 0) before, in and after each buffer:
    # a read of a slot nobody wrote, or past the buffer, adds a NaN instead of crashing
    zero_or_nan = lambda t: t.fill_(float("nan") if t.is_floating_point() else 0)  # noqa: E731
    handed = guard_empty(monkeypatch, after=8192, before=8192, fill=zero_or_nan)
    y = _run_path(kind, config, capacity, x, wg, wd.T.contiguous(), wu, scratch=scratch)
    guards = [g for h in handed for g in h.guards]
    written = [int((~torch.isnan(g) if g.is_floating_point() else g != 0).sum()) for g in guards]
    assert len(handed) >= 2 and not any(written), written  # elements written in each guard
    if kind == "split":
        assert torch.all(entries[capacity:] == 0) and torch.isnan(gates[capacity:]).all()
    assert rel_err(y, ref) < 1e-5


def test_decode_fused_call_larger_than_the_scratch_leaves_it_alone():
    """A call of more tokens than a DecodeScratch's rows takes a fresh zeroed buffer: the
    scratch (here the first 16 rows of a 32-row buffer whose other rows are NaN) is neither added
    into nor zeroed past its rows, and y is the reference's (test_decode_fused_scratch_is_left_
    zeroed_and_reused makes such a call on an exactly sized scratch).

    Kills deterministically R2-F23 and R2-F31 (the scratch used for a call of more tokens than
    its rows: the adds and the write-out run past them, which without the guard rows only
    corrupted the heap: a crash, at times)."""
    from twell.kernels.decode_fused import DecodeScratch

    M, d, f = 20, 24, 37
    x, wg, wu, wd = gate_case(M, d, f, torch.float32, seed=31)
    scratch = DecodeScratch(d, "cpu")
    big = torch.full((32, d), float("nan"))
    big[:16] = 0.0
    scratch.acc = big[:16]
    y = ffn_decode_fused(x, wg, wd.T.contiguous(), w_up=wu, scratch=scratch, config=(16, 16, 16, 4, 1))
    assert rel_err(y, _reference(x, wg, wu, wd)) < 1e-5
    assert torch.all(big[:16] == 0) and torch.isnan(big[16:]).all()

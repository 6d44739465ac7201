"""Gate-with-pack kernels against the PyTorch pack (Triton interpreter on the CPU; GPU in bf16)."""

from __future__ import annotations

import pytest
import torch

from kernel_cases import GUARD, case_id, gate_case, poison_, untouched
from twell.format import TwELL, pack_twell
from twell.kernels import gate_pack, gate_pack_fused, gate_pack_persistent, pack_relu
from twell.inference.ops import gate_to_twell

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the Triton interpreter
CPU_DTYPES = (torch.float32, torch.float16)  # the interpreter mishandles bf16 tl.dot operands


def assert_same_twell(out, ref):
    """Counts equal; every entry of a non-overflowed tile equal; overflowed tiles keep only
    their count (their entries are recomputed by consumers)."""
    assert out.values.shape == ref.values.shape and out.tile == ref.tile and out.f == ref.f
    assert torch.equal(out.counts, ref.counts)
    used = torch.arange(out.slots, device=out.counts.device) < out.counts.unsqueeze(-1)
    used &= ~out.overflowed().unsqueeze(-1)
    assert torch.equal(out.cols[used], ref.cols[used])
    assert torch.equal(out.values[used], ref.values[used])
    assert not torch.isnan(out.values[used]).any()


# (M, f, tile, compression): odd sizes, partial last tiles, a tile narrower than the bit-word
# pack's 32 columns (it refuses it), one tile wider than f; in fp32 and fp16.
NARROW = [(13, 100, 32, 4), (6, 70, 16, 8), (9, 40, 64, 2), (5, 37, 128, 8)]
# Wide tiles, in fp32 only: their bookkeeping does not depend on the dtype, and under the
# interpreter the bit-word pack costs time in proportion to rows x columns (each wide fp16 copy
# took seconds). 700 / 512: two tiles, each over several 256-column steps of the pack pass (its
# carry across steps). 1100 / 2048, bit-word pack only (the scan has no per-tile state that
# 700 / 512 does not already cover): one tile wider than f, walked in several steps, with the
# case's dense row overflowing it. 5 rows: one row block of the bit-word pack (row blocks that do
# not divide M: the narrow cases and the next test; full words and bit 31: the next test).
PACK_CASES = (
    [(method, dtype, *case) for method in ("scan", "bits") for case in NARROW for dtype in CPU_DTYPES]
    + [(method, torch.float32, 5, 700, 512, 4) for method in ("scan", "bits")]
    + [("bits", torch.float32, 5, 1100, 2048, 8)]
)


@pytest.mark.parametrize("method,dtype,M,f,tile,compression", PACK_CASES, ids=case_id)
def test_pack_relu_matches_pack_twell(method, dtype, M, f, tile, compression):
    if method == "bits" and tile < 32:
        with pytest.raises(ValueError, match="tile >= 32"):
            pack_relu(torch.zeros(M, f, dtype=dtype), tile, compression, method=method)
        return
    x, w, _, _ = gate_case(M, 24, f, dtype, seed=M + f)
    a = x @ w.T
    out = pack_relu(a, tile, compression, method=method)
    ref = pack_twell(torch.relu(a), tile, compression)
    assert_same_twell(out, ref)
    assert out.overflow_values is None
    assert bool(out.overflowed().any())  # the dense row overflows: the case is exercised


@pytest.mark.parametrize("method", ["scan", "bits"])
def test_pack_relu_all_zero_and_empty(method):
    a = -torch.rand(7, 50)
    out = pack_relu(a, 32, 4, method=method)
    assert torch.equal(out.counts, torch.zeros(7, 2, dtype=torch.int32))
    empty = pack_relu(torch.zeros(0, 50), 32, 4, method=method)
    assert empty.counts.shape == (0, 2)
    with pytest.raises(ValueError, match="method"):
        pack_relu(a, 32, 4, method="sort")


def test_pack_bits_block_shapes():
    """Row blocks that do not divide M, column steps narrower than the tile, a word whose top
    bit (column 31 of the word, the int32 sign bit) is set, and a full word (32 rounds of one
    step, the last one bit 31).

    Sized for the interpreter, where this pack costs time in proportion to rows x columns and
    to the entries of the fullest row of each block: 7 rows (two blocks of 4, the second
    partial; one partial block of 8 and of 16), 300 columns (5 to 10 steps), about 10% dense,
    and slots (127) that the heavy last row (about half its units) overflows."""
    x, w, _, _ = gate_case(7, 24, 300, torch.float32, seed=3, density=0.1)
    a = x @ w.T
    a[4, 31] = a[4, 63] = 1.0
    a[5, 64:96] = 1.0
    ref = pack_twell(torch.relu(a), 1024, 8)
    assert not bool(ref.overflowed()[4]) and bool(ref.overflowed()[6])
    for cfg in [(4, 64, 1), (8, 128, 2), (16, 32, 4)]:
        assert_same_twell(pack_relu(a, 1024, 8, method="bits", config=cfg), ref)


def test_pack_bits_default_shape_follows_the_rows(monkeypatch):
    """One row per program up to PACK_BITS_SMALL_M rows (more programs for small calls), the
    wide shape above; the shape changes no output."""
    from twell.kernels import gate_pack

    assert gate_pack.bits_config(gate_pack.PACK_BITS_SMALL_M) == gate_pack.PACK_BITS_SMALL_M_CONFIG
    assert gate_pack.bits_config(gate_pack.PACK_BITS_SMALL_M + 1) == gate_pack.PACK_BITS_CONFIG
    assert gate_pack.PACK_BITS_SMALL_M_CONFIG[0] < gate_pack.PACK_BITS_CONFIG[0]
    x, w, _, _ = gate_case(7, 24, 300, torch.float32, seed=5, density=0.1)
    a = x @ w.T
    ref = pack_twell(torch.relu(a), 1024, 8)
    seen = []
    real = gate_pack._pack_relu_bits_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.append((grid[0], kw["BM"], kw["num_warps"]))
                return real[grid](*args, **kw)
            return launch

    monkeypatch.setattr(gate_pack, "_pack_relu_bits_kernel", Spy())
    for small_m in (7, 6):  # 7 rows: the small shape; 6: the wide one
        monkeypatch.setattr(gate_pack, "PACK_BITS_SMALL_M", small_m)
        assert_same_twell(pack_relu(a, 1024, 8, method="bits"), ref)
    bm_small, bm_wide = gate_pack.PACK_BITS_SMALL_M_CONFIG[0], gate_pack.PACK_BITS_CONFIG[0]
    assert seen == [(-(-7 // bm_small), bm_small, gate_pack.PACK_BITS_SMALL_M_CONFIG[2]),
                    (-(-7 // bm_wide), bm_wide, gate_pack.PACK_BITS_CONFIG[2])]


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("M,d,f,tile", [(13, 40, 100, 32), (33, 20, 70, 16)])
def test_gate_pack_fused_matches_reference(dtype, M, d, f, tile):
    # small integers: every dot product is exact, so the signs match bit for bit
    g = torch.Generator().manual_seed(M * d)
    x = torch.randint(-2, 3, (M, d), generator=g).to(dtype)
    w = torch.randint(-2, 3, (f, d), generator=g).to(dtype)
    x[1] = 0
    w[3] = 1
    x[4] = 1  # fires for most units: overflows
    out = gate_pack_fused(x, w, tile=tile, compression=4, block_m=16, block_k=16, num_warps=4, num_stages=1)
    ref = pack_twell(torch.relu(x.float() @ w.float().T).to(dtype), tile, 4)
    assert_same_twell(out, ref)
    assert bool(out.overflowed().any())


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("M,d,f,tile,programs", [(13, 40, 100, 32, 3), (33, 24, 70, 16, 2), (50, 48, 64, 64, 7)])
def test_gate_pack_persistent_matches_reference(dtype, M, d, f, tile, programs):
    """The persistent tensor-descriptor gate-pack: the same TwELL as the reference (exact small
    integers), with overflowed tiles, a partial last tile of f, partial row and k blocks, and
    fewer programs than output tiles (each walks several); pack=False gives x w^T itself."""
    g = torch.Generator().manual_seed(M * d + 1)
    x = torch.randint(-2, 3, (M, d), generator=g).to(dtype)
    w = torch.randint(-2, 3, (f, d), generator=g).to(dtype)
    x[1] = 0
    w[3] = 1
    x[4] = 1  # fires for most units: overflows
    kw = dict(tile=tile, compression=4, block_m=16, block_k=16, num_warps=4, num_stages=1, num_programs=programs)
    out = gate_pack_persistent(x, w, **kw)
    ref = pack_twell(torch.relu(x.float() @ w.float().T).to(dtype), tile, 4)
    assert_same_twell(out, ref)
    assert bool(out.overflowed().any())
    dense = gate_pack_persistent(x, w, pack=False, **kw)
    assert torch.equal(dense, (x.float() @ w.float().T).to(dtype))


@pytest.mark.parametrize("gate_pack", [gate_pack_fused, gate_pack_persistent], ids=["fused", "persistent"])
def test_matmul_gate_pack_validation(gate_pack):
    x = torch.zeros(3, 8)
    with pytest.raises(ValueError, match="w must be"):
        gate_pack(x, torch.zeros(5, 7))
    with pytest.raises(TypeError, match="dtype"):
        gate_pack(x, torch.zeros(5, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="tile"):
        gate_pack(x, torch.zeros(5, 8), tile=512)


def test_gate_pack_persistent_validation():
    with pytest.raises(ValueError, match="multiple of 16"):
        gate_pack_persistent(torch.zeros(3, 6, dtype=torch.float16), torch.zeros(5, 6, dtype=torch.float16))
    assert gate_pack_persistent(torch.zeros(0, 8), torch.zeros(5, 8)).counts.shape == (0, 1)


def test_gate_to_twell_methods_agree():
    x, w, _, _ = gate_case(11, 32, 90, torch.float32, seed=3)
    g1, pre = gate_to_twell(x, w, tile=32, compression=4, method="cublas")
    assert pre is not None and torch.equal(pre, x @ w.T)
    g2, none = gate_to_twell(x, w, tile=32, compression=4, method="fused")
    assert none is None
    # fp32 matmuls in two orders: compare the patterns away from ties
    assert (g1.counts - g2.counts).abs().max() <= 1
    g3, none = gate_to_twell(x, w, tile=32, compression=4, method="persistent")
    assert none is None and (g1.counts - g3.counts).abs().max() <= 1
    with pytest.raises(ValueError, match="method"):
        gate_to_twell(x, w, method="magic")


def test_pack_validation():
    with pytest.raises(TypeError, match="a must"):
        pack_relu(torch.zeros(3, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="2-D"):
        pack_relu(torch.zeros(3))
    with pytest.raises(ValueError, match="tile"):
        pack_relu(torch.zeros(3, 4), tile=24)
    with pytest.raises(ValueError, match="compression"):
        pack_relu(torch.zeros(3, 4), compression=3)
    with pytest.raises(ValueError, match="a is on the meta device"):
        pack_relu(torch.zeros(3, 4, device="meta"))


# --- GPU, bf16, real shapes --------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["cublas", "fused", "persistent"])
def test_gate_pack_gpu_bf16(method):
    from twell.bench.synthetic import make_ffn

    s = make_ffn(4099, 2048, 5632, 29, "heavy", dtype=torch.bfloat16, device="cuda", seed=1)
    tile = 256 if method == "cublas" else 128
    g, _ = gate_to_twell(s.x, s.w_gate, tile=tile, compression=4, method=method)
    a = torch.mm(s.x, s.w_gate.T)
    ref = pack_twell(torch.relu(a), tile, 4)
    if method == "cublas":
        assert_same_twell(g, ref)
    else:  # a Triton matmul rounds differently from cuBLAS: counts agree up to a few ties
        assert (g.counts - ref.counts).abs().sum() <= 1e-3 * ref.counts.sum()
    assert bool(g.overflowed().any())


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [256, 8192])
def test_pack_bits_gpu_bf16(tile):
    from twell.bench.synthetic import make_ffn

    s = make_ffn(4099, 2048, 5632, 29, "heavy", dtype=torch.bfloat16, device="cuda", seed=2)
    a = torch.mm(s.x, s.w_gate.T)
    g = pack_relu(a, tile, 8, method="bits")
    assert_same_twell(g, pack_twell(torch.relu(a), tile, 8))
    assert bool(g.overflowed().any())


@pytest.mark.gpu
def test_gate_pack_fused_fp32_is_full_precision():
    """fp32 operands must not be rounded to TF32 (Triton's default for tl.dot on NVIDIA GPUs):
    the stored gate values match a float64 product to fp32 accuracy."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(257, 512, device="cuda", generator=g)
    w = torch.randn(300, 512, device="cuda", generator=g)
    x[:, 0], w[:, 0] = 8.0, -5.0  # shift the gate down: a few percent of units fire
    out = gate_pack_fused(x, w, tile=128, compression=2)
    ref = x.double() @ w.double().T
    used = torch.arange(out.slots, device="cuda") < out.counts.unsqueeze(-1)
    used &= ~out.overflowed().unsqueeze(-1)
    r, t, s = torch.nonzero(used, as_tuple=True)
    cols = t.long() * out.tile + out.cols[r, t, s].long()
    want = ref[r, cols]
    err = ((out.values[r, t, s].double() - want).norm() / want.norm()).item()
    assert r.numel() > 1000 and err < 1e-5, err


def test_fused_gate_pack_decides_activity_on_the_rounded_gate():
    """The fused gate's epilogue takes a unit as active when its gate *rounded to the storage
    dtype* is positive, as the dense path's relu of the fp16 product does: 2^-13 * 2^-13 = 2^-26
    is positive in fp32 and 0 in fp16 (a mutant testing the fp32 accumulator survived every other
    test)."""
    x = torch.zeros(5, 16, dtype=torch.float16)
    w = torch.zeros(40, 16, dtype=torch.float16)
    x[:, 0] = 2.0**-13
    w[:, 0] = 2.0**-13
    w[::3, 1] = 1.0  # and some ordinary entries
    x[:, 1] = 1.0
    out = gate_pack_fused(x, w, tile=16, compression=4, block_m=16, block_k=16, num_warps=4, num_stages=1)
    ref = pack_twell(torch.relu(x.float() @ w.float().T).half(), 16, 4)
    assert torch.equal(out.counts, ref.counts), (out.counts, ref.counts)
    used = (torch.arange(out.slots) < out.counts.unsqueeze(-1)) & ~out.overflowed().unsqueeze(-1)
    assert torch.equal(out.cols[used], ref.cols[used]) and torch.equal(out.values[used], ref.values[used])


def assert_same_twell_nan(out, ref):
    """assert_same_twell, where stored values may be NaN (equal when both are)."""
    assert torch.equal(out.counts, ref.counts)
    used = torch.arange(out.slots, device=out.counts.device) < out.counts.unsqueeze(-1)
    used &= ~out.overflowed().unsqueeze(-1)
    assert torch.equal(out.cols[used], ref.cols[used])
    assert torch.allclose(out.values[used], ref.values[used], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("method", ["scan", "bits", "fused", "persistent"])
def test_a_nan_gate_fires(method):
    """relu keeps a NaN, so every pack stores a NaN gate as an entry (dense turns it into a NaN
    output): a NaN unit for every token, within the slots; a NaN token row (all gates NaN),
    which overflows its tiles; -0.0 and 0.0 do not fire."""
    g = torch.Generator().manual_seed(5)
    M, d, f, tile = 9, 24, 74, 32  # last tile: 10 columns, more than its 8 slots
    x = torch.randint(-2, 3, (M, d), generator=g).float()
    w = torch.randint(-2, 3, (f, d), generator=g).float()
    w[:, 0] = -16.0
    x[:, 0] = 1.0  # mostly negative gates: short rows
    w[5, 1] = float("nan")  # unit 5: NaN for every token
    x[3, 2] = float("nan")  # token 3: NaN for every unit
    if method in ("scan", "bits"):
        a = x @ w.T
        a[0, 10], a[0, 11] = -0.0, 0.0
        out = pack_relu(a, tile, 4, method=method)
    else:
        a = x @ w.T
        fn = gate_pack_fused if method == "fused" else gate_pack_persistent
        out = fn(x, w, tile=tile, compression=4, block_m=16, block_k=16, num_warps=4, num_stages=1)
    ref = pack_twell(torch.relu(a), tile, 4)
    assert_same_twell_nan(out, ref)
    over = out.overflowed()
    assert bool(over[3].all()) and not bool(over[torch.arange(M) != 3].any())
    assert int(out.counts[0, 0]) >= 1  # unit 5, stored


def test_pack_bits_writes_nothing_outside_its_slots(monkeypatch):
    """Overflowed tiles may leave their own slots unspecified, but a write past slot SLOTS - 1
    lands in the next tile's slots (or the next row's, or past the buffer), and a row past M
    must write nothing. The output buffers are the first M rows of larger poisoned buffers; the
    input is the first M rows of a matrix whose rows past M fire everywhere. Checked: the unused
    slots of non-overflowed tiles and every guard row keep their poison.

    Kills (deterministically; without it they only crash the interpreter by heap corruption or
    pass silently): write limit dropped ('rest != 0' alone), 'slot <= limit', SLOTS + 1 as the
    limit, rows past M not masked in step_bit_words."""
    M, f, tile, C = 5, 96, 32, 4  # 3 tiles of 32, 7 slots each
    made = {}
    real = gate_pack.empty_twell

    def guarded(M_, f_, tile_, C_, dtype, device):
        big = real(M_ + GUARD, f_, tile_, C_, dtype, device)
        for t in (big.values, big.cols, big.counts):
            poison_(t)
        made["big"] = big
        return TwELL(big.values[:M_], big.cols[:M_], big.counts[:M_], f_, tile_, C_)

    monkeypatch.setattr(gate_pack, "empty_twell", guarded)
    big_a = torch.full((M + GUARD, f), -1.0, device=DEV)
    big_a[M:] = 1.0  # rows past M: every unit fires (read only by a kernel that ignores M)
    a = big_a[:M]
    a[0, 0:32] = 2.0  # row 0, tile 0: 32 entries, overflows; tile 1 of row 0 is empty
    a[0, 70] = 3.0
    a[2, 33] = a[2, 63] = 4.0  # a light tile (its bit 31 among them)
    a[M - 1, 64:96] = 5.0  # the last (row, tile) overflows: its spill would leave the buffer
    for cfg in [(4, 32, 1), (1, 256, 1), (2, 512, 1)]:
        out = pack_relu(a, tile, C, method="bits", config=cfg)
        ref = pack_twell(torch.relu(a), tile, C)
        assert torch.equal(out.counts, ref.counts)
        over = out.overflowed()
        assert bool(over[0, 0]) and bool(over[M - 1, 2])
        slot = torch.arange(out.slots, device=DEV)
        used = (slot < out.counts.unsqueeze(-1)) & ~over.unsqueeze(-1)
        assert torch.equal(out.cols[used], ref.cols[used]) and torch.equal(out.values[used], ref.values[used])
        free = (slot >= out.counts.unsqueeze(-1)) & ~over.unsqueeze(-1)  # nobody's slots
        assert untouched(out.cols[free]).all() and untouched(out.values[free]).all(), cfg
        big = made["big"]
        for t in (big.values, big.cols, big.counts):
            assert untouched(t[M:]).all(), cfg  # nothing past row M - 1


@pytest.mark.parametrize("config", [(1, 48, 1), (1, 16, 1), (3, 64, 1)])
def test_pack_relu_bits_refuses_a_bad_config(config):
    """The bits pack covers BN // 32 words per step but advances by BN: BN must be a power of two
    >= 32 (and BM a power of two). Before the check (1, 48, 1) returned wrong counts without an
    error; (1, 16, 1) and (3, 64, 1) failed inside the interpreter or the compiler."""
    a = torch.randn(3, 100, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="config"):
        pack_relu(a, 64, 2, method="bits", config=config)


@pytest.mark.gpu
def test_pack_relu_bits_int64_offsets_gpu():
    """M * N_TILES * SLOTS beyond 2^31 (tile 32, C 2: 15 slots): out_row must be int64. Kills
    dropping rows' .to(tl.int64) in _pack_relu_bits_kernel. Not run in this review."""
    M, f = (1 << 31) // 15 + 5, 32
    a = torch.full((M, f), -1.0, dtype=torch.bfloat16, device="cuda")
    a[-1, [0, 31]] = 1.0
    out = pack_relu(a, 32, 2, method="bits")
    assert out.counts[-1, 0].item() == 2 and int(out.counts[:-1].sum()) == 0
    assert out.cols[-1, 0, :2].tolist() == [0, 31]


@pytest.mark.parametrize("config", [(4, 32), (4, 32, 4, 1), (4, 32.0, 4), "4,32,4"], ids=["short", "long", "float", "str"])
def test_pack_relu_refuses_a_config_of_the_wrong_form(config):
    """A two-entry tuple failed with IndexError inside the pack; each knob is named."""
    a = torch.randn(3, 100, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="config"):
        pack_relu(a, 64, 2, config=config)
    # a list of three powers of two is a config
    assert torch.equal(pack_relu(a, 64, 2, config=[4, 32, 4]).counts, pack_twell(torch.relu(a), 64, 2).counts)


def test_packs_of_no_units_have_no_tiles():
    """f = 0: no tiles (empty_twell gave one, which TwELL.validate and ffn_from_twell refuse:
    twell_gated_mlp on a layer with no units failed)."""
    x, w = torch.randn(5, 16), torch.randn(0, 16)
    for t in (pack_relu(torch.zeros(5, 0), 32, 4), gate_pack_fused(x, w), gate_pack_persistent(x, w)):
        t.validate()
        assert t.values.shape[:2] == (5, 0) and t.counts.shape == (5, 0)
        assert pack_twell(torch.zeros(5, 0), 32, 4).values.shape[:2] == (5, 0)

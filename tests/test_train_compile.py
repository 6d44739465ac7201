"""torch.compile of twell's training path (Triton interpreter on the CPU): the training ops as
custom ops (twell::train_ffn_fwd / twell::train_ffn_bwd) pass torch.library.opcheck; a compiled
training step of SparseGatedMLP / SparseMLP (fullgraph, inductor) on the sparse kernels and on
the fused dense op gives eager's output, L1 term, statistics and gradients; the MLP makes no
graph break, and one compiled graph serves every layer whatever path and width each picks;
``twell train --compile`` trains."""

import math
import warnings

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import twell.training.ops as T
from kernel_cases import rel_err
from twell import SparseGatedMLP, SparseMLP
from twell.training import path as train_path

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the Triton interpreter
# Small blocks (as in test_train_kernels): every loop of the kernels runs more than once at these
# shapes, and the interpreter walks fewer padded lanes.
SMALL = dict(
    PACK_CONFIG=dict(block_m=2, block_f=32, num_warps=1),
    ROWS_CONFIG=dict(block_e=4, block_d=32, num_warps=1),
    GRADS_CONFIG=dict(block_t=4, block_d=32, num_warps=1, split=True),
    HEAVY_CONFIG=dict(block_m=16, block_n=16, block_k=16, num_warps=1, num_stages=1),
)
D, F, W = 16, 40, 8  # d, f and the ELL width: about 6 units fire per token, some rows more than W


@pytest.fixture
def small_blocks(monkeypatch):
    for name, cfg in SMALL.items():
        monkeypatch.setattr(T, name, cfg)


def _case(M=9, seed=0):
    """``(x [M, D], w_gate [F, D], w_up [F, D], w_down [D, F])`` fp32: about 15% of the units
    fire per token (column 0 of x is 1, column 0 of w_gate minus a threshold); token 2 fires
    every unit (a heavy row at width W)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, D, generator=g)
    wg = torch.randn(F, D, generator=g) / math.sqrt(D - 1)
    x[:, 0] = 1.0
    wg[:, 0] = -1.0
    x[2, 0] = -40.0
    wu = torch.randn(F, D, generator=g) / math.sqrt(D)
    wd = torch.randn(D, F, generator=g) / math.sqrt(F)
    return tuple(t.to(DEV) for t in (x, wg, wu, wd))


def _opcheck(op, args):
    result = torch.library.opcheck(op, args)
    assert set(result.values()) == {"SUCCESS"}, result


# --- the custom ops --------------------------------------------------------------------------


@pytest.mark.parametrize("width,gated,kernel_layout", [
    pytest.param(W, True, True, id="sparse-gated", marks=pytest.mark.slow),
    pytest.param(W, False, False, id="sparse-plain", marks=pytest.mark.slow),
    pytest.param(0, True, True, id="dense-gated"), pytest.param(0, False, False, id="dense-plain")])
@pytest.mark.parametrize("f", [F, 300], ids=["f40", "f300"])
def test_opcheck_forward(width, gated, kernel_layout, f):
    """The forward op with its autograd formula (which calls the backward op): schema, fake
    implementation (exact shapes, dtypes and strides; w_down in the kernels' layout or
    nn.Linear's), no output aliasing another, autograd registration and AOT dispatch, on the
    sparse path (heavy rows included) and the dense one; f 300: the dense path's element-wise
    passes split f into column chunks (twell.kernels.dense_rows), which once returned the unit
    and row counts as views of one buffer."""
    if f != F and width:
        pytest.skip("the chunks are the dense path's")
    x, wg, wu, wd = _case()
    if f != F:
        g = torch.Generator().manual_seed(1)
        wg, wu = (torch.randn(f, D, generator=g).to(DEV) / math.sqrt(D) for _ in range(2))
        wd = torch.randn(D, f, generator=g).to(DEV) / math.sqrt(f)
    if kernel_layout:
        wd = wd.t().contiguous().t()
    args = (x.requires_grad_(), wg.requires_grad_(), wd.requires_grad_(), wu.requires_grad_() if gated else None, width, None)
    _opcheck(torch.ops.twell.train_ffn_fwd.default, args)


@pytest.mark.parametrize("width", [W, 0], ids=["sparse", "dense"])
def test_opcheck_backward(width):
    """The backward op on what its forward returned; a gradient not asked for comes back as a
    zero-size tensor."""
    x, wg, wu, wd = _case()
    out = torch.ops.twell.train_ffn_fwd(x, wg, wd, wu, width, None)
    assert T._tagged(out[11]).shape == ((4,) if width else (1,))  # the sparse path's buffer keeps its tag
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(DEV)
    args = (dy, torch.tensor(0.3, device=DEV), x, wg, wd, wu, out[2], *out[5:], out[11], [True, True, False, True])
    _opcheck(torch.ops.twell.train_ffn_bwd.default, args)
    dx, dw_gate, dw_down, dw_up = torch.ops.twell.train_ffn_bwd(*args)
    assert dw_down.shape == (0,) and dx.shape == x.shape and dw_up.shape == wu.shape


def test_opcheck_layer_choice():
    """LAYER_CHOICE, whose outputs' sizes follow the layer's choice at run time (unbacked sizes
    in the fake implementation). opcheck copies the weights, which no module owns: the op warns
    and trains them dense (the module's own path is checked compiled, below)."""
    x, wg, wu, wd = _case()
    args = (x.requires_grad_(), wg.requires_grad_(), wd.requires_grad_(), wu.requires_grad_(), train_path.LAYER_CHOICE, wg)
    with pytest.warns(RuntimeWarning, match="no twell module owns this weight"):
        _opcheck(torch.ops.twell.train_ffn_fwd.default, args)


def test_the_op_route_equals_the_eager_function():
    """Called eagerly, the custom op (what a compiled graph runs) and the autograd.Function
    (what eager calls take) give the same bits: they share one forward and one backward."""
    tensors = _case()
    r = torch.randn(tensors[0].shape, generator=torch.Generator().manual_seed(2)).to(DEV)
    results = []
    for call in (lambda x, wg, wu, wd: T.dense_gated_ffn(x, wg, wu, wd),
                 lambda x, wg, wu, wd: torch.ops.twell.train_ffn_fwd(x, wg, wd, wu, 0, None)):
        leaves = [t.clone().requires_grad_() for t in tensors]
        out = call(*leaves)
        ((out[0] * r).sum() + 0.3 * out[1]).backward()
        results.append([out[0], out[1], out[2], out[3]] + [t.grad for t in leaves])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_width_checks_are_kept():
    """The public sparse functions still refuse widths the op would read as a mode (0: dense,
    LAYER_CHOICE), and the op refuses any other negative width."""
    x, wg, wu, wd = _case()
    for width in (0, train_path.LAYER_CHOICE, True):
        with pytest.raises(ValueError, match="width must be an int"):
            T.sparse_gated_ffn(x, wg, wu, wd, width)
    with pytest.raises(ValueError, match="width must be an int"):
        torch.ops.twell.train_ffn_fwd(x, wg, wd, wu, -2, None)


# --- compiled modules ------------------------------------------------------------------------


def _pair(cls, kernels, seed=0):
    """Two copies of one module (about 15% of the units fire), on ``kernels``; at width W."""
    torch.manual_seed(seed)
    mods = [cls(D, F).to(DEV) for _ in range(2)]
    mods[1].load_state_dict(mods[0].state_dict())
    for m in mods:
        with torch.no_grad():
            m._first_projection().weight[:, 0] = -1.0
        m.train_kernels = kernels
        m._twell_train.k_mean, m._twell_train.width = 4.0, W  # as if measured: ELL width W
    return mods


def _step(fn, m, x, r, use_checkpoint=False):
    xi = x.clone().requires_grad_(True)
    y = checkpoint(fn, xi, use_reentrant=False) if use_checkpoint else fn(xi)
    ((y * r).sum() + 0.3 * m.l1).backward()
    return [y.detach(), m.l1.detach(), xi.grad] + [p.grad for p in m.parameters()]


@pytest.mark.parametrize("cls,kernels,use_checkpoint", [
    pytest.param(SparseGatedMLP, "sparse", False, id="gated-sparse", marks=pytest.mark.slow),
    pytest.param(SparseGatedMLP, "sparse", True, id="gated-sparse-checkpoint"),
    pytest.param(SparseGatedMLP, "dense", False, id="gated-dense"),
    pytest.param(SparseMLP, "sparse", False, id="plain-sparse"),
    pytest.param(SparseMLP, "dense", True, id="plain-dense-checkpoint")])
def test_compiled_training_step_equals_eager(cls, kernels, use_checkpoint, small_blocks):
    """torch.compile(fullgraph=True, inductor) of a module forced to the sparse kernels (heavy
    rows present) or to the fused dense op, also under activation checkpointing: it trains on
    that path, and y, the L1 term, the gradient of x and of every weight, and the statistics
    are eager's to fp32 rounding."""
    eager, compiled = _pair(cls, kernels)
    x = torch.randn(3, 3, D, generator=torch.Generator().manual_seed(1)).to(DEV)
    x[..., 0] = 1.0
    x[0, 2, 0] = -40.0  # a heavy row
    r = torch.randn(3, 3, D, generator=torch.Generator().manual_seed(2)).to(DEV)
    torch._dynamo.reset()
    fn = torch.compile(compiled, fullgraph=True, backend="inductor")
    got = _step(fn, compiled, x, r, use_checkpoint)
    want = _step(eager, eager, x, r, use_checkpoint)
    assert eager.last_train_path == compiled.last_train_path == kernels
    for name, a, b in zip(["y", "l1", "dx"] + [n for n, _ in eager.named_parameters()], got, want):
        assert rel_err(a, b) < 1e-5, (name, rel_err(a, b))
    assert torch.equal(compiled.stats.unit_counts, eager.stats.unit_counts)
    assert int(compiled.stats.active_max) == int(eager.stats.active_max) == F
    if not use_checkpoint:
        # (A checkpoint's recomputation of a compiled module runs its whole graph again, its
        # fire_counts update included; eager recomputation stops once the op has saved.)
        assert torch.equal(compiled.fire_counts, eager.fire_counts) and int(compiled.tokens_seen) == 9


def test_compiled_plain_dense_path_is_the_pytorch_ops(monkeypatch):
    """With train_kernels "dense" and FUSED_DENSE off a compiled module trains on its PyTorch ops
    (no twell op in the graph, for the compiler to fuse), with eager's output, L1 term,
    gradients and statistics."""
    monkeypatch.setattr(train_path, "FUSED_DENSE", False)
    eager, compiled = _pair(SparseGatedMLP, "dense")
    x = torch.randn(2, 4, D, generator=torch.Generator().manual_seed(5)).to(DEV)
    r = torch.randn(2, 4, D, generator=torch.Generator().manual_seed(6)).to(DEV)
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    got = _step(torch.compile(compiled, fullgraph=True, backend=backend), compiled, x, r)
    want = _step(eager, eager, x, r)
    assert len(graphs) == 1 and "twell" not in graphs[0].code
    for name, a, b in zip(["y", "l1", "dx"] + [n for n, _ in eager.named_parameters()], got, want):
        assert rel_err(a, b) < 1e-6, (name, rel_err(a, b))
    assert torch.equal(compiled.stats.unit_counts, eager.stats.unit_counts)
    assert torch.equal(compiled.fire_counts, eager.fire_counts)


@pytest.mark.parametrize("fullgraph", [True, False])
def test_no_graph_break_in_the_mlp(fullgraph):
    """One graph, the training op inside it, with or without fullgraph (without it dynamo would
    otherwise break the graph at an operator whose output sizes depend on data)."""
    m = SparseGatedMLP(D, F).to(DEV)
    m.train_kernels = "dense"
    x = torch.randn(2, 5, D, device=DEV, requires_grad=True)
    explained = torch._dynamo.explain(m)(x)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    (torch.compile(m, fullgraph=fullgraph, backend=backend)(x).sum() + m.l1).backward()
    assert len(graphs) == 1 and "twell.train_ffn_fwd" in graphs[0].code and m.last_train_path == "dense"


def test_compiled_under_autocast_finds_its_layer():
    """Under autocast the op computes with bf16 copies of the weights; the module's own weight
    names the layer (no warning, the layer's path is noted) and the gradients reach the fp32
    weights as eager's do."""
    eager, compiled = _pair(SparseGatedMLP, "dense")
    x = torch.randn(2, 4, D, generator=torch.Generator().manual_seed(3)).to(DEV)
    r = torch.randn(2, 4, D, generator=torch.Generator().manual_seed(4)).to(DEV)
    torch._dynamo.reset()
    fn = torch.compile(compiled, fullgraph=True, backend="aot_eager")
    results = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for f, m in ((fn, compiled), (eager, eager)):
            with torch.autocast(DEV, dtype=torch.bfloat16):
                results.append(_step(f, m, x, r))
    assert compiled.last_train_path == "dense"
    for a, b in zip(*results):
        assert a.dtype == b.dtype and rel_err(a, b) < 1e-5
    assert all(p.grad.dtype == torch.float32 for p in compiled.parameters())


@pytest.mark.slow
def test_one_graph_serves_every_layer_and_choice(small_blocks, monkeypatch):
    """Layers compiled one by one (regional compilation) share one graph, while each takes its
    own path and width at run time: dense, sparse at W, sparse at 2 W (the op's output sizes
    differ: no recompilation)."""
    from torch._dynamo.utils import counters

    layers = [_pair(SparseGatedMLP, "sparse", seed=i)[0] for i in range(3)]
    choices = {id(layers[0]): ("dense", 16), id(layers[1]): ("sparse", W), id(layers[2]): ("sparse", 2 * W)}
    widths = []
    real_forward = T._forward
    monkeypatch.setattr(train_path, "call_choice", lambda module, tokens, is_cuda, **kw: choices[id(module)])
    monkeypatch.setattr(T, "_forward", lambda *a: widths.append(a[4]) or real_forward(*a))
    for m in layers:
        m.compile(backend="aot_eager", fullgraph=True)
    x = torch.randn(7, D, generator=torch.Generator().manual_seed(5)).to(DEV)
    x[:, 0] = 1.0
    torch._dynamo.reset()
    counters.clear()
    for m in layers:
        h = torch.relu(x @ m.gate_proj.weight.T) * (x @ m.up_proj.weight.T)
        y = m(x.clone().requires_grad_())
        assert rel_err(y, h @ m.down_proj.weight.T) < 1e-5 and rel_err(m.l1, h.abs().sum(1).mean()) < 1e-5
    assert [m.last_train_path for m in layers] == ["dense", "sparse", "sparse"]
    assert [w for w in widths if w != train_path.LAYER_CHOICE] == [0, W, 2 * W]
    assert counters["stats"]["unique_graphs"] == 1


# --- twell train --compile -------------------------------------------------------------------


def test_compile_setting_is_checked_without_torch():
    from twell.recipe.config import TrainConfig

    with pytest.raises(ValueError, match="compile must be true or false"):
        TrainConfig(compile="yes").resolved()


@pytest.fixture
def dynamo_option_kept():
    """The trainer sets a dynamo option for --compile with --grad-checkpointing: restored after
    the test (by hand: monkeypatch would delete it, which hides a dynamo option)."""
    import torch._dynamo as dynamo

    name = "skip_fwd_side_effects_in_bwd_under_checkpoint"
    value = getattr(dynamo.config, name)
    yield
    setattr(dynamo.config, name, value)


@pytest.mark.slow
@pytest.mark.parametrize("grad_checkpointing", [False, True])
def test_compiled_trainer_step_equals_eager(tmp_path, grad_checkpointing, dynamo_option_kept, monkeypatch):
    """A trainer step with each decoder layer compiled (the MLPs on the dense training op
    through the layer's choice, in the compiled graph), with and without activation
    checkpointing: the loss, the L1 term, every gradient and each layer's statistics are the
    eager trainer's."""
    from test_train_loss import config
    from twell.recipe.trainer import Trainer

    torch._dynamo.reset()
    calls = []
    real = T._layer_forward
    monkeypatch.setattr(T, "_layer_forward", lambda *a: calls.append(a[-1].data_ptr()) or real(*a))
    runs = []
    for compile in (False, True):
        t = Trainer(config(tmp_path, kernels="dense", compile=compile, grad_checkpointing=grad_checkpointing, l1=0.05,
                           batch_size=1, seq_len=8, device=DEV, precision="fp32"))
        ce, l1 = t.forward_backward()
        runs.append((ce, l1, {n: p.grad.clone() for n, p in t.model.named_parameters()},
                     [m.last_train_path for m in t.modules], [m.fire_counts.clone() for m in t.modules]))
    (ce, l1, grads, paths, fired), (ce_c, l1_c, grads_c, paths_c, fired_c) = runs
    assert paths == paths_c == ["dense", "dense"]
    assert len(set(calls)) == 2 and len(calls) == (4 if grad_checkpointing else 2)  # (recomputed: twice)
    assert rel_err(ce_c, ce) < 1e-5 and rel_err(l1_c, l1) < 1e-5
    for name, g in grads.items():
        assert rel_err(grads_c[name], g) < 1e-5, name
    for a, b in zip(fired_c, fired):
        assert torch.equal(a, b)  # counted once, under checkpointing too


@pytest.mark.slow
def test_train_compile_two_steps(tmp_path, monkeypatch, dynamo_option_kept):
    """``twell train --compile`` (tiny preset, shrunk model; the dense training op forced, with
    activation checkpointing): two steps with a finite loss, every MLP call going through the
    custom op's layer choice inside the compiled layers."""
    from test_train_cli import FAST
    from twell.cli import main
    from twell.recipe.report import read_history

    layers = []
    real = T._layer_forward
    monkeypatch.setattr(T, "_layer_forward", lambda *a: layers.append(a[-1].data_ptr()) or real(*a))
    main(["train", *FAST, "--steps", "2", "--log-every", "1", "--compile", "--kernels", "dense",
          "--grad-checkpointing", "--out", str(tmp_path)])
    rows = read_history(tmp_path / "log.csv")
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss"]) for r in rows)
    assert len(set(layers)) == 2  # both layers' MLPs, in the compiled graph's op

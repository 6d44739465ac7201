"""SparseGatedMLP / SparseMLP: drop-in for LlamaMLP, statistics, L1 term, dead units."""

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP

from sparsity import rel_err
from twell import SparseGatedMLP, SparseMLP, l1_loss, sparse_modules
from twell import reference as ref


def llama_mlp(d=24, f=50, bias=False):
    cfg = LlamaConfig(hidden_size=d, intermediate_size=f, num_attention_heads=4, hidden_act="relu", mlp_bias=bias)
    return LlamaMLP(cfg).double()


@pytest.mark.parametrize("bias", [False, True])
def test_loads_llama_mlp_state_dict_and_matches_relu_llama(bias):
    torch.manual_seed(0)
    dense = llama_mlp(bias=bias)
    sparse = SparseGatedMLP(24, 50, bias=bias).double()
    sparse.load_state_dict(dense.state_dict())  # strict: same names and layouts
    assert sparse.gate_proj.weight.shape == (50, 24) and sparse.down_proj.weight.shape == (24, 50)
    x = torch.randn(3, 5, 24, dtype=torch.float64)
    assert rel_err(sparse(x), dense(x)) < 1e-12
    assert sparse(x).shape == (3, 5, 24)


def test_state_dict_has_only_the_llama_names():
    assert set(SparseGatedMLP(8, 16).state_dict()) == {"gate_proj.weight", "up_proj.weight", "down_proj.weight"}
    assert set(SparseMLP(8, 16).state_dict()) == {"up_proj.weight", "down_proj.weight"}


def test_stats_match_the_pattern():
    torch.manual_seed(1)
    mlp = SparseGatedMLP(16, 40).double()
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    x[0, 0] = 0.0  # a token with no active unit
    mlp(x)
    active = (x.reshape(-1, 16) @ mlp.gate_proj.weight.T) > 0
    s = mlp.stats
    assert s.tokens == 14
    assert s.active_mean.item() == pytest.approx(active.sum(1).double().mean().item())
    assert s.active_max.item() == active.sum(1).max().item()
    assert torch.equal(s.unit_counts, active.sum(0))
    mlp(x[:1])
    assert torch.equal(mlp.fire_counts, active.sum(0) + active[:7].sum(0))
    assert mlp.tokens_seen.item() == 21


def test_l1_term_and_its_gradient():
    torch.manual_seed(2)
    mlp = SparseGatedMLP(12, 30).double().train()
    x = torch.randn(9, 12, dtype=torch.float64)
    mlp(x)
    h = torch.relu(mlp.gate_proj(x)) * mlp.up_proj(x)
    assert mlp.l1.item() == pytest.approx(ref.l1_penalty(h).item())
    (w_grad,) = torch.autograd.grad(ref.l1_penalty(h), [mlp.up_proj.weight])
    (got,) = torch.autograd.grad(l1_loss(mlp), [mlp.up_proj.weight])
    assert rel_err(got, w_grad) < 1e-12
    # no L1 graph in eval mode or without grad
    mlp.eval()
    mlp(x)
    assert mlp.l1 is None
    with torch.no_grad():
        mlp.train()(x)
    assert mlp.l1 is None


def test_l1_loss_averages_layers():
    torch.manual_seed(3)
    model = torch.nn.Sequential(SparseGatedMLP(8, 20), SparseMLP(8, 20)).train()
    model(torch.randn(4, 8))
    a, b = sparse_modules(model)
    assert l1_loss(model).item() == pytest.approx((a.l1.item() + b.l1.item()) / 2)


def test_dead_units_and_reinit():
    torch.manual_seed(4)
    mlp = SparseGatedMLP(8, 20)
    with torch.no_grad():
        mlp.gate_proj.weight[:5] = -mlp.gate_proj.weight[:5].abs()  # units 0..4 never fire for x >= 0
    before = mlp.gate_proj.weight.detach().clone()
    mlp(torch.rand(50, 8))
    dead = mlp.dead_units()
    assert dead[:5].all()
    reinit = mlp.reinit_dead_units(generator=torch.Generator().manual_seed(0))
    assert torch.equal(reinit, dead)
    after = mlp.gate_proj.weight.detach()
    assert torch.equal(after[~dead], before[~dead])
    noise = (after[dead] - 0.9 * before[dead]) / 0.1
    assert not torch.equal(after[dead], before[dead])
    assert 0.005 < noise.std().item() < 0.05  # N(0, 0.02^2)
    mlp.reset_fire_counts()
    assert mlp.dead_units().all() and mlp.tokens_seen.item() == 0
    # an explicit mask overrides the module's own counters
    mask = torch.zeros(20, dtype=torch.bool)
    mask[7] = True
    w = mlp.gate_proj.weight.detach().clone()
    assert torch.equal(mlp.reinit_dead_units(mask=mask), mask)
    changed = (mlp.gate_proj.weight.detach() != w).any(dim=1)
    assert changed.tolist() == mask.tolist()


def test_non_gated_matches_reference():
    torch.manual_seed(5)
    mlp = SparseMLP(10, 33).double()
    x = torch.randn(4, 3, 10, dtype=torch.float64)
    y = mlp(x)
    expected = ref.mlp(x.reshape(-1, 10), mlp.up_proj.weight, mlp.down_proj.weight).reshape(4, 3, 10)
    assert rel_err(y, expected) < 1e-12
    assert torch.equal(mlp.stats.unit_counts, (mlp.up_proj(x.reshape(-1, 10)) > 0).sum(0))


def test_stats_can_be_turned_off_and_empty_batches_work():
    mlp = SparseGatedMLP(8, 16)
    assert mlp.track_stats is None and mlp._tracking()  # default: on in training mode
    assert not mlp.eval()._tracking() and mlp.train()._tracking()
    mlp.track_stats = False
    mlp(torch.randn(3, 8))
    assert mlp.stats is None
    mlp.track_stats = True
    y = mlp(torch.randn(0, 8))
    assert y.shape == (0, 8) and mlp.stats.tokens == 0


@pytest.mark.parametrize("cls", [SparseGatedMLP, SparseMLP])
def test_eval_drops_empty_stat_buffers(cls):
    """A module switched to eval mode before it recorded anything keeps no statistics buffers
    (a served model's memory); they come back zeroed when a call records statistics or in
    training mode, and eval keeps them once they hold counts (or when asked to track)."""
    torch.manual_seed(12)
    m = cls(8, 16).double()
    names = {n for n, _ in m.named_buffers()}
    assert names == {"fire_counts", "tokens_seen"}
    m.eval()
    assert m.fire_counts is None and m.tokens_seen is None and not list(m.named_buffers())
    assert m.dead_units().tolist() == [True] * 16  # nothing seen: every unit
    x = torch.randn(5, 8, dtype=torch.float64)
    m(x)  # not tracked in eval mode: still nothing
    assert m.fire_counts is None and m.state_dict().keys() == cls(8, 16).state_dict().keys()
    m.track_stats = True
    m(x)
    first = m.gate_proj(x) if cls is SparseGatedMLP else m.up_proj(x)
    assert m.fire_counts.dtype == torch.int64 and torch.equal(m.fire_counts, (first > 0).sum(0)) and int(m.tokens_seen) == 5
    m.track_stats = None
    m.eval()  # counts recorded: kept
    assert int(m.tokens_seen) == 5
    m.reset_fire_counts()
    m.eval()  # emptied by the reset: dropped again
    assert m.fire_counts is None
    m.train()
    assert torch.equal(m.fire_counts, torch.zeros(16, dtype=torch.int64)) and int(m.tokens_seen) == 0
    m.train()  # an empty window kept as it is
    m(x)
    assert int(m.tokens_seen) == 5
    m.reset_fire_counts()
    m.track_stats = True
    m.eval()  # asked to track in eval mode: kept, though empty
    assert m.fire_counts is not None


@pytest.mark.parametrize("module", [SparseGatedMLP(8, 16), SparseMLP(8, 16)])
def test_bad_inputs(module):
    with pytest.raises(ValueError, match=r"\[\.\.\., 8\]"):
        module(torch.randn(3, 7))
    with pytest.raises(TypeError, match="floating"):
        module(torch.ones(3, 8, dtype=torch.long))
    with pytest.raises(TypeError, match="torch.Tensor"):
        module([[0.0] * 8])
    with pytest.raises(TypeError, match="float64 but the module's weights are torch.float32"):
        module(torch.randn(3, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="meta but the module's weights are on cpu"):
        module(torch.randn(3, 8, device="meta"))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast casts: no error
        assert module(torch.randn(3, 8, dtype=torch.bfloat16)).shape == (3, 8)



@pytest.mark.parametrize("cls", [SparseGatedMLP, SparseMLP])
@pytest.mark.parametrize("path", ["decode", "prefill", "train-sparse", "train-dense"])
def test_forced_kernel_paths_leave_meta_and_float64_to_the_dense_math(cls, path):
    """Under the interpreter with a kernel path forced: a meta module gives a meta result (it
    raised from torch.is_autocast_enabled("meta")), a float64 one the dense answer."""
    def forced(m):
        if path.startswith("train"):
            m.train_kernels = path[6:]
        else:
            m.eval().kernel_mode = path
        return m

    y = forced(cls(8, 16, device="meta"))(torch.randn(3, 8, device="meta"))
    assert y.is_meta and y.shape == (3, 8)
    m = forced(cls(8, 16).double())
    x = torch.randn(3, 8, dtype=torch.float64)
    w = [m.gate_proj.weight] if cls is SparseGatedMLP else []
    want = (ref.gated_mlp if w else ref.mlp)(x, *w, m.up_proj.weight, m.down_proj.weight)
    with torch.set_grad_enabled(path.startswith("train")):
        assert rel_err(m(x), want) < 1e-10


@pytest.mark.parametrize("cls", [SparseGatedMLP, SparseMLP])
@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_a_projection_changed_alone_is_refused_on_the_kernel_paths(cls, mode):
    """The inference kernels read rows of the weights unchecked: a first projection cast or
    replaced on its own got a Triton error, or a read past the other weights' end."""
    m = cls(8, 16).eval()
    m.kernel_mode = mode
    first = m.gate_proj if cls is SparseGatedMLP else m.up_proj
    first.half()
    with torch.no_grad(), pytest.raises(TypeError, match=r"w_first \(torch.float16, cpu\) must match x"):
        m(torch.randn(3, 8))
    first.weight = torch.nn.Parameter(torch.randn(17, 8))
    with torch.no_grad(), pytest.raises(ValueError, match=r"must be \[f, d\] = \[17, 8\], got \[16, 8\]"):
        m(torch.randn(3, 8))


def test_dispatcher_hysteresis():
    """Near the threshold a layer keeps its branch: on the kernels it stays up to 5% past the
    threshold, on dense it needs the threshold itself (the two branches estimate differently)."""
    from twell.inference.dispatch import PREFILL_MIN_M

    p = SparseGatedMLP(8, 16)._twell_layer
    f, M = 1000, 1 << 30  # M large: no tail term
    assert M >= PREFILL_MIN_M
    limit = p.DEFAULT_MAX_DENSITY * f
    choose = lambda: p.choose(M, f, "auto", None, False)  # noqa: E731
    p.estimate = (limit * 1.03, 0.0)
    assert choose() == "dense"  # from dense, 3% over: stays dense
    p.estimate = (limit * 0.99, 0.0)
    assert choose() == "prefill"
    p.estimate = (limit * 1.03, 0.0)
    assert choose() == "prefill"  # on the kernels, 3% over: stays
    p.estimate = (limit * 1.06, 0.0)
    assert choose() == "dense"
    p.estimate = (limit * 1.03, 0.0)
    assert choose() == "dense"


def test_a_unit_that_fired_once_is_not_dead():
    m = SparseGatedMLP(2, 3)
    with torch.no_grad():
        m.gate_proj.weight.copy_(torch.tensor([[1.0, 0.0], [-1.0, 0.0], [0.0, 1.0]]))
    m(torch.tensor([[1.0, 1.0]]))  # units 0 and 2 fire once, unit 1 never
    assert m.fire_counts.tolist() == [1, 0, 1]
    assert m.dead_units().tolist() == [False, True, False]


def test_the_inference_path_clears_the_l1_term():
    """A training call leaves ``l1``; an inference call (here a forced kernel path) clears it, so
    that no stale term from an earlier batch reaches a loss."""
    m = SparseGatedMLP(16, 40)
    m(torch.randn(4, 16))
    assert m.l1 is not None
    m.eval().kernel_mode = "decode"
    with torch.no_grad():
        m(torch.randn(2, 16))
    assert m.last_path == "decode" and m.l1 is None


def test_repr_names_the_sizes():
    assert "hidden_size=8, intermediate_size=16, gate=relu" in repr(SparseGatedMLP(8, 16))
    assert "hidden_size=8, intermediate_size=16, act=relu" in repr(SparseMLP(8, 16))


def test_a_module_can_be_copied_after_a_training_forward():
    """An EMA copy or a pickle taken mid-training: the last forward's L1 term is a non-leaf
    tensor of that forward's graph, which deepcopy refuses; the copy drops it (it ran no forward),
    the original keeps it, and both compute the same outputs."""
    import copy
    import io

    torch.manual_seed(6)
    m = SparseGatedMLP(8, 24)
    x = torch.randn(5, 8)
    m(x)
    assert m.l1 is not None and m.l1.requires_grad
    c = copy.deepcopy(m)
    assert c.l1 is None and m.l1 is not None
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert loaded.l1 is None
    for other in (c, loaded):
        torch.testing.assert_close(other(x), m(x), rtol=0, atol=0)


def test_path_settings_are_checked_when_set():
    """kernel_mode and train_kernels are read only on kernel paths (CUDA, or the interpreter):
    a typo must fail where it is made, on any device."""
    m = SparseGatedMLP(8, 24)
    with pytest.raises(ValueError, match="kernel_mode must be one of"):
        m.kernel_mode = "fast"
    with pytest.raises(ValueError, match="train_kernels must be one of"):
        m.train_kernels = "Dense"
    m.kernel_mode, m.train_kernels = "prefill", "sparse"
    assert (m.kernel_mode, m.train_kernels) == ("prefill", "sparse")


def test_submodules_load_on_first_use():
    """The README's settings live in submodules (twell.inference.eager_graphs.ENABLED, twell.inference.dispatch...):
    reachable right after `import twell`, in a fresh interpreter."""
    import subprocess
    import sys

    code = ("import twell; twell.inference.eager_graphs.ENABLED = False; print(twell.inference.ops.__name__, twell.inference.dispatch.MODES[0]); "
            "print(hasattr(twell, 'no_such_module'), hasattr(twell, 'eager_graphs.x'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["twell.inference.ops", "auto", "False", "False"]
    # a dependency missing (triton here): hasattr says False rather than raising
    code = "import sys; sys.modules['triton'] = None; import twell; print(hasattr(twell, 'kernels'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["False"], out.stderr[-2000:]


@pytest.mark.parametrize("cls", [SparseGatedMLP, SparseMLP])
def test_l1_of_a_call_without_tokens_is_zero_on_the_dense_path(cls):
    """The dense math (CPU, float64, biases, hooks) took the mean over no tokens: NaN, which
    l1_loss carried into the whole loss. The training ops give 0; so does the dense path now,
    with a gradient (zeros) for the weights."""
    torch.manual_seed(0)
    m = cls(8, 16, bias=True).double()
    y = m(torch.randn(2, 0, 8, dtype=torch.float64))
    assert y.shape == (2, 0, 8) and m.l1 is not None and float(m.l1) == 0.0
    assert float(l1_loss(m)) == 0.0
    (y.sum() + m.l1).backward()
    assert all(p.grad is not None and not p.grad.isnan().any() for p in m.parameters())


@pytest.mark.parametrize("cls", [SparseGatedMLP, SparseMLP])
@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_one_hidden_feature_on_the_kernel_paths(cls, mode, monkeypatch):
    """hidden_size 1: down_proj.weight [1, f] is already "the transpose of a contiguous [f, 1]"
    (torch ignores the stride of a size-1 dimension), and the kernels' checks asked that [f, 1]
    view for a unit column stride it does not need: a ValueError instead of the result."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.manual_seed(0)
    m = cls(1, 16).eval()
    m.kernel_mode = mode
    x = torch.randn(5, 1)
    with torch.no_grad():
        y = m(x)
        m.kernel_mode = "dense"
        assert m.last_path == mode and rel_err(y, m(x)) < 1e-6


@pytest.mark.parametrize("name", ["kernel_max_density", "train_max_density"])
def test_density_settings_are_numbers(name):
    """A string was accepted and compared against floats only on a kernel path (on the GPU)."""
    m = SparseGatedMLP(8, 16)
    for bad in ("0.5", float("nan"), -0.1, True, torch.tensor(0.5)):
        with pytest.raises(ValueError, match=f"{name} must be None or a number >= 0"):
            setattr(m, name, bad)
    for good in (None, 0, 0.02, 1.5):
        setattr(m, name, good)
        assert getattr(m, name) == good
    with pytest.raises(ValueError, match="track_stats must be None, True or False"):
        m.track_stats = "yes"


def test_reinit_dead_units_refuses_a_mask_of_the_wrong_shape():
    m = SparseGatedMLP(8, 16)
    with pytest.raises(ValueError, match=r"mask must be \[16\] \(one entry per unit\), got \(10,\)"):
        m.reinit_dead_units(mask=torch.ones(10, dtype=torch.bool))
    with pytest.raises(ValueError, match="mask must be"):
        m.reinit_dead_units(mask=torch.ones(1, 16, dtype=torch.bool))  # broadcast over the rows before
    w = m.gate_proj.weight.detach().clone()
    assert not m.reinit_dead_units(mask=torch.zeros(16, dtype=torch.int64)).any()  # 0/1 ints: a mask
    assert torch.equal(m.gate_proj.weight, w)


@pytest.mark.parametrize("cls", [SparseGatedMLP, SparseMLP])
@pytest.mark.parametrize("mode", ["train", "auto", "prefill", "decode"])
def test_modules_with_d_or_f_zero(cls, mode):
    """d = 0 failed in ``reshape(-1, 0)``; f = 0 gives y = 0 on every path."""
    for d, f in ((0, 16), (8, 0)):
        m = cls(d, f)
        if mode == "train":
            x = torch.randn(2, 3, d, requires_grad=True)
            y = m(x)
            (y.sum() + m.l1).backward()
            assert y.shape == (2, 3, d) and x.grad.shape == x.shape and float(m.l1) == 0.0
        else:
            m.eval().kernel_mode = mode
            with torch.no_grad():
                y = m(torch.randn(300, d))
            assert y.shape == (300, d) and not y.any()


@pytest.mark.parametrize("module", [SparseGatedMLP(8, 16), SparseMLP(8, 16)])
def test_a_scalar_input_gets_the_shape_error(module):
    """A 0-d input has no last dimension: the clear ValueError, not an IndexError from x.shape[-1]."""
    with pytest.raises(ValueError, match=r"\[\.\.\., 8\]"):
        module(torch.tensor(1.0))


@pytest.mark.parametrize("cls", [SparseGatedMLP, SparseMLP])
def test_training_mode_with_frozen_weights_takes_the_dense_math(cls, monkeypatch):
    """In training mode with grad enabled the call is a training call even when no weight needs
    a gradient (a frozen FFN): it computes the L1 term and takes no inference kernel."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    m = cls(8, 16).train()
    m.kernel_mode = "decode"
    m.requires_grad_(False)
    m(torch.randn(3, 8))
    assert m.last_path is None and m.l1 is not None


@pytest.mark.parametrize("cls", [SparseGatedMLP, SparseMLP])
def test_eval_mode_with_one_trainable_projection_gets_its_gradient(cls, monkeypatch):
    """In eval mode with grad enabled, any one projection that requires grad keeps the call off
    the inference kernels (which have no backward), whichever projection it is."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.manual_seed(7)
    names = ["gate_proj", "up_proj", "down_proj"] if cls is SparseGatedMLP else ["up_proj", "down_proj"]
    for name in names:
        m = cls(8, 16).eval()
        m.kernel_mode = "decode"
        m.requires_grad_(False)
        getattr(m, name).weight.requires_grad_(True)
        m(torch.randn(3, 8)).square().sum().backward()
        assert m.last_path is None and getattr(m, name).weight.grad is not None, name


@pytest.mark.parametrize("cls", [SparseGatedMLP, SparseMLP])
def test_training_kernels_in_eval_mode_leave_no_l1_term(cls, monkeypatch):
    """Gradients in eval mode (weights requiring grad) may take the training kernels; the L1
    term is a training-mode quantity there as on the dense path: None."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    m = cls(16, 40).eval()
    m.train_kernels = "sparse"
    m(torch.randn(4, 16)).sum().backward()
    assert m.last_train_path == "sparse" and m.l1 is None


@pytest.mark.parametrize("cls", [SparseGatedMLP, SparseMLP])
def test_biases_keep_training_calls_off_the_training_kernels(cls, monkeypatch):
    """The training kernels have no bias terms: a module with biases takes the dense math even
    with train_kernels forced, and its output includes the biases."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.manual_seed(8)
    m = cls(8, 16, bias=True)
    m.train_kernels = "sparse"
    x = torch.randn(5, 8)
    y = m(x)
    F = torch.nn.functional
    if cls is SparseGatedMLP:
        h = torch.relu(F.linear(x, m.gate_proj.weight, m.gate_proj.bias)) * F.linear(x, m.up_proj.weight, m.up_proj.bias)
    else:
        h = torch.relu(F.linear(x, m.up_proj.weight, m.up_proj.bias))
    assert m.last_train_path is None
    assert rel_err(y, F.linear(h, m.down_proj.weight, m.down_proj.bias)) < 1e-5


@pytest.mark.parametrize("bias", [False, True])
def test_from_config_takes_sizes_and_mlp_bias(bias):
    cfg = LlamaConfig(hidden_size=8, intermediate_size=20, num_attention_heads=2, mlp_bias=bias)
    m = SparseGatedMLP.from_config(cfg)
    assert (m.hidden_size, m.intermediate_size) == (8, 20) and m.down_proj.weight.shape == (8, 20)
    assert all((p.bias is not None) == bias for p in (m.gate_proj, m.up_proj, m.down_proj))
    m.load_state_dict(LlamaMLP(cfg).state_dict())  # strict: the same names, biases included


@pytest.mark.parametrize("cls", [SparseGatedMLP, SparseMLP])
def test_old_pickles_keep_their_counts_in_eval(cls):
    """A module pickled before train_kernels, train_max_density and the recorded-counts flag
    existed: the settings take their defaults, and its counts (of unknown age) are never
    dropped by eval() unasked."""
    torch.manual_seed(9)
    m = cls(8, 16)
    m(torch.randn(6, 8))
    state = m.__getstate__()
    for key in ("train_kernels", "train_max_density", "_stats_recorded"):
        del state[key]
    old = cls.__new__(cls)
    old.__setstate__(state)
    assert old.train_kernels == "auto" and old.train_max_density is None
    old.eval()
    assert old.fire_counts is not None and torch.equal(old.fire_counts, m.fire_counts) and int(old.tokens_seen) == 6


@pytest.mark.parametrize("cls", [SparseGatedMLP, SparseMLP])
def test_stat_buffers_come_back_on_the_weights_device(cls):
    """Buffers dropped in eval mode are made again on the weights' device (here meta, after a
    move), not on the default device."""
    m = cls(8, 16).eval()
    assert m.fire_counts is None
    m.to("meta").train()
    assert m.fire_counts.device.type == "meta" and m.tokens_seen.device.type == "meta"

"""The modules' training path: SparseGatedMLP / SparseMLP on the sparse training kernels give
dense autograd's outputs, L1 term, statistics and gradients (Triton interpreter on the CPU), and
the per-layer choice between dense and sparse (twell.training.path)."""

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from twell import SparseGatedMLP, SparseMLP
from twell.training.path import HEAVY_COST, HEAVY_FIXED, HEAVY_SHARE_MAX, MAX_DENSITY, PROBE_WIDTHS, TrainPath, light_rule_width, use_sparse


DEV = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the Triton interpreter


def _pair(cls, d=24, f=40, seed=0, kernels="sparse"):
    torch.manual_seed(seed)
    dense = cls(d, f).to(DEV)
    sparse = cls(d, f).to(DEV)
    sparse.load_state_dict(dense.state_dict())
    with torch.no_grad():  # about a quarter of the units fire: a real pattern, light and heavy rows
        dense._first_projection().weight.add_(-0.15)
        sparse._first_projection().weight.copy_(dense._first_projection().weight)
    sparse.train_kernels = kernels
    return dense, sparse


@pytest.mark.parametrize("cls", [SparseGatedMLP, SparseMLP])
@pytest.mark.parametrize("use_checkpoint", [False, True])
@pytest.mark.parametrize("kernels", ["sparse", "dense"])
def test_module_on_the_training_kernels_equals_dense(cls, use_checkpoint, kernels):
    """train_kernels "sparse" (the sparse kernels) and "dense" (the all-rows-dense op with its
    fused passes) against the module's plain PyTorch math (its path on the CPU without a choice)."""
    dense, sparse = _pair(cls, kernels=kernels)
    x = torch.randn(3, 7, 24, device=DEV)
    r = torch.randn(3, 7, 24, device=DEV)
    lam = 0.3  # large: a wrong L1 gradient shows
    grads = []
    for m in (dense, sparse):
        m.train()
        xi = x.clone().requires_grad_(True)
        y = checkpoint(m, xi, use_reentrant=False) if use_checkpoint else m(xi)
        ((y * r).sum() + lam * m.l1).backward()
        grads.append([xi.grad] + [p.grad for p in m.parameters()])
        m.out = y.detach()
    assert sparse.last_train_path == kernels and dense.last_train_path in (None, "dense")
    torch.testing.assert_close(sparse.out, dense.out, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads[1], grads[0]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(sparse.stats.unit_counts, dense.stats.unit_counts)
    torch.testing.assert_close(sparse.stats.active_mean, dense.stats.active_mean)
    assert int(sparse.stats.active_max) == int(dense.stats.active_max)
    assert torch.equal(sparse.fire_counts, dense.fire_counts)


def test_module_on_the_training_kernels_with_heavy_rows_and_hot_units(monkeypatch):
    """A narrow ELL width (rows heavier than it take the dense backup) and a low hot-unit bar
    (units far above the mean take the dense columns), under activation checkpointing: still
    dense autograd's gradients."""
    import twell.training.ops as T

    monkeypatch.setattr(T, "HOT_MIN", 2)
    monkeypatch.setattr(T, "HOT_FACTOR", 1.5)
    dense, sparse = _pair(SparseGatedMLP, seed=3)
    calls = []
    add_hot = T._add_hot
    monkeypatch.setattr(T, "_add_hot", lambda *a: calls.append(a[1].numel()) or add_hot(*a))
    with torch.no_grad():  # unit 0 fires for every token: hot
        for m in (dense, sparse):
            m.gate_proj.weight[0] = 0.0
    x = torch.randn(2, 9, 24, device=DEV)
    x[..., 0] = 1.0
    with torch.no_grad():
        for m in (dense, sparse):
            m.gate_proj.weight[0, 0] = 5.0
    state = sparse._twell_train
    state.k_mean, state.width = 4.0, 8  # as if measured: W = 8
    counts = (x.reshape(-1, 24) @ sparse.gate_proj.weight.T > 0).sum(1)
    assert int((counts > 8).sum()) > 0 and int((counts <= 8).sum()) > 0
    r = torch.randn(2, 9, 24, device=DEV)
    grads = []
    for m in (dense, sparse):
        m.train()
        xi = x.clone().requires_grad_(True)
        y = checkpoint(m, xi, use_reentrant=False)
        ((y * r).sum() + 0.3 * m.l1).backward()
        grads.append([xi.grad] + [p.grad for p in m.parameters()])
    assert sparse.last_train_path == "sparse" and calls and calls[0] >= 1  # the hot-unit path ran
    for a, b in zip(grads[1], grads[0]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_old_pickles_and_float64_train_dense():
    """A module pickled before train_kernels existed trains after loading; a float64 module
    asked for the sparse kernels (which take fp32/fp16/bf16) trains on the dense math."""
    import pickle

    m = SparseGatedMLP(8, 16)
    state = m.__getstate__()
    for key in ("train_kernels", "train_max_density"):
        state.pop(key)
    old = SparseGatedMLP.__new__(SparseGatedMLP)
    old.__setstate__(state)
    assert old.train_kernels == "auto"
    old(torch.randn(3, 8)).sum().backward()
    m64 = pickle.loads(pickle.dumps(m)).double()
    m64.train_kernels = "sparse"
    m64(torch.randn(3, 8, dtype=torch.float64)).sum().backward()
    assert m64.last_train_path is None


def test_l1_only_in_training_mode_and_no_path_without_gradients():
    _, sparse = _pair(SparseGatedMLP)
    sparse.eval()
    x = torch.randn(5, 24, device=DEV, requires_grad=True)
    sparse(x).sum().backward()  # eval mode, grads wanted: the training kernels, no L1 term
    assert sparse.l1 is None and sparse.last_train_path == "sparse"
    sparse.train()
    with torch.no_grad():
        sparse(torch.randn(5, 24, device=DEV))
    assert sparse.l1 is None


def test_train_path_choice():
    tp = TrainPath()
    assert tp.choose("auto", 5632) == ("dense", 16)  # nothing measured yet
    assert tp.choose("dense", 5632)[0] == "dense"
    assert tp.choose("sparse", 5632) == ("sparse", 64)
    with pytest.raises(ValueError, match="train_kernels"):
        tp.choose("fast", 5632)
    assert use_sparse(29, 5632) and not use_sparse(280, 5632) and use_sparse(280, 5632, max_density=0.06)
    assert use_sparse(29, 5632, heavy_share=0.1) and not use_sparse(29, 5632, heavy_share=0.5)
    assert tp.want_probe()
    tp.publish(torch.tensor([3, 4]), 5632)  # CPU tensors: nothing to copy asynchronously, no state change
    assert tp.want_probe() and tp.k_mean is None


def test_device_width_is_choose_width():
    """The width the heavy share is measured against, computed on the device, is the width the
    layer will train with."""
    from twell.training.ops import choose_width
    from twell.training.path import device_width

    for f in (10, 96, 5632):
        for mean in [0.0, 0.3, 0.5, 1.0, 7.49, 7.5, 7.51, 8.0, 8.01, 23.9, 24.0, 29.3, 100.0, 255.9, 256.1, 600.0]:
            assert int(device_width(torch.tensor(mean), f)) == choose_width(mean, None, f), (mean, f)


@pytest.mark.parametrize("mean,share,path", [(29.0, 0.1, "sparse"), (29.0, 0.5, "dense"), (60.0, 0.0, "dense")])
def test_train_path_reads_mean_and_heavy_share(mean, share, path):
    """"auto" goes sparse on a measured mean at most MAX_DENSITY f and a share of rows above the
    ELL width of that mean at most HEAVY_SHARE_MAX (read from the pinned copy once its event is
    done)."""
    from twell.training.path import HEAVY_SHARE_MAX, MAX_DENSITY

    assert MAX_DENSITY * 5632 > 29 > 0 and 60 > MAX_DENSITY * 5632 and 0.1 < HEAVY_SHARE_MAX < 0.5

    class Done:
        def query(self):
            return True

    tp = TrainPath()
    tp._host, tp._event = torch.tensor([mean, 3 * mean, share]), Done()
    assert tp.choose("auto", 5632) == (path, 64 if mean == 29.0 else 128)
    assert tp.heavy_share == pytest.approx(share) and tp.k_max == int(3 * mean) and tp._event is None


def test_train_path_changes_only_outside_backward(monkeypatch):
    """A measurement that arrives while autograd recomputes a checkpointed forward must not
    change the path: the recomputation must save what the forward saved."""
    import twell.training.path as train_path

    class Done:
        def query(self):
            return True

    monkeypatch.setattr(train_path, "AUTO_SPARSE", False)
    tp = TrainPath()
    tp._host, tp._event = torch.tensor([29.0, 80.0, 0.0]), Done()
    assert tp.choose("auto", 5632) == ("dense", 64)  # switched off, auto trains dense whatever it measures
    assert tp.k_mean == 29.0
    monkeypatch.setattr(train_path, "AUTO_SPARSE", True)  # the default
    tp = TrainPath()
    tp._host, tp._event = torch.tensor([29.0, 80.0, 0.0]), Done()
    monkeypatch.setattr(train_path, "_in_backward", lambda: True)
    assert tp.choose("auto", 5632) == ("dense", 16)
    monkeypatch.setattr(train_path, "_in_backward", lambda: False)
    assert tp.choose("auto", 5632) == ("sparse", 64)
    assert (tp.k_mean, tp.k_max) == (29.0, 80)
    tp._host, tp._event = torch.tensor([300.0, 800.0, 0.0]), Done()
    assert tp.choose("auto", 5632)[0] == "dense"


def test_trainer_step_on_the_sparse_kernels_equals_dense(tmp_path):
    """twell train --kernels sparse: a training step's loss, L1 term and every gradient of the
    whole model equal those of --kernels dense (the Triton interpreter on the CPU)."""
    from test_train_loss import config

    from twell.recipe.trainer import Trainer

    runs = {}
    for kernels in ("auto", "dense", "sparse"):  # auto: on the CPU the plain PyTorch math
        # fp32 on the GPU too (its default is bf16 autocast): the two paths must agree to fp32 rounding
        t = Trainer(config(tmp_path, kernels=kernels, l1=0.05, batch_size=1, seq_len=8, device=DEV, precision="fp32"))
        assert all(m.train_kernels == kernels for m in t.modules)
        ce, l1 = t.forward_backward()
        runs[kernels] = (ce, l1, {n: p.grad.clone() for n, p in t.model.named_parameters()},
                         [m.last_train_path for m in t.modules])
    assert runs["sparse"][3] == ["sparse", "sparse"] and runs["dense"][3] == ["dense", "dense"]
    t.ce_acc, t.l1_acc, t.gn_acc, t.n_acc = torch.zeros(()), torch.zeros(()), torch.zeros(()), 1
    assert t._log_row(1.0)["sparse_layers"] == 2  # the log counts the layers on the sparse kernels
    for kernels in ("dense", "sparse"):
        torch.testing.assert_close(runs[kernels][0], runs["auto"][0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(runs[kernels][1], runs["auto"][1], rtol=1e-5, atol=1e-6)
        for name, g in runs["auto"][2].items():
            torch.testing.assert_close(runs[kernels][2][name], g, rtol=1e-4, atol=1e-6, msg=name)
    with pytest.raises(ValueError, match="kernels"):
        Trainer(config(tmp_path, kernels="fast"))


def test_compiled_training_runs_the_training_ops():
    """Under torch.compile (fullgraph) the module trains on twell's training op (the custom op
    twell::train_ffn_fwd, its layer choosing the path at run time): here the sparse kernels
    forced, and the gradients are dense autograd's."""
    dense, sparse = _pair(SparseGatedMLP, seed=5)
    sparse.train_kernels = "sparse"
    compiled = torch.compile(sparse, backend="eager", fullgraph=True)
    x = torch.randn(7, 24, device=DEV)
    grads = []
    for fn, m in ((dense, dense), (compiled, sparse)):
        m.train()
        xi = x.clone().requires_grad_(True)
        (fn(xi) * x).sum().backward()
        grads.append([xi.grad] + [p.grad for p in m.parameters()])
    assert sparse.last_train_path == "sparse"
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
def test_gpu_cuda_graph_capture_trains_dense_or_says_why(monkeypatch):
    """A training step captured in a CUDA graph (PyTorch's whole-network recipe: warm-up on a side
    stream, gradients set to None before the capture): on "auto" a layer that trains sparse
    eagerly takes the dense op inside the capture, and a replay gives eager's gradients; "sparse"
    forced raises one clear error before anything is recorded."""
    from twell.training import path as train_path

    monkeypatch.setattr(train_path, "MIN_SPARSE_TOKENS", 1)  # 40 tokens would train dense
    torch.manual_seed(0)
    m = SparseGatedMLP(64, 96).cuda()
    m.train()
    m.train_max_density = 1.0  # "auto" takes the sparse kernels at this layer's measured density
    x = torch.randn(40, 64, device="cuda")
    r = torch.randn(40, 64, device="cuda")

    def step():
        y = m(x)
        ((y * r).sum() + 0.3 * m.l1).backward()
        m.l1 = None  # keep no reference to this step's autograd graph

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):  # the first call runs dense and measures; the next read it
            m.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            step()
    assert m.last_train_path == "sparse"
    torch.cuda.current_stream().wait_stream(s)
    eager = [p.grad.clone() for p in m.parameters()]
    m.zero_grad(set_to_none=True)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    assert m.last_train_path == "dense"
    g.replay()
    torch.cuda.synchronize()
    for a, b in zip((p.grad for p in m.parameters()), eager):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    m.train_kernels = "sparse"
    with pytest.raises(RuntimeError, match="cannot be captured in a CUDA graph"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            m(x)


# --- boundaries and cadence of the path choice (a mutation round: these had survived) -----------


class _Landed:
    """Stands in for the copy's CUDA event: the measurement has landed."""

    def query(self):
        return True


def _measured(host):
    tp = TrainPath()
    tp._host, tp._event = torch.tensor(host), _Landed()
    return tp


def test_use_sparse_boundaries_are_inclusive():
    assert use_sparse(MAX_DENSITY * 5000, 5000)  # exactly at the density bar: sparse
    assert use_sparse(29, 5632, heavy_share=HEAVY_SHARE_MAX)  # exactly at the heavy-share bar


def test_probe_cadence_after_a_measurement():
    tp = _measured([29.0, 40.0, 0.0])
    tp.choose("auto", 5632)  # call 1 reads the measurement
    taken = []
    for _ in range(2 * tp.PROBE_EVERY):
        tp.choose("auto", 5632)
        taken.append(tp.want_probe())
    assert [i + 2 for i, t in enumerate(taken) if t] == [1 + tp.PROBE_EVERY, 1 + 2 * tp.PROBE_EVERY]


def test_width_comes_from_the_mean_and_max_density_reaches_the_choice():
    assert _measured([29.0, 40.0, 0.0]).choose("auto", 5632) == ("sparse", 64)  # not narrowed by the max
    assert _measured([60.0, 180.0, 0.0]).choose("auto", 5632, max_density=0.06)[0] == "sparse"


def test_auto_trains_small_calls_dense():
    """Below MIN_SPARSE_TOKENS tokens per call "auto" trains dense on a measurement that makes
    larger calls sparse (the measurement is still read); forced "sparse" ignores the size; no
    size given: the measured path."""
    from twell.training.path import MIN_SPARSE_TOKENS

    tp = _measured([29.0, 40.0, 0.0])
    assert tp.choose("auto", 5632, tokens=MIN_SPARSE_TOKENS - 1) == ("dense", 64)
    assert tp.choose("auto", 5632, tokens=0) == ("dense", 64)  # an empty call too
    assert tp.k_mean == 29.0 and tp.path == "sparse"
    assert tp.choose("auto", 5632, tokens=MIN_SPARSE_TOKENS) == ("sparse", 64)
    assert tp.choose("auto", 5632) == ("sparse", 64)
    assert tp.choose("sparse", 5632, tokens=1) == ("sparse", 64)
    assert tp.choose("dense", 5632, tokens=10**6) == ("dense", 64)


def test_module_passes_its_tokens_to_the_path_choice(monkeypatch):
    """The module asks for its path with the call's tokens (every leading dimension)."""
    seen = []
    real = TrainPath.choose

    def spy(self, mode, f, max_density=None, capturing=False, tokens=None, **kw):
        seen.append(tokens)
        return real(self, mode, f, max_density, capturing, tokens, **kw)

    monkeypatch.setattr(TrainPath, "choose", spy)
    m = SparseGatedMLP(16, 40)
    m.train()
    m.train_kernels = "dense"  # the interpreter takes a kernel path only when one is forced
    x = torch.randn(3, 5, 16, requires_grad=True)
    m(x)
    assert seen == [15] and m.last_train_path == "dense"


@pytest.mark.gpu
def test_gpu_auto_trains_small_calls_dense(monkeypatch):
    """On CUDA a layer sparse enough for the sparse kernels trains a call below
    MIN_SPARSE_TOKENS on the dense path; with the floor lowered the same layer takes the sparse
    kernels."""
    from twell.training import path as train_path

    torch.manual_seed(0)
    m = SparseGatedMLP(64, 96).cuda()
    m.train()
    m.train_max_density = 1.0
    x = torch.randn(40, 64, device="cuda")
    for _ in range(3):  # the first call measures, the next read it
        m(x).sum().backward()
        torch.cuda.synchronize()
    assert m._twell_train.path == "sparse" and m.last_train_path == "dense"
    monkeypatch.setattr(train_path, "MIN_SPARSE_TOKENS", 1)
    m(x).sum().backward()
    assert m.last_train_path == "sparse"


def test_a_capture_reads_no_measurement():
    tp = _measured([29.0, 40.0, 0.0])
    assert tp.choose("auto", 5632, capturing=True) == ("dense", 16)
    assert tp.k_mean is None and tp._event is not None and tp._calls == 0


# --- a second mutation round: these had survived --------------------------------------------------


class _Recorded(_Landed):
    """Stands in for a CUDA event that publish records."""

    def record(self, stream):
        pass


def _stub_cuda(monkeypatch):
    """Stub the CUDA calls publish makes (it runs on CUDA only); returns a tensor subclass that
    says it is on CUDA, for the row counts."""
    import contextlib

    class OnCuda(torch.Tensor):
        @property
        def is_cuda(self):
            return True

    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "Event", _Recorded)
    return OnCuda


def test_publish_measures_mean_max_and_the_share_strictly_above_the_width(monkeypatch):
    """What publish copies (it runs on CUDA only; here a tensor that says it is on CUDA, a plain
    host buffer and stub CUDA calls): the mean and the max of the row counts and the share of rows
    with *more* units than the width of the mean (a row of exactly W units is light). Catches
    ``>=`` for ``>`` in the share and a wrong statistic (min for max)."""
    OnCuda = _stub_cuda(monkeypatch)
    tp = TrainPath()
    tp._host = torch.zeros(3 + 2 * len(PROBE_WIDTHS))  # pinned memory needs CUDA
    counts = torch.tensor([16, 17, 0, 0, 0, 0, 0, 3], dtype=torch.int32)  # mean 4.5: width 16
    tp.publish(counts.as_subclass(OnCuda), 5632)
    assert tp._event is not None and not tp.want_probe()  # one probe in flight
    host = tp._host.tolist()
    tp.choose("auto", 5632)
    assert (tp.k_mean, tp.k_max, tp.heavy_share, tp.width) == (4.5, 17, 0.125, 16)
    # at each probe width: the share of rows *above* it, and the units of the rows at or below it per token
    assert PROBE_WIDTHS[:2] == (16, 32)
    n = len(PROBE_WIDTHS)
    assert host[3:3 + n] == [0.125] + [0.0] * (n - 1)
    assert host[3 + n:] == pytest.approx([19 / 8] + [36 / 8] * (n - 1))


def test_publish_regrows_a_buffer_of_another_size(monkeypatch):
    """A pinned buffer of the older 3-value probe is made again at the probe's size (a mutation
    round: reusing it survived; its copy would fail)."""
    OnCuda = _stub_cuda(monkeypatch)
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: empty(*a, **k))  # pinned memory needs CUDA
    tp = TrainPath()
    tp._host = torch.zeros(3)
    tp.publish(torch.tensor([16, 17, 0, 0, 0, 0, 0, 3], dtype=torch.int32).as_subclass(OnCuda), 5632)
    assert tp._host.numel() == 3 + 2 * len(PROBE_WIDTHS) and float(tp._host[3]) == 0.125


def test_in_backward_is_seen_from_a_real_backward():
    """The check that keeps a checkpoint's recomputation on its forward's path, against autograd
    itself rather than a stub: true while a backward runs, false outside; a choice made in the
    backward reads no landed measurement and counts no call."""
    from twell.training.path import _in_backward

    tp = _measured([29.0, 40.0, 0.0])
    seen = []
    x = torch.ones(3, requires_grad=True)
    y = x * 2
    y.register_hook(lambda g: seen.append((_in_backward(), tp.choose("auto", 5632))))
    y.sum().backward()
    assert seen == [(True, ("dense", 16))] and not _in_backward()
    assert tp.k_mean is None and tp._calls == 0


def test_docs_state_the_auto_rule_constants():
    """The docs' statement of the "auto" rule gives the thresholds the code uses (a changed
    MIN_SPARSE_TOKENS with the docs left behind survived every other test)."""
    from pathlib import Path

    from twell.training.path import MIN_SPARSE_TOKENS

    root = Path(__file__).resolve().parents[1]
    pages = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    text = " ".join(" ".join(p.read_text().split()) for p in pages)
    assert f"at most {MAX_DENSITY * 100:g}% of f" in text
    assert f"at most {HEAVY_SHARE_MAX * 100:g}% of its tokens" in text
    assert f"at least {MIN_SPARSE_TOKENS} tokens (`twell.training.path.MIN_SPARSE_TOKENS`)" in text


# --- the light-row rule: heavy-tailed layers ----------------------------------------------------


def _probe(**by_width):
    """(shares, lights) at PROBE_WIDTHS from {W: (share, light)}; widths not given: every row above."""
    shares = [by_width.get(f"w{w}", (1.0, 0.0))[0] for w in PROBE_WIDTHS]
    lights = [by_width.get(f"w{w}", (1.0, 0.0))[1] for w in PROBE_WIDTHS]
    return shares, lights


@pytest.mark.parametrize("name,probe,width", [
    # measured on the H200 (M 16384): (share, light) at W 32 / 64 / 128
    ("heavy k56, 1.78x at W64", _probe(w32=(0.218, 2.0), w64=(0.170, 4.3), w128=(0.123, 8.6)), 64),
    ("heavy k100, 1.39x at W64", _probe(w32=(0.337, 2.3), w64=(0.274, 5.2), w128=(0.206, 11.6)), 64),
    ("heavy k160, 1.17x at W64: kept dense", _probe(w32=(0.457, 2.4), w64=(0.386, 5.7), w128=(0.310, 12.8)), None),
    ("light k29 + 1% heavy rows, 1.29x", _probe(w64=(0.010, 29.0), w128=(0.010, 29.0)), 64),
    ("light k29 + 3% heavy rows, 1.27x: kept dense", _probe(w64=(0.030, 28.4), w128=(0.030, 28.4)), None),
    ("light k29 + 10% heavy rows, 1.19x: kept dense", _probe(w64=(0.100, 26.3), w128=(0.100, 26.3)), None),
    ("even k48, 1.00x", _probe(w64=(0.0005, 47.4), w128=(0.0, 47.5)), None),
    ("even k29: no heavy row at 64", _probe(w32=(0.6, 9.0), w64=(0.0, 29.3), w128=(0.0, 29.3)), 64),
])
def test_light_rule_on_measured_layers(name, probe, width):
    assert light_rule_width(*probe, 5632) == width, name


def test_light_rule_boundaries():
    """At the bar exactly: sparse (<=); a share exactly HEAVY_SHARE_MAX allowed, above it not; any
    heavy row costs HEAVY_FIXED f; the cheapest width wins; no width above f; max_density scales the bar."""
    f = 10000
    bar = MAX_DENSITY * f
    assert light_rule_width(*_probe(w64=(0.0, bar)), f) == 64
    assert light_rule_width(*_probe(w64=(0.0, bar + 0.01)), f) is None
    share = 0.01
    at_bar = bar - HEAVY_FIXED * f - HEAVY_COST * f * share
    assert light_rule_width(*_probe(w64=(share, at_bar)), f) == 64
    assert light_rule_width(*_probe(w64=(share, at_bar + 0.01)), f) is None
    assert light_rule_width(*_probe(w16=(HEAVY_SHARE_MAX, 0.0)), 10 ** 6) == 16
    assert light_rule_width(*_probe(w16=(HEAVY_SHARE_MAX + 1e-6, 0.0)), 10 ** 6) is None
    assert light_rule_width(*_probe(w32=(0.001, 3.0), w64=(0.0, 10.5)), f) == 32  # 3 + 7 + 0.137 < 10.5
    assert light_rule_width(*_probe(w32=(0.001, 3.0), w64=(0.0, 10.0)), f) == 64
    assert light_rule_width(*_probe(w64=(0.0, 1.0)), 63) is None and light_rule_width(*_probe(w16=(0.0, 0.05)), 16) == 16
    assert light_rule_width(*_probe(w64=(0.0, 2 * bar)), f) is None
    assert light_rule_width(*_probe(w64=(0.0, 2 * bar)), f, max_density=2 * MAX_DENSITY) == 64


def test_train_path_takes_heavy_tailed_layers_sparse_at_the_rule_width(monkeypatch):
    """A measured heavy-tailed layer (mean 61 of 5632, above the mean rule's bar; at W 64 a share
    0.17 of rows above, 4.3 light units per token): "auto" trains it sparse at W 64; with
    AUTO_SPARSE off, dense at the mean's width; the 3-value probe of older code reads as before."""
    import twell.training.path as train_path

    host = [61.2, 2116.0, 0.123] + _probe(w32=(0.218, 2.0), w64=(0.170, 4.3), w128=(0.123, 8.6))[0] \
        + _probe(w32=(0.218, 2.0), w64=(0.170, 4.3), w128=(0.123, 8.6))[1]
    assert len(host) == 3 + 2 * len(PROBE_WIDTHS)
    assert _measured(host).choose("auto", 5632) == ("sparse", 64)
    assert _measured(host).choose("auto", 5632, tokens=4096) == ("dense", 64)  # below the token floor
    monkeypatch.setattr(train_path, "AUTO_SPARSE", False)
    assert _measured(host).choose("auto", 5632) == ("dense", 64)
    monkeypatch.setattr(train_path, "AUTO_SPARSE", True)
    assert _measured(host[:3]).choose("auto", 5632) == ("dense", 128)


@pytest.mark.gpu
def test_gpu_heavy_tailed_layer_trains_sparse_at_the_rule_width():
    """The synthetic heavy-row layer at k 56 (d 2048, f 5632, 16384 tokens: mean about 61, above
    the mean rule's bar; at W 64 about 4 light units per token and 17% of the rows above): "auto"
    measures it and trains it on the sparse kernels at W 64, with the dense op's gradients."""
    from twell.bench.synthetic import make_ffn

    s = make_ffn(16384, 2048, 5632, 56, "heavy", device="cuda")
    m = SparseGatedMLP(2048, 5632, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        for lin, w in ((m.gate_proj, s.w_gate), (m.up_proj, s.w_up), (m.down_proj, s.w_down)):
            lin.weight.copy_(w)
    m.train()
    x = s.x.detach().requires_grad_(True)
    r = torch.randn_like(x)
    for _ in range(3):  # the first call runs dense and measures; the next read it
        m(x)
        torch.cuda.synchronize()
    tp = m._twell_train
    assert tp.k_mean > MAX_DENSITY * 5632 and m.last_train_path == "sparse" and tp.width == 64
    grads = []
    for kernels in ("sparse", "dense"):
        m.train_kernels = kernels
        m.zero_grad(set_to_none=True)
        x.grad = None
        ((m(x).float() * r).sum() + 0.1 * m.l1).backward()
        grads.append([x.grad.float()] + [p.grad.float() for p in m.parameters()])
    for a, b in zip(*grads):
        assert (a - b).norm() <= 2e-2 * b.norm()


@pytest.mark.gpu
def test_gpu_publish_never_synchronises():
    """A layer's first probe (fresh TrainPath, so its pinned buffer is made too) issues no
    synchronising CUDA call: a widths tensor made on the device from Python values had waited
    for all queued work once per process (0.9 s behind 40 large matmuls)."""
    counts = torch.randint(0, 200, (4096,), device="cuda", dtype=torch.int32)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tp = TrainPath()
        tp.publish(counts, 5632)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert tp._event is not None and tp._host.numel() == 3 + 2 * len(PROBE_WIDTHS)


def test_max_density_reaches_the_light_row_rule():
    """A layer's train_max_density raises the light-row rule's bar too, not only the mean rule's:
    a heavy-tailed layer above both bars at MAX_DENSITY trains sparse at the rule's width once
    max_density doubles them (kills choose_path calling light_rule_width without it)."""
    from twell.training.ops import choose_width
    from twell.training.path import choose_path

    f = 10000
    bar = MAX_DENSITY * f
    shares, lights = _probe(w64=(0.0, 1.5 * bar))
    mean = 2.5 * bar  # above the mean rule's bar even at 2 x MAX_DENSITY
    assert choose_path(mean, 0.0, shares, lights, f) == ("dense", choose_width(mean, None, f))
    assert choose_path(mean, 0.0, shares, lights, f, max_density=2 * MAX_DENSITY) == ("sparse", 64)
    host = [mean, 4 * mean, 0.0] + shares + lights
    assert _measured(host).choose("auto", f)[0] == "dense"
    assert _measured(host).choose("auto", f, max_density=2 * MAX_DENSITY) == ("sparse", 64)

"""The inference runtime: path choice, weight layout, statistics off in eval, torch.compile and
the custom op (CPU: Triton interpreter), CUDA graphs and compiled kernels (GPU)."""

from __future__ import annotations

import copy
import os
import pickle

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

import twell
from sparsity import rel_err
from twell import SparseGatedMLP, SparseMLP
from twell import reference as R
from twell.inference.dispatch import DECODE_BLIND_M, DECODE_MAX_M, EAGER_PREFILL_MIN_M, PREFILL_MIN_M, LayerState


def _dense(m, x):
    w = [p.double() for p in (m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight)]
    return R.gated_mlp(x.reshape(-1, m.hidden_size).double(), *w).reshape(x.shape)


# --- path choice -------------------------------------------------------------------------------


def test_choice_by_batch_size_and_sparsity(monkeypatch):
    from twell.inference import dispatch

    s = SparseGatedMLP(8, 16)._twell_layer
    f = 5632
    choose = lambda M, mode="auto", density=None: s.choose(M, f, mode, density, False)  # noqa: E731
    in_graph = lambda M: s.choose(M, f, "auto", None, True)  # noqa: E731
    # eager small batches: dense issues the fewest launches; in a graph, decode where it pays
    assert choose(1) == choose(DECODE_MAX_M) == "dense"
    assert in_graph(1) == in_graph(DECODE_BLIND_M) == "decode"  # no estimate yet: only tiny batches
    assert in_graph(DECODE_BLIND_M + 1) == "dense"
    assert in_graph(DECODE_MAX_M + 1) == "dense"
    s.k_est = 8.0  # 16 tokens share about 2% of the units, 64 about 9%
    assert in_graph(16) == in_graph(DECODE_MAX_M) == "decode"
    # the split kernels (dispatch.DECODE_SPLIT, the default) from SPLIT_MIN_M tokens while the
    # expected fires, M times k_est, are at most SPLIT_MAX_FIRES (4096)
    s.k_est = 20.0  # 64 tokens: 1280 fires
    assert in_graph(33) == in_graph(DECODE_MAX_M) == "decode"
    s.k_est = 70.0  # 58 tokens: 4060 fires, 59: 4130 (and 52% of the units: too many for the fused kernel)
    assert in_graph(58) == "decode" and in_graph(59) == "dense"
    s.k_est = 280.0  # one token: 5% of the units (the fused kernel); 14 tokens 3920 fires, 15 4200
    assert in_graph(1) == in_graph(14) == "decode" and in_graph(15) == "dense"
    s.k_est = 1500.0  # 27% of the units for a single token: the fused kernel would read too many rows
    assert in_graph(1) == "dense"
    s.k_est = 1000.0  # 4 tokens: 4000 fires; 2 tokens: too few for the split kernels, 32% of the units
    assert in_graph(dispatch.SPLIT_MIN_M) == in_graph(4) == "decode" and in_graph(dispatch.SPLIT_MIN_M - 1) == "dense"
    s.k_est = 1100.0  # 3 tokens: 3300 fires, but more than SPLIT_MAX_ROW_FIRES per token
    assert in_graph(3) == "dense"
    # without them, the fused kernel's rule on the union share alone
    monkeypatch.setattr(dispatch, "DECODE_SPLIT", False)
    s.k_est = 20.0  # 32 tokens: 10.7%; 33 tokens: 11.0%, above the 64-row tiles' 10%
    assert in_graph(32) == "decode" and in_graph(33) == in_graph(DECODE_MAX_M) == "dense"
    s.k_est = 280.0
    assert in_graph(1) == "decode" and in_graph(16) == "dense"  # 16 tokens: 56% of the units
    s.k_est = 29.0  # 16 tokens: 8% of the units, 32: 15%, 64: 28% (above FUSED_WIDE_MAX_UNION)
    assert in_graph(16) == in_graph(32) == "decode" and in_graph(DECODE_MAX_M) == "dense"
    monkeypatch.setattr(dispatch, "DECODE_SPLIT", True)
    assert in_graph(DECODE_MAX_M) == "decode"  # 1856 fires
    # heavy tokens: the fires counted by the root mean square of the active units per token
    s.k_rms = 70.0  # 64 tokens: 4480 (mean 29); 58 tokens: 4060
    assert in_graph(58) == "decode" and in_graph(59) == "dense"
    s.k_est = s.k_rms = None
    assert choose(PREFILL_MIN_M) == "dense"  # no prefill estimate yet
    s.estimate = (29.0, 60.0)
    assert choose(PREFILL_MIN_M - 1) == "dense"
    # eager calls of fewer than EAGER_PREFILL_MIN_M tokens run dense (the host's time to issue
    # the kernels is as long as their GPU time there); in a graph the kernels from PREFILL_MIN_M
    assert choose(EAGER_PREFILL_MIN_M - 1) == "dense" and in_graph(PREFILL_MIN_M) == "prefill"
    assert choose(EAGER_PREFILL_MIN_M) == "prefill"
    assert choose(1 << 17) == "prefill"
    s.estimate = (300.0, 600.0)
    assert choose(1 << 17) == "dense"
    # forced modes
    assert choose(1 << 17, "twell") == "prefill" and choose(3, "twell") == "decode"
    assert choose(3, "prefill") == "prefill" and choose(1 << 17, "decode") == "decode" and choose(3, "dense") == "dense"
    with pytest.raises(ValueError, match="kernel_mode must be one of"):
        choose(3, "fast")


def test_kernel_max_density_is_obeyed():
    """The knob moves the threshold both ways, and the module passes its own value."""
    s = SparseGatedMLP(8, 16)._twell_layer
    f, M = 1000, 1 << 30
    s.estimate = (50.0, 0.0)  # 5% of the units
    assert s.choose(M, f, "auto", None, False) == "dense"  # default threshold: about 1%
    assert s.choose(M, f, "auto", 0.06, False) == "prefill"
    s2 = SparseGatedMLP(8, 16)._twell_layer
    s2.estimate = (5.0, 0.0)  # 0.5%
    assert s2.choose(M, f, "auto", None, False) == "prefill"
    assert s2.choose(M, f, "auto", 0.004, False) == "dense"


def test_module_passes_its_knobs(monkeypatch):
    m = SparseGatedMLP(40, 100).eval()
    m.kernel_mode = "prefill"
    m.kernel_max_density = 0.123
    seen = {}
    real = LayerState.choose

    def spy(self, M, f, mode, max_density, capturing, x=None):
        seen.update(M=M, f=f, mode=mode, max_density=max_density, capturing=capturing)
        return real(self, M, f, mode, max_density, capturing)

    monkeypatch.setattr(LayerState, "choose", spy)
    with torch.no_grad():
        m(torch.randn(2, 3, 40))  # few tokens: the prefill kernels run under the interpreter
    assert seen == dict(M=6, f=100, mode="prefill", max_density=0.123, capturing=False)


class Done:
    """A probe's CUDA event that has completed (for LayerState._poll without a GPU)."""

    def query(self):
        return True


def test_no_probe_and_no_poll_inside_a_capture():
    s = SparseGatedMLP(8, 16)._twell_layer

    class Event:
        def query(self):
            raise AssertionError("polled during a capture")

    s._event = Event()
    assert not s._want_probe("auto", capturing=True, M=1)
    s.estimate = (1.0, 1.0)
    assert s.choose(1 << 20, 5632, "auto", None, True) == "prefill"  # decided from the estimate it has
    s._event = None
    assert not s._want_probe("auto", capturing=True, M=4096)
    assert not s._want_probe("dense", capturing=False, M=4096)


def test_union_measured_by_a_small_dense_probe_steers_decode(monkeypatch):
    """A small dense call's probe also reports the share of units active for some token of its
    batch (in the overflow slot); the layer fits a per-token rate to it, which carries the
    layer's skew: with the same mean, a skewed layer (fewer units in the union) takes the fused
    decode kernel at a batch size where the independence estimate from the mean would not (the
    split kernels, whose rule counts fires, off)."""
    from twell.inference import dispatch
    from twell.inference.dispatch import FUSED_MAX_UNION

    monkeypatch.setattr(dispatch, "DECODE_SPLIT", False)

    f, M, k = 5632, 16, 120.0
    s = SparseGatedMLP(8, 16)._twell_layer
    s._union_m = 0
    s._host, s._event, s._no_overflow = torch.tensor([k, k, 2 * k, 0.0]), Done(), True
    s._poll()
    assert s.union_rate is None and s.k_est == k and s.k_rms == k
    independent = s.union_share(M, f)
    assert independent == pytest.approx(1 - (1 - k / f) ** M) and independent > FUSED_MAX_UNION
    assert s.choose(M, f, "auto", None, True) == "dense"
    share = 0.10  # measured: the batch's tokens share many of their units
    s._host, s._event, s._union_m = torch.tensor([k, k, 2 * k, share]), Done(), M
    s._poll()
    assert s.k_est == k and s.estimate[0] == pytest.approx(k)  # the share is not read as overflow
    assert s.union_share(M, f) == pytest.approx(share, rel=1e-6)
    assert s.choose(M, f, "auto", None, True) == "decode"
    assert s.union_share(1, f) == pytest.approx(1 - (1 - share) ** (1 / M), rel=1e-6)


@pytest.mark.parametrize("M", [5, 70])
@pytest.mark.parametrize("triton_pass", [False, True])
def test_dense_probe_counts_the_pattern(M, triton_pass, monkeypatch):
    """The dense path's probe (taken in its own dtype, see LayerState._dense) reports each row's
    active units and, up to 64 tokens, the number of units active for some token of the batch,
    as the pattern a > 0 gives them (exact zeros and negative values not firing, a NaN gate
    firing), after relu(a) * u as two in-place PyTorch ops or as the Triton pass."""
    torch.manual_seed(M)
    m = SparseGatedMLP(24, 37).eval().to(torch.bfloat16)
    s = m._twell_layer
    if triton_pass:
        monkeypatch.setattr(s, "SMALL_M", 0)
    x = torch.randn(M, 24, dtype=torch.bfloat16)
    x[:, :3] = 0.0
    m.gate_proj.weight.data[:5] = 0.0  # exact zeros in a: not firing
    bad = min(3, M - 1)
    x[bad, 4] = float("nan")  # a NaN gate for every unit of that row: firing, as in the kernels
    got = {}
    monkeypatch.setattr(s, "_publish_rows", lambda per_row, over, union=None, union_m=0: got.update(
        per_row=per_row, union=union, union_m=union_m))
    with torch.no_grad():
        y = s._dense(m, x, m.gate_proj.weight, m.down_proj.weight, m.up_proj.weight, False, True)
    pattern = ~((x @ m.gate_proj.weight.T) <= 0)  # > 0 or NaN
    # Rows that come out NaN are the NaN row and, on some CPUs, rows that PyTorch's own bf16
    # matmul mixes it into (seen: row 2 from row 3's NaN h in F.linear on a Xeon with AVX-512):
    # the same rows as the dense MLP's in PyTorch, and every other row as fp64's.
    plain = F.linear(torch.relu(F.linear(x, m.gate_proj.weight)) * F.linear(x, m.up_proj.weight), m.down_proj.weight)
    nan_rows = torch.isnan(y).any(1)
    assert torch.isnan(y[bad]).all() and torch.equal(nan_rows, torch.isnan(plain).any(1))
    assert int((~nan_rows).sum()) >= M // 2  # enough finite rows left to compare
    assert rel_err(y[~nan_rows], _dense(m, x)[~nan_rows]) < 1e-2
    assert torch.equal(got["per_row"], pattern.sum(1).float())
    if M <= 64:
        assert got["union_m"] == M and float(got["union"]) == pytest.approx(float(pattern.any(0).sum()) / 37)
    else:
        assert got["union"] is None


def test_split_gate_stages_fit_the_shared_memory(monkeypatch):
    """The split gate's pipeline depth: the config's where it fits the device's shared memory,
    fewer where not (fp32, 64-token tiles, a 99 KB GPU), at least one; a depth that failed to
    compile once is remembered for that device, dtype and tile."""
    from types import SimpleNamespace

    from twell.kernels import decode_split as S

    def fake(dtype_bytes, idx=0):
        return SimpleNamespace(is_cuda=True, device=torch.device("cuda", idx), dtype=dtype_bytes, element_size=lambda: dtype_bytes)

    cfg = S.SPLIT_CONFIG  # 64 units, 128 columns, 6 stages
    monkeypatch.setattr(S, "_shared_memory", lambda idx: 232448)  # the H200's
    assert S._gate_stages(fake(2), 16, cfg, 128) == 6  # 20 KB a stage
    assert S._gate_stages(fake(4), 64, cfg, 128) == 3  # 64 KB a stage
    monkeypatch.setattr(S, "_shared_memory", lambda idx: 99 * 1024)
    assert S._gate_stages(fake(2), 64, cfg, 128) == 2 and S._gate_stages(fake(4), 64, cfg, 128) == 1
    monkeypatch.setattr(S, "_FEWER_STAGES", {(fake(2).device, 2, 16, False): 1})
    assert S._gate_stages(fake(2), 16, cfg, 128) == 1
    monkeypatch.setattr(S, "_shared_memory", lambda idx: 232448)
    assert S._gate_stages(fake(2), 16, cfg, 128, desc=True) == 6  # the other load path is not pinned


def test_row_stats(monkeypatch):
    from twell.inference.dispatch import row_stats
    from twell.kernels import updown

    p = torch.tensor([0.0, 3.0, 4.0, 29.0, 1.0])
    mean, rms, top, over, dense, light_mean, light_rms, light_top = row_stats(p, torch.tensor(0.25), dense_min=3).tolist()
    assert mean == pytest.approx(7.4) and rms == pytest.approx(float(p.square().mean().sqrt()), rel=1e-6)
    assert top == 29.0 and over == 0.25
    # rows above dense_min (4 and 29) are computed whole: the rest's statistics count them as 0
    assert dense == pytest.approx(0.4) and light_mean == pytest.approx(0.8)
    assert light_rms == pytest.approx((10 / 5) ** 0.5, rel=1e-6) and light_top == 3.0
    # by default the limit is the up/down kernels' own, read when called (the estimate prices
    # what the kernels compute whole)
    monkeypatch.setattr(updown, "DENSE_ROW_MIN", 3)
    assert row_stats(p, torch.tensor(0.25)).tolist() == row_stats(p, torch.tensor(0.25), dense_min=3).tolist()
    monkeypatch.setattr(updown, "DENSE_ROW_MIN", 29)
    assert row_stats(p).tolist()[4:] == [0.0, pytest.approx(7.4), pytest.approx(float(p.square().mean().sqrt())), 29.0]


def test_probes_are_spaced():
    s = SparseGatedMLP(8, 16)._twell_layer
    s.k_est = 1.0
    taken = [s._want_probe("auto", False, 4096) for _ in range(3 * s.PROBE_EVERY)]
    assert sum(taken) == 3
    # below PREFILL_MIN_M the eager path is dense whatever the estimate: probe rarely
    s._union_fit_m = 64  # (the union of small batches is measured already)
    for M in (1, 64, 1024, PREFILL_MIN_M - 1):
        s._calls = 0
        taken = [s._want_probe("auto", False, M) for _ in range(2 * s.PROBE_EVERY_SMALL)]
        assert sum(taken) == 2, M
    assert not s._want_probe("auto", True, 4096) and not s._want_probe("dense", False, 4096)


def test_first_small_batch_larger_than_any_measured_is_probed():
    """Decode's choice in a capture of M tokens needs the union of a batch of about M; a probe
    of one token says nothing of it. So the first eager call of up to FUSED_MAX_M tokens larger
    than any measured is probed whatever the call count, and a union measured on fewer tokens
    never replaces one measured on more."""
    from twell.kernels.decode_fused import FUSED_MAX_M

    s = SparseGatedMLP(8, 16)._twell_layer
    s.k_est = 29.0
    s._calls = 5
    assert s._want_probe("auto", False, 4)  # none measured yet
    s._host, s._event, s._union_m, s._no_overflow = torch.tensor([29.0, 29.0, 40.0, 0.02]), Done(), 4, True
    s._poll()
    assert s._union_fit_m == 4 and s.union_share(4, 5632) == pytest.approx(0.02, rel=1e-6)
    assert not s._want_probe("auto", False, 4) and not s._want_probe("auto", False, 2)
    assert s._want_probe("auto", False, FUSED_MAX_M)  # larger: probed at once
    # a one-token probe afterwards keeps the 4-token fit
    s._host, s._event, s._union_m = torch.tensor([29.0, 29.0, 29.0, 29.0 / 5632]), Done(), 1
    s._poll()
    assert s._union_fit_m == 4 and s.union_share(4, 5632) == pytest.approx(0.02, rel=1e-6)
    # a 16-token one replaces it
    s._host, s._event, s._union_m = torch.tensor([29.0, 29.0, 40.0, 0.05]), Done(), 16
    s._poll()
    assert s._union_fit_m == 16 and s.union_share(16, 5632) == pytest.approx(0.05, rel=1e-6)


# --- statistics, layout, copies ----------------------------------------------------------------


@pytest.mark.parametrize("cls", [SparseGatedMLP, SparseMLP])
def test_eval_keeps_no_statistics_unless_asked(cls):
    m = cls(16, 40)
    x = torch.randn(5, 16)
    m(x)
    assert m.stats is not None and int(m.tokens_seen) == 5  # training: on
    m.eval().stats = None
    with torch.no_grad():
        m(x)
    assert m.stats is None and int(m.tokens_seen) == 5
    m.track_stats = True
    with torch.no_grad():
        m(x)
    assert m.stats.tokens == 5 and int(m.tokens_seen) == 10
    m.train().track_stats = False
    m(x)
    assert int(m.tokens_seen) == 10


@pytest.mark.parametrize("cls", [SparseGatedMLP, SparseMLP])
@pytest.mark.parametrize("no_grad", [torch.no_grad, torch.inference_mode])
def test_a_training_mode_module_serving_keeps_no_statistics(cls, no_grad):
    """By default statistics are a training step's: a module left in training mode (a model
    built with its constructor, never switched to eval) but called under no_grad or
    inference_mode counts nothing, and computes no L1 term; with gradients it counts again."""
    m = cls(16, 40)
    x = torch.randn(5, 16)
    with no_grad():
        y = m(x)
    assert m.training and m.stats is None and m.l1 is None and int(m.tokens_seen) == 0
    m.track_stats = False
    assert torch.equal(y, m(x))  # the same function as a step that counts nothing
    m.track_stats = None
    m(x)
    assert m.stats.tokens == 5 and int(m.tokens_seen) == 5 and m.l1 is not None
    m.track_stats = True
    with no_grad():
        m(x)
    assert int(m.tokens_seen) == 10


@pytest.mark.parametrize("cls", [SparseGatedMLP, SparseMLP])
def test_eval_lays_out_down_for_the_kernels_with_one_copy(cls, monkeypatch):
    from twell.training import path as train_path

    monkeypatch.setattr(train_path, "KERNEL_LAYOUT", False)  # training in the nn.Linear layout (the
    # kernel layout in training: test_training_in_the_kernel_layout)
    torch.manual_seed(0)
    m = cls(16, 40)
    w = m.down_proj.weight
    values = w.detach().clone()
    m.eval()
    assert m.down_proj.weight is w and w.shape == (16, 40)  # same Parameter, same shape
    assert w.stride() == (1, 16) and w.t().is_contiguous()
    assert torch.equal(w, values)
    sd = m.state_dict()
    assert torch.equal(sd["down_proj.weight"], values)
    # loading keeps the layout
    new = torch.randn(16, 40)
    m.load_state_dict({**sd, "down_proj.weight": new})
    assert torch.equal(m.down_proj.weight, new) and m.down_proj.weight.stride() == (1, 16)
    # training mode: contiguous again, and an optimizer step works after the round trip
    m.train()
    assert m.down_proj.weight.is_contiguous() and torch.equal(m.down_proj.weight, new)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    m(torch.randn(4, 16)).square().sum().backward()
    opt.step()
    m.eval()
    m.train()
    m(torch.randn(4, 16)).square().sum().backward()
    opt.step()
    assert m.down_proj.weight.grad.shape == (16, 40)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("state_from", ["step", "checkpoint"])
def test_optimizer_state_follows_the_weight_layout(fused, state_from, monkeypatch):
    """An AdamW state of down_proj.weight made in the nn.Linear layout (a step in training mode,
    or a checkpoint written so) meets the parameter in the kernel layout (here: a step taken in
    eval mode). Fused AdamW reads parameter, gradient and state as flat memory, so without
    twell.optim_layout each element would be updated with another element's moments; the steps
    must equal those of a module that never changed layout."""
    from twell.training import path as train_path

    monkeypatch.setattr(train_path, "KERNEL_LAYOUT", False)  # training in the nn.Linear layout
    torch.manual_seed(3)
    ref, m = SparseGatedMLP(8, 24), SparseGatedMLP(8, 24)
    m.load_state_dict(ref.state_dict())
    grads = [torch.randn(8, 24) for _ in range(3)]
    opts = [torch.optim.AdamW(mod.parameters(), lr=0.1, fused=fused, foreach=None if fused else True) for mod in (ref, m)]
    w, w_ref = m.down_proj.weight, ref.down_proj.weight

    def step(mod, p, opt, g):
        opt.zero_grad()
        p.grad = torch.empty_like(p).copy_(g)  # the gradient contract: the parameter's strides
        opt.step()

    if state_from == "step":
        for mod, p, opt in ((ref, w_ref, opts[0]), (m, w, opts[1])):
            step(mod, p, opt, grads[0])
    else:  # the reference's state, saved and loaded into m's optimizer (nn.Linear layout)
        step(ref, w_ref, opts[0], grads[0])
        w.data.copy_(w_ref.data)
        opts[1].load_state_dict(copy.deepcopy(opts[0].state_dict()))
    assert opts[1].state[w]["exp_avg"].is_contiguous()
    m.eval()
    assert w.stride() == (1, 8)
    for g in grads[1:]:
        step(ref, w_ref, opts[0], g)
        step(m, w, opts[1], g)
    assert opts[1].state[w]["exp_avg"].stride() == w.stride()
    torch.testing.assert_close(w.detach(), w_ref.detach(), rtol=0, atol=1e-6)


def test_layout_changes_carry_gradients_copies_and_swaps():
    """What the optimizer-state hook and the layout switch must survive: a gradient kept across
    a layout change (zero_grad(set_to_none=False)) takes the new layout; a deep copy's weight
    (a new Parameter) still has its loaded state re-laid out; the weight can still be swapped
    (torch.utils.swap_tensors refuses tensors with weak references)."""
    torch.manual_seed(4)
    ref, m = SparseGatedMLP(8, 24), SparseGatedMLP(8, 24)
    m.load_state_dict(ref.state_dict())
    for mod in (ref, m):  # both in the nn.Linear layout (the interpreter would train in the other)
        mod._set_kernel_layout(False)
    opts = [torch.optim.AdamW(mod.parameters(), lr=0.1, fused=True) for mod in (ref, m)]
    g = torch.randn(8, 24)
    for mod, opt in zip((ref, m), opts):
        mod.down_proj.weight.grad = g.clone()
        opt.step()
        opt.zero_grad(set_to_none=False)
        mod.down_proj.weight.grad.add_(g)
    m.eval()
    w = m.down_proj.weight
    assert w.stride() == (1, 8) and w.grad.stride() == w.stride()
    for opt in opts:
        opt.step()
    torch.testing.assert_close(w.detach(), ref.down_proj.weight.detach(), rtol=0, atol=1e-6)
    # a deep copy in the kernel layout, given state saved in the nn.Linear layout
    c = copy.deepcopy(m)
    wc = c.down_proj.weight
    assert wc is not w and wc.stride() == (1, 8)
    opt_c = torch.optim.AdamW(c.parameters(), lr=0.1, fused=True)
    opt_c.load_state_dict(copy.deepcopy(opts[0].state_dict()))
    wc.data.copy_(ref.down_proj.weight.data)
    for mod, p, opt in ((ref, ref.down_proj.weight, opts[0]), (c, wc, opt_c)):
        opt.zero_grad()
        p.grad = torch.empty_like(p).copy_(g)
        opt.step()
    torch.testing.assert_close(wc.detach(), ref.down_proj.weight.detach(), rtol=0, atol=1e-6)
    torch.utils.swap_tensors(w, torch.nn.Parameter(w.detach().clone()))


@pytest.mark.parametrize("kernels", ["sparse", "dense"])
def test_training_in_the_kernel_layout(kernels, monkeypatch):
    """With train_path.KERNEL_LAYOUT on, training keeps the kernel layout (here under the
    interpreter, as on CUDA): the layout does not flip between eval and training, so an
    optimizer's state keeps the parameter's strides, the training ops' gradient arrives in that
    layout, and steps match those of a module in the nn.Linear layout."""
    from twell.training import path as train_path

    monkeypatch.setattr(train_path, "KERNEL_LAYOUT", False)
    torch.manual_seed(2)
    ref = SparseGatedMLP(16, 40)
    ref.train_kernels = kernels
    m = SparseGatedMLP(16, 40)
    m.load_state_dict(ref.state_dict())
    m.train_kernels = kernels
    assert ref.train().down_proj.weight.is_contiguous()  # the flag off: the nn.Linear layout
    monkeypatch.setattr(train_path, "KERNEL_LAYOUT", True)
    w = m.down_proj.weight
    m.train()
    assert w.stride() == (1, 16)
    ptr = w.data_ptr()
    m.eval()
    m.train()
    assert w.data_ptr() == ptr  # nothing re-laid out
    x = torch.randn(6, 16)
    opts = [torch.optim.AdamW(mod.parameters(), lr=1e-2, foreach=True) for mod in (ref, m)]
    for _ in range(2):
        for mod, opt in zip((ref, m), opts):
            opt.zero_grad()
            (mod(x).square().sum() + mod.l1).backward()
            opt.step()
    assert m.last_train_path == ref.last_train_path == kernels
    assert w.grad.stride() == w.stride() and opts[1].state[w]["exp_avg"].stride() == w.stride()
    for (name, a), b in zip(ref.state_dict().items(), m.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6), name
    monkeypatch.setattr(train_path, "KERNEL_LAYOUT", False)
    m.train()
    assert w.is_contiguous()
    # in a process group: the nn.Linear layout in training (FSDP2 refuses non-contiguous
    # parameters; DDP records strides when it wraps); eval() leaves the layout it finds
    monkeypatch.setattr(train_path, "KERNEL_LAYOUT", True)
    monkeypatch.setattr(twell.nn, "_distributed", lambda: True)
    m.eval()
    assert w.is_contiguous()
    m._set_kernel_layout(True)  # as a model put in eval mode before the process group
    m.train()
    assert w.is_contiguous()
    m._set_kernel_layout(True)
    m.eval()
    assert w.stride() == (1, 16)
    m.train()
    assert w.is_contiguous()
    monkeypatch.setattr(twell.nn, "_distributed", lambda: False)
    # on with CPU weights outside the interpreter: training runs PyTorch's math, nn.Linear layout
    monkeypatch.setattr(twell.nn, "triton_interpreting", lambda: False)
    m.eval()
    assert w.stride() == (1, 16)
    m.train()
    assert w.is_contiguous()


def test_sparsified_model_saves_and_reloads_in_eval(tmp_path):
    torch.manual_seed(1)
    cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=72, num_hidden_layers=2, num_attention_heads=4,
                      hidden_act="relu", max_position_embeddings=64)
    model = twell.sparsify(LlamaForCausalLM(cfg).eval())
    mlp = model.model.layers[0].mlp
    assert isinstance(mlp, SparseGatedMLP) and mlp.down_proj.weight.t().is_contiguous()
    ids = torch.randint(0, 97, (2, 9))
    with torch.no_grad():
        logits = model(ids).logits
    model.save_pretrained(tmp_path)
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert rel_err(reloaded(ids).logits, logits) < 1e-6


def test_copies_get_their_own_state():
    m = SparseGatedMLP(16, 40).eval()
    m._twell_layer.estimate = (1.0, 2.0)
    for other in (copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
        assert other._twell_key != m._twell_key
        assert other._twell_layer.module is other and other._twell_layer.estimate is None
        assert twell.inference.dispatch.layer_state(other._twell_key) is other._twell_layer
    assert twell.inference.dispatch.layer_state(m._twell_key) is m._twell_layer



@pytest.mark.parametrize("cls", [SparseGatedMLP, SparseMLP])
def test_inference_path_reads_parametrized_weights(cls):
    """The inference path reads weights from the parameter dicts (fast); a weight that is not a
    plain parameter (here a parametrization doubling the first projection) must still be read
    through its attribute, and a parametrized bias must still send the call to the dense math."""
    from torch.nn.utils import parametrize

    class Double(torch.nn.Module):
        def forward(self, w):
            return 2 * w

    torch.manual_seed(4)
    m = cls(16, 40).eval()
    m.kernel_mode = "decode"
    first = m._first_projection()
    parametrize.register_parametrization(first, "weight", Double())
    assert "weight" not in first._parameters
    x = torch.randn(3, 16)
    with torch.no_grad():
        y = m(x)
        w_first = first.weight.double()
        if cls is SparseGatedMLP:
            want = R.gated_mlp(x.double(), w_first, m.up_proj.weight.double(), m.down_proj.weight.double())
        else:
            want = R.mlp(x.double(), w_first, m.down_proj.weight.double())
    assert m.last_path == "decode"
    assert rel_err(y, want) < 1e-5
    # a bias that is not a plain parameter still counts as a bias: no inference kernels
    m.down_proj.bias = torch.nn.Parameter(torch.zeros(16))
    parametrize.register_parametrization(m.down_proj, "bias", Double())
    m._twell_layer.last_path = None
    with torch.no_grad():
        m(x)
    assert m._twell_layer.last_path is None


def test_projection_with_a_weight_property_or_hooks():
    """A projection whose class defines ``weight`` as a property over its stored parameter must
    be read through the property; one with forward hooks (old-style ``weight_norm``, which
    recomputes the weight before each call) must take the dense math, which calls it, at
    inference and in training alike."""
    class Doubled(torch.nn.Linear):
        @property
        def weight(self):
            w = self._parameters.get("weight")
            if w is None:  # nn.Linear.__init__ asks before registering it
                raise AttributeError("weight")
            return 2 * w

    torch.manual_seed(6)
    m = SparseGatedMLP(16, 40).eval()
    m.kernel_mode = "decode"
    doubled = Doubled(16, 40, bias=False)
    with torch.no_grad():
        doubled._parameters["weight"].copy_(m.gate_proj.weight)
    m.gate_proj = doubled
    x = torch.randn(3, 16)
    with torch.no_grad():
        y = m(x)
        want = R.gated_mlp(x.double(), 2 * m.gate_proj._parameters["weight"].double(), m.up_proj.weight.double(),
                           m.down_proj.weight.double())
    assert m.last_path == "decode" and rel_err(y, want) < 1e-5

    m = SparseGatedMLP(16, 40).eval()
    m.kernel_mode = "decode"
    m.train_kernels = "sparse"
    with pytest.warns(FutureWarning):
        torch.nn.utils.weight_norm(m.up_proj)
    with torch.no_grad():
        m.up_proj.weight_g.mul_(3)  # the hook makes the weight 3x at the next call
        y = m(x)
        want = R.gated_mlp(x.double(), m.gate_proj.weight.double(), m.up_proj.weight.double(), m.down_proj.weight.double())
    assert m.last_path is None and rel_err(y, want) < 1e-5
    m.train()
    y = m(x)
    assert m.last_train_path is None  # the plain dense math
    assert rel_err(y.detach(), R.gated_mlp(x.double(), m.gate_proj.weight.double(), m.up_proj.weight.double(),
                                           m.down_proj.weight.double())) < 1e-5

# --- the dispatcher's boundaries (mutants that survived the tests above) -------


def test_union_thresholds_are_inclusive(monkeypatch):
    """Decode is taken while the expected share of active units is *at most* the threshold:
    FUSED_MAX_UNION up to FUSED_WIDE_M tokens, FUSED_WIDE_MAX_UNION above."""
    from twell.inference import dispatch

    monkeypatch.setattr(dispatch, "DECODE_SPLIT", False)
    s = SparseGatedMLP(8, 16)._twell_layer
    s.union_rate = dispatch.FUSED_MAX_UNION  # at one token the share is exactly the threshold
    assert s.union_share(1, 5632) == dispatch.FUSED_MAX_UNION
    assert s.choose(1, 5632, "auto", None, True) == "decode"
    share = {"u": dispatch.FUSED_WIDE_MAX_UNION}
    monkeypatch.setattr(s, "union_share", lambda M, f: share["u"])
    M = dispatch.FUSED_WIDE_M + 1
    assert s.choose(M, 5632, "auto", None, True) == "decode"
    share["u"] = dispatch.FUSED_WIDE_MAX_UNION * 1.01
    assert s.choose(M, 5632, "auto", None, True) == "dense"


def test_prefill_hysteresis():
    """On the kernels, a layer keeps them up to HYSTERESIS past the threshold; off them, it takes
    them again only below the threshold itself."""
    s = SparseGatedMLP(8, 16)._twell_layer
    f, M = 1000, 1 << 30  # the tail term vanishes; limit 0.0102 f = 10.2 units, 10.71 on the kernels
    limit = LayerState.DEFAULT_MAX_DENSITY * f
    between = limit * (1 + LayerState.HYSTERESIS) / 2  # past the limit, within the hysteresis
    steps = [(between, "dense"), (limit * 0.98, "prefill"), (between, "prefill"),
             (limit * LayerState.HYSTERESIS * 1.02, "dense"), (between, "dense")]
    for est, want in steps:
        s.estimate = (est, 0.0)
        assert s.choose(M, f, "auto", None, False) == want, (est, want)


def test_prefill_cost_counts_the_longest_row():
    """cost = base + TAIL_WEIGHT * longest row / M: a short batch with one long row stays dense."""
    s = SparseGatedMLP(8, 16)._twell_layer
    s.estimate = (29.0, 60.0)
    assert s.cost(8192) == pytest.approx(29.0 + LayerState.TAIL_WEIGHT * 60.0 / 8192)
    s.estimate = (29.0, 0.0)
    assert s.choose(8192, 5632, "auto", None, False) == "prefill"
    s.estimate = (29.0, 400.0)  # 41.5 units per token of tail at 8192 tokens: 70.5, past 57.4 * 1.05
    assert s.choose(8192, 5632, "auto", None, False) == "dense"


def test_dense_branch_product_pass_by_capture(monkeypatch):
    """The dense branch multiplies relu(g) * u with PyTorch's two ops up to SMALL_M tokens outside
    a capture, and with the one-pass Triton kernel above GRAPH_SMALL_M inside one (same result;
    only which runs differs)."""
    import twell.kernels.elementwise as E

    m = SparseGatedMLP(24, 37).eval()
    s = m._twell_layer
    calls = []
    real = E.relu_mul_
    monkeypatch.setattr(E, "relu_mul_", lambda u, a: calls.append(a.shape[0]) or real(u, a))
    M = LayerState.GRAPH_SMALL_M + 37
    assert M <= LayerState.SMALL_M
    x = torch.randn(M, 24)
    w = (m.gate_proj.weight, m.down_proj.weight, m.up_proj.weight)
    with torch.no_grad():
        y_eager = s._dense(m, x, *w, False, False, capturing=False)
        assert calls == []
        y_graph = s._dense(m, x, *w, False, False, capturing=True)
        assert calls == [M]
    assert torch.equal(y_eager, y_graph)


def test_forward_post_hook_on_a_projection_takes_the_dense_math():
    """A forward hook (not only a pre-hook) on a projection sends the call to the dense math,
    which calls the projections and so runs the hook."""
    torch.manual_seed(5)
    m = SparseGatedMLP(16, 40).eval()
    m.kernel_mode = "decode"
    m.up_proj.register_forward_hook(lambda mod, inp, out: 3 * out)
    x = torch.randn(3, 16)
    with torch.no_grad():
        y = m(x)
    assert m._twell_layer.last_path is None
    want = (torch.relu(x @ m.gate_proj.weight.T) * (3 * (x @ m.up_proj.weight.T))) @ m.down_proj.weight.T
    assert rel_err(y, want) < 1e-5


def test_split_buffers_only_for_their_units():
    """The split decode kernels' kept list is made for one f: a call with another f gets buffers
    of its own, sized for its units, never the list sized for other units."""
    m = SparseGatedMLP(40, 100).eval()
    m.kernel_mode = "decode"
    s = m._twell_layer
    with torch.no_grad():
        m(torch.randn(8, 40))
    assert s.split_scratch is not None and s.split_scratch.f == 100
    s.k_est, s.union_rate = 0.5, None
    x = torch.randn(64, 40)
    assert s._split_for(x, 64, 100) is s.split_scratch
    own = s._split_for(x, 64, 72)
    assert own is not None and own is not s.split_scratch and own.f == 72
    assert s.choose(64, 72, "auto", None, True, x) == "decode"


# Every kernel path, by what the dispatcher ran: (kernel_mode, tokens, last_decode_kernels)
NAN_PATHS = [("prefill", 6, None), ("decode", 1, "fused"), ("decode", 5, "split"), ("decode", 70, "three-launch")]


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("mode,M,kernels", NAN_PATHS, ids=lambda v: str(v))
def test_nan_comes_out_where_dense_puts_it(mode, M, kernels, gated):
    """A NaN gate fires (relu keeps it), as in dense: a NaN in one token's input gives that
    token a NaN row (every gate of the row NaN: on the prefill path more than the TwELL slots
    hold, so the exact path; the split kernels' list-overflow path is tested in
    test_kernels_decode.py), the other rows dense's values; a NaN in one unit's gate weights (a
    NaN gate for every token, within the slots: the common path) gives NaN everywhere."""
    torch.manual_seed(M)
    cls = SparseGatedMLP if gated else SparseMLP
    m = cls(16, 40).eval()
    m.kernel_mode = mode
    first = m.gate_proj if gated else m.up_proj
    with torch.no_grad():
        first.weight.mul_(0.5).sub_(0.1)  # about a third of the units fire: short rows
    x = torch.randn(M, 16)
    bad = min(1, M - 1)
    x[bad, 3] = float("nan")
    with torch.no_grad():
        y = m(x)
    assert m.last_path == mode
    if kernels is not None:
        assert m._twell_layer.last_decode_kernels == kernels
    assert torch.isnan(y[bad]).all()
    rest = torch.ones(M, dtype=torch.bool)
    rest[bad] = False
    assert not torch.isnan(y[rest]).any()
    if gated:
        ref = (torch.relu(x @ m.gate_proj.weight.T) * (x @ m.up_proj.weight.T)) @ m.down_proj.weight.T
    else:
        ref = torch.relu(x @ m.up_proj.weight.T) @ m.down_proj.weight.T
    assert rel_err(y[rest], ref[rest]) < 1e-5
    x[bad, 3] = 0.0
    with torch.no_grad():
        first.weight[7] = float("nan")
        y = m(x)
    assert m.last_path == mode
    assert torch.isnan(y).all()


# --- the dispatcher's boundaries, second round (mutants that survived the tests above: each test
# below fails on one or more single-line changes of twell/inference/dispatch.py) -------


def test_probe_spacing_no_estimate_and_one_in_flight():
    """The first call of a spacing is probed (count 1 modulo PROBE_EVERY), every call is while no
    estimate has arrived yet, and none while a probe is in flight."""
    s = SparseGatedMLP(8, 16)._twell_layer
    s.k_est, s._union_fit_m = 1.0, 64
    assert s._want_probe("auto", False, PREFILL_MIN_M)  # the layer's first call
    assert not s._want_probe("auto", False, PREFILL_MIN_M)
    s.k_est = None  # the first probe's result has not come back
    assert s._want_probe("auto", False, PREFILL_MIN_M) and s._want_probe("auto", False, 16)
    s._event = object()  # one in flight (not polled here)
    assert not s._want_probe("auto", False, PREFILL_MIN_M) and not s._want_probe("auto", False, 16)


def test_prefill_threshold_is_inclusive():
    """A cost exactly at the limit takes the kernels (and, on them, exactly at the hysteresis)."""
    s = SparseGatedMLP(8, 16)._twell_layer
    f, M = 1000, 1 << 30
    s.estimate = (LayerState.DEFAULT_MAX_DENSITY * f, 0.0)
    assert s.choose(M, f, "auto", None, False) == "prefill"
    s.estimate = (LayerState.DEFAULT_MAX_DENSITY * f * LayerState.HYSTERESIS, 0.0)
    assert s.choose(M, f, "auto", None, False) == "prefill"


def test_prefill_limit_caps_the_default_in_units_and_honours_zero():
    """The default break-even is the lower of DEFAULT_MAX_DENSITY * f and a cap in units
    (DEFAULT_MAX_UNITS, or MAX_UNITS_BY_D for the call's width): at f 11008 the share alone
    allows 121 units, where the kernels lost at d 4096, so a layer of 70 units of unknown width
    runs dense and one of d 4096 runs the kernels to its own cap. A layer's own kernel_max_density replaces
    both, 0 included: 0 was read as "the default" (``max_density or DEFAULT``), so a layer set to
    0 still took the kernels."""
    s = SparseGatedMLP(8, 16)._twell_layer
    M = 1 << 30  # no tail term
    assert s.limit(1000, None) == pytest.approx(LayerState.DEFAULT_MAX_DENSITY * 1000)  # below the cap
    assert s.limit(11008, None) == LayerState.DEFAULT_MAX_UNITS < LayerState.DEFAULT_MAX_DENSITY * 11008
    assert s.limit(11008, 0.02) == pytest.approx(220.16)  # the layer's own share is not capped
    for est, max_density, want in [(70.0, None, "dense"), (60.0, None, "prefill"), (70.0, 0.011, "prefill"),
                                   (0.5, 0.0, "dense"), (0.0, 0.0, "prefill")]:
        s._on_kernels = False
        s.estimate = (est, 0.0)
        assert s.choose(M, 11008, "auto", max_density, False) == want, (est, max_density)
    # by width: d 4096 (and widths that pad to it) has its own cap, measured after the split
    # up/down; widths not listed keep DEFAULT_MAX_UNITS
    cap4 = LayerState.MAX_UNITS_BY_D[4096]
    assert LayerState.DEFAULT_MAX_UNITS < cap4 < LayerState.DEFAULT_MAX_DENSITY * 11008
    assert s.limit(11008, None, 4096) == s.limit(11008, None, 3000) == cap4 == LayerState.max_units(2049)
    assert LayerState.max_units(2048) == LayerState.max_units() == LayerState.DEFAULT_MAX_UNITS
    assert s.limit(11008, None, 2048) == s.limit(11008, None, 8192) == LayerState.DEFAULT_MAX_UNITS
    assert s.limit(5632, None, 4096) == pytest.approx(LayerState.DEFAULT_MAX_DENSITY * 5632)  # the share still bounds it
    assert s.limit(11008, 0.02, 4096) == pytest.approx(220.16)
    for d, est, want in [(4096, 90.0, "prefill"), (4096, cap4 + 1, "dense"), (2048, 90.0, "dense")]:
        s._on_kernels = False
        s.estimate = (est, 0.0)
        x = torch.empty(M, d, device="meta")  # the call's input gives the width
        assert s.choose(M, 11008, "auto", None, False, x) == want, (d, est)


def test_a_call_hands_its_input_to_the_choice(monkeypatch):
    """The module's calls give the layer's choice their input (the width sets the cap in units,
    LayerState.MAX_UNITS_BY_D): a layer of width 40 (padded: 64) with a cap of its own takes the
    kernels at an estimate the default cap sends to dense."""
    from twell.inference import dispatch

    m = SparseGatedMLP(40, 100).eval()
    layer = m._twell_layer
    seen = []
    real = layer.choose

    def spy(M, f, mode, max_density, capturing, x=None):
        seen.append(None if x is None else tuple(x.shape))
        # the call's mode is "prefill" (forced, for the interpreter); decide as "auto" would
        return real(M, f, "auto", max_density, False, x) if mode == "prefill" else real(M, f, mode, max_density, capturing, x)

    monkeypatch.setattr(layer, "choose", spy)
    monkeypatch.setattr(LayerState, "DEFAULT_MAX_DENSITY", 1.0)  # the share allows 100 units
    monkeypatch.setattr(LayerState, "DEFAULT_MAX_UNITS", 2.0)
    monkeypatch.setitem(LayerState.MAX_UNITS_BY_D, 64, 50.0)
    monkeypatch.setattr(dispatch, "EAGER_PREFILL_MIN_M", 1)
    monkeypatch.setattr(dispatch, "PREFILL_MIN_M", 1)
    monkeypatch.setattr(dispatch, "DECODE_MAX_M", 0)
    monkeypatch.setattr(layer, "_poll", lambda: None)  # keep the estimate set here
    m.kernel_mode = "prefill"
    x = torch.randn(300, 40)
    paths = []
    with torch.no_grad():
        for est in (10.0, 60.0):
            layer.estimate, layer._on_kernels = (est, 0.0), False
            m(x)
            paths.append(m.last_path)
    assert seen == [(300, 40), (300, 40)] and paths == ["prefill", "dense"]


def test_poll_reads_each_slot_of_a_probe():
    """A rows probe: k_est is the mean, k_rms the root mean square; a path without overflow puts
    the rms in the overflow slot as a placeholder (row_stats), which is not overflow; the prefill
    path's overflowed tiles per token and its rows above DENSE_ROW_MIN cost dense_row_cost each
    (computed whole), the cost's other terms taken over the remaining rows. A small dense call's
    union share (in the overflow slot) is fitted, and replaced by one measured on as many tokens
    or more."""
    from twell.inference.dispatch import row_stats
    from twell.kernels.updown import DENSE_ROW_MIN

    m = SparseGatedMLP(8, 16)  # (kept alive: the state prices rows computed whole by its shape)
    s = m._twell_layer
    row_cost = LayerState.dense_row_cost(16, 8)
    per_row = torch.tensor([10.0, 10.0, 10.0, 50.0])  # mean 20, rms 27.39, max 50
    mean, rms = 20.0, float(per_row.square().mean().sqrt())
    s._host, s._event, s._union_m, s._no_overflow = row_stats(per_row), Done(), 0, True
    s._poll()
    assert s.k_est == pytest.approx(mean) and s.k_rms == pytest.approx(rms)
    assert s.estimate == pytest.approx((mean + LayerState.RMS_WEIGHT * (rms - mean), 50.0))
    s._host, s._event, s._no_overflow = row_stats(per_row, torch.tensor(0.5)), Done(), False
    s._poll()
    assert s.estimate == pytest.approx((mean + LayerState.RMS_WEIGHT * (rms - mean) + 0.5 * row_cost, 50.0))
    # a row above DENSE_ROW_MIN: a quarter of the rows dense, the others' mean 7.5, rms 8.66, max 10
    long_row = torch.tensor([10.0, 10.0, 10.0, DENSE_ROW_MIN + 1.0])
    s._host, s._event = row_stats(long_row, torch.tensor(0.0)), Done()
    s._poll()
    assert s.k_est == pytest.approx(float(long_row.mean()))
    assert s.k_rms == pytest.approx(float(long_row.square().mean().sqrt()))  # all rows: decode's rule reads it
    light_rms = (300 / 4) ** 0.5
    light = 7.5 + LayerState.RMS_WEIGHT * (light_rms - 7.5)
    assert s.estimate == pytest.approx((light + 0.25 * row_cost, 10.0))
    # overflowed tiles and long rows are the same rows when a row has one tile: the larger share
    s._host, s._event = row_stats(long_row, torch.tensor(0.1)), Done()
    s._poll()
    assert s.estimate == pytest.approx((light + 0.25 * row_cost, 10.0))
    s._host, s._event = row_stats(long_row, torch.tensor(0.4)), Done()
    s._poll()
    assert s.estimate == pytest.approx((light + 0.4 * row_cost, 10.0))
    # a small dense call's probe: the union in the overflow slot, never read as overflow
    s._host, s._event, s._union_m = row_stats(per_row, torch.tensor(0.05)), Done(), 16
    s._poll()
    assert s.estimate == pytest.approx((mean + LayerState.RMS_WEIGHT * (rms - mean), 50.0))
    assert s._union_fit_m == 16 and s.union_share(16, 5632) == pytest.approx(0.05, rel=1e-6)
    # one of as many tokens replaces the fit, one of fewer does not
    s._host, s._event = row_stats(per_row, torch.tensor(0.08)), Done()
    s._poll()
    assert s._union_fit_m == 16 and s.union_share(16, 5632) == pytest.approx(0.08, rel=1e-6)
    s._host, s._event, s._union_m = row_stats(per_row, torch.tensor(0.5)), Done(), 8
    s._poll()
    assert s._union_fit_m == 16 and s.union_share(16, 5632) == pytest.approx(0.08, rel=1e-6)


@pytest.mark.parametrize("mode, M, capturing", [("dense", 5, False), ("dense", 70, True), ("prefill", 5, False),
                                                ("decode", 5, False)])
def test_run_writes_out_where_its_path_can(mode, M, capturing):
    """``LayerState.run(out=)`` (what an eager graph's capture passes): the dense and prefill paths
    write their result into ``out`` (pre-filled with NaN) and return it; the decode kernels return
    their own tensor. Every result equals the call without ``out``. 70 tokens as in a capture: the
    dense path's fused ``relu(g) * u`` pass. CPU; the kernels run in the interpreter."""
    torch.manual_seed(3)
    m = SparseGatedMLP(40, 100).eval()
    m.kernel_mode = mode
    s = m._twell_layer
    assert (M > s.GRAPH_SMALL_M) == capturing
    x = torch.randn(M, 40)
    with torch.no_grad():
        m._set_kernel_layout(mode != "dense")  # as eval() lays out a module whose path is not dense
        args = (x, m.gate_proj.weight, m.down_proj.weight, m.up_proj.weight)
        ref = s.run(*args, capturing=capturing)
        out = torch.full((M, 40), float("nan"))
        y = s.run(*args, capturing=capturing, out=out)
    assert s.last_path == mode
    assert (y.data_ptr() == out.data_ptr()) == (mode != "decode")
    assert (y is out) == (mode != "decode")  # the capture copies in only what is not out itself
    torch.testing.assert_close(y, ref)


def test_auto_prefill_calls_take_the_dense_rows_path():
    """The estimate prices long and overflowed rows as computed whole on tensor cores, which
    ffn_from_twell does from TWO_PASS_MIN_M tokens: every call "auto" sends to the prefill
    kernels (eager or in a capture) has at least that many."""
    from twell.kernels import updown

    assert min(PREFILL_MIN_M, EAGER_PREFILL_MIN_M) >= updown.TWO_PASS_MIN_M


def test_prefill_overflow_cost_counts_rows_computed_whole():
    """An overflowed tile per token costs dense_row_cost (its row is computed whole on tensor
    cores), whatever the tile; a probe of four slots (no dense-row statistics) reads so."""
    torch.manual_seed(9)
    m = SparseGatedMLP(40, 100).eval()
    m.kernel_mode = "prefill"
    with torch.no_grad():
        m(torch.randn(6, 40))
    s = m._twell_layer
    assert m.last_path == "prefill"
    s._host, s._event, s._union_m, s._no_overflow = torch.tensor([10.0, 12.0, 20.0, 0.5]), Done(), 0, False
    s._poll()
    assert s.estimate == pytest.approx((10.0 + LayerState.RMS_WEIGHT * 2.0 + 0.5 * LayerState.dense_row_cost(100, 40), 20.0))


def test_rows_computed_whole_cost_more_at_a_wider_layer():
    """A row computed whole costs about 2.4 times the default limit: 150 units at d 2048, f 5632
    (as measured on the H200), and at d 4096, f 11008 about 232. The H100 figures it was fitted
    to: heavy rows at 314 units per token on average, 35% of them computed whole, ran 0.83x dense
    at 4096 tokens and 0.96x at 16384 on the prefill kernels. The probe of that layer sends both
    calls to the dense path now (with 150 a row it took the kernels); heavy rows at 42 units per
    token (7% computed whole) stay on the kernels."""
    assert LayerState.dense_row_cost(5632, 2048) == pytest.approx(150.0, abs=0.5)
    assert LayerState.dense_row_cost(11008, 4096) == pytest.approx(232.3, abs=0.5)
    # widths pad to a power of two, as the limit's cap does
    assert LayerState.dense_row_cost(11008, 3000) == LayerState.dense_row_cost(11008, 4096)
    assert LayerState.dense_row_cost(11008, 4097) == pytest.approx(150.0, abs=0.5)
    m = SparseGatedMLP(4096, 11008, device="meta").eval()
    s = m._twell_layer
    x = torch.empty(16384, 4096, device="meta")
    # mean, rms, max, overflowed tiles per token; share computed whole, the rest's mean, rms, max
    heavy = torch.tensor([314.0, 480.0, 3000.0, 0.0, 0.351, 12.9, 30.5, 128.0])
    light = torch.tensor([42.0, 90.0, 900.0, 0.0, 0.067, 4.4, 16.3, 128.0])
    for stats, path in ((heavy, "dense"), (light, "prefill")):
        s._host, s._event, s._union_m, s._no_overflow, s._on_kernels = stats, Done(), 0, False, False
        assert s.choose(16384, 11008, "auto", None, False, x=x) == path, stats
        # 4096 tokens take the kernels only in a capture (an eager graph's too), on the estimate
        s._on_kernels = False
        assert s.choose(4096, 11008, "auto", None, True, x=x[:4096]) == path, stats


@pytest.mark.parametrize("track", [True, False])
def test_prefill_probe_publishes_rows_and_overflowed_tiles(track, monkeypatch):
    """A prefill call's probe publishes every row's true active units (overflowed tiles counted
    whole; from the kernels' row counts when tracking, else from the TwELL's counts) and the
    overflowed tiles per token, not rows: a tile of 32 units (four slots) puts the dense row's
    three full tiles over. CPU: LayerState._publish_rows spied (its copy to the host is CUDA's)."""
    from kernel_cases import gate_case
    from twell.inference import ops
    from twell.format import pack_twell

    M, d, f = 6, 40, 100
    x, wg, wu, wd = gate_case(M, d, f, torch.float32, seed=2)
    monkeypatch.setattr(ops, "default_tile", lambda f: 32)
    m = SparseGatedMLP(d, f).eval()
    m.track_stats = track
    with torch.no_grad():
        for lin, w in ((m.gate_proj, wg), (m.up_proj, wu), (m.down_proj, wd)):
            lin.weight.copy_(w)
    published = []
    monkeypatch.setattr(LayerState, "_publish_rows", lambda self, per_row, over, *a, **k: published.append((per_row, over)))
    pre = x @ wg.T
    g = pack_twell(torch.relu(pre), 32, ops.DEFAULT_COMPRESSION)
    over_tiles = int(g.overflowed().sum())
    assert over_tiles > int(g.overflowed().any(dim=1).sum()) > 0
    with torch.no_grad():
        y = m._twell_layer._prefill(m, x, wg, wd.T.contiguous(), wu, track, True)
    assert rel_err(y, R.gated_mlp(x.double(), wg.double(), wu.double(), wd.double())) < 1e-5
    (per_row, over), = published
    assert torch.equal(per_row, (pre > 0).sum(1).float())
    assert float(over) == pytest.approx(over_tiles / M)


def test_split_rule_bounds_are_inclusive():
    """The split kernels take a batch of exactly SPLIT_MAX_FIRES expected fires, tokens of exactly
    SPLIT_MAX_ROW_FIRES active units, and f up to (not including) their entry limit _MAX_F; the
    dispatcher makes their buffers for the same f only."""
    from twell.inference import dispatch
    from twell.kernels.decode_split import _MAX_F

    s = SparseGatedMLP(8, 16)._twell_layer
    s.k_est = dispatch.SPLIT_MAX_FIRES / 64  # 64 tokens: exactly SPLIT_MAX_FIRES fires
    assert s._split_pays(64, 5632) and s.choose(64, 5632, "auto", None, True) == "decode"
    s.k_est = float(dispatch.SPLIT_MAX_ROW_FIRES)  # 3 tokens: 3072 fires of 1024 per token
    assert s._split_pays(3, 5632) and s.choose(3, 5632, "auto", None, True) == "decode"
    s.k_est = None  # no measurement: split, within the units an entry can name
    assert s._split_pays(8, _MAX_F - 1) and not s._split_pays(8, _MAX_F)
    x = torch.zeros(8, 8)
    s._make_scratch(x, _MAX_F)
    assert s.split_scratch is None
    s._make_scratch(x, _MAX_F - 1)  # (the list's size does not depend on f)
    assert s.split_scratch is not None and s.split_scratch.f == _MAX_F - 1


def test_split_rule_limits_by_width():
    """At a width SPLIT_MAX_FIRES_BY_D lists (d 4096, and 3000, which pads to it), the split
    kernels take a batch while its fires counted by the mean active units are within the first
    limit and counted by their root mean square within the second, both inclusive; at d 2048
    (not listed) and with no width, SPLIT_MAX_FIRES bounds both, so a heavy batch that d 4096
    takes goes elsewhere."""
    from twell.inference import dispatch

    max_mean, max_rms = dispatch.SPLIT_MAX_FIRES_BY_D[4096]
    assert dispatch.SPLIT_MAX_FIRES < max_mean < max_rms
    s = SparseGatedMLP(8, 16)._twell_layer
    M = 40
    for d in (4096, 3000):
        s.k_est, s.k_rms = max_mean / M, max_mean / M  # even: exactly the mean limit
        assert s._split_pays(M, 11008, d)
        s.k_est = s.k_rms = max_mean / M * 1.01
        assert not s._split_pays(M, 11008, d)
        s.k_est, s.k_rms = 1.0, max_rms / M  # heavy: exactly the rms limit, a small mean
        assert s._split_pays(M, 11008, d)
        s.k_rms = max_rms / M * 1.01
        assert not s._split_pays(M, 11008, d)
    s.k_est, s.k_rms = 1.0, max_rms / M
    assert not s._split_pays(M, 5632, 2048) and not s._split_pays(M, 5632)
    s.k_est = s.k_rms = dispatch.SPLIT_MAX_FIRES / M
    assert s._split_pays(M, 5632, 2048) and s._split_pays(M, 5632)
    s.k_est, s.k_rms = None, None  # no probe yet: the fitted rate's count for both
    s.union_rate = max_mean / M / 11008
    assert s._split_pays(M, 11008, 4096) and not s._split_pays(M, 11008, 2048)


def test_fused_union_rule_switches_caps_at_the_widths_token_count(monkeypatch):
    """Above FUSED_WIDE_M_BY_D's token count for x's width (16 at d 4096), the fused kernel's
    union cap is FUSED_WIDE_MAX_UNION; at d 2048 the wide cap starts past FUSED_WIDE_M (32)."""
    from twell.inference import dispatch

    monkeypatch.setattr(dispatch, "DECODE_SPLIT", False)
    s = SparseGatedMLP(8, 16)._twell_layer
    monkeypatch.setattr(s, "union_share", lambda M, f: dispatch.FUSED_MAX_UNION)  # above the wide cap
    wide_m = dispatch.FUSED_WIDE_M_BY_D[4096]
    assert wide_m < dispatch.FUSED_WIDE_M
    for M, d, want in [(wide_m, 4096, "decode"), (wide_m + 1, 4096, "dense"), (wide_m + 1, 2048, "decode"),
                       (dispatch.FUSED_WIDE_M, 2048, "decode"), (dispatch.FUSED_WIDE_M + 1, 2048, "dense")]:
        assert s.choose(M, 11008, "auto", None, True, x=torch.zeros(M, d)) == want, (M, d)
    assert s.choose(wide_m + 1, 11008, "auto", None, True) == "decode"  # no x: FUSED_WIDE_M


def test_decode_buffers_made_up_to_the_largest_decode_batch():
    """An eager call of up to FUSED_MAX_M tokens (any path) makes the decode buffers a later
    capture needs; a larger one does not."""
    from twell.kernels.decode_fused import FUSED_MAX_M

    for M, made in ((FUSED_MAX_M + 1, False), (FUSED_MAX_M, True)):
        m = SparseGatedMLP(40, 100).eval()
        m.kernel_mode = "dense"  # (on the CPU the module itself never calls run in this mode)
        with torch.no_grad():
            m._twell_layer.run(torch.randn(M, 40), m.gate_proj.weight, m.down_proj.weight, m.up_proj.weight)
        assert m.last_path == "dense" and (m._twell_layer.split_scratch is not None) == made, M


def test_dense_probe_measures_the_union_up_to_the_largest_decode_batch(monkeypatch):
    from twell.kernels.decode_fused import FUSED_MAX_M

    torch.manual_seed(10)
    m = SparseGatedMLP(24, 37).eval()
    s = m._twell_layer
    got = {}
    monkeypatch.setattr(s, "_publish_rows", lambda per_row, over, union=None, union_m=0: got.update(union=union, union_m=union_m))
    x = torch.randn(FUSED_MAX_M, 24)
    with torch.no_grad():
        s._dense(m, x, m.gate_proj.weight, m.down_proj.weight, m.up_proj.weight, False, True)
    pattern = (x @ m.gate_proj.weight.T) > 0
    assert got["union_m"] == FUSED_MAX_M and float(got["union"]) == pytest.approx(float(pattern.any(0).float().mean()))


# --- torch.compile and the custom op (interpreter) ---------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_compile_fullgraph_runs_the_kernels(mode):
    torch.manual_seed(2)
    m = SparseGatedMLP(40, 100).eval()
    m.kernel_mode = mode
    x = torch.randn(2, 7, 40)
    with torch.no_grad():
        compiled = torch.compile(m, fullgraph=True)
        y = compiled(x)
    assert m.last_path == mode
    assert rel_err(y, _dense(m, x)) < 1e-5


def test_compile_traces_the_module_without_warnings():
    """Dynamo traces SparseGatedMLP.forward, its weight lookup included, without a warning (an
    lru_cache in that lookup made Dynamo warn of possible silent incorrectness)."""
    import warnings

    torch._dynamo.reset()
    m = SparseGatedMLP(16, 40).eval()
    x = torch.randn(3, 16)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        y = torch.compile(m, backend="eager", fullgraph=True)(x)
    assert not [w for w in caught if "dynamo" in str(w.filename).lower() or "lru_cache" in str(w.message)], \
        [str(w.message)[:200] for w in caught]
    assert rel_err(y, _dense(m, x)) < 1e-5


def test_custom_op_passes_opcheck():
    from twell.inference import custom_op  # noqa: F401

    torch.manual_seed(3)
    m = SparseGatedMLP(40, 100).eval()
    m.kernel_mode = "decode"
    x = torch.randn(5, 40)
    args = (x, m.gate_proj.weight.detach(), m.down_proj.weight.detach(), m.up_proj.weight.detach())
    torch.library.opcheck(torch.ops.twell.ffn_infer.default, args)
    y = torch.ops.twell.ffn_infer(*args)
    assert m.last_path == "decode"  # the op found m from its gate weight
    assert rel_err(y, _dense(m, x)) < 1e-5
    # weights no module owns (copies): the dense computation, with a warning
    with pytest.warns(RuntimeWarning, match="no twell module owns"):
        y2 = torch.ops.twell.ffn_infer(x, *(w.clone() for w in args[1:]))
    assert rel_err(y2, _dense(m, x)) < 1e-5


@pytest.mark.parametrize("mode", ["auto", "decode", "prefill"])
def test_custom_op_checks_its_arguments(mode):
    """Bad arguments to the op raise before any kernel: a wrong dtype, rank or size reached the
    decode kernels unchecked (an int64 "result", a read past the weights' end). The kernel paths
    name the argument (LayerState.run's check); the dense path (mode "auto" on the CPU) raises
    torch's own error, and takes any strides."""
    from twell.inference import custom_op  # noqa: F401

    m = SparseGatedMLP(16, 40).eval()
    m.kernel_mode = mode
    x = torch.randn(3, 16)
    wg, wd, wu = (p.detach() for p in (m.gate_proj.weight, m.down_proj.weight, m.up_proj.weight))
    op = torch.ops.twell.ffn_infer
    kernels = mode != "auto"
    with torch.no_grad():
        assert rel_err(op(x, wg, wd, wu), _dense(m, x)) < 1e-5
        assert op(x[:0], wg, wd, wu).shape == (0, 16)
        strided = x.t().contiguous().t()
        if not kernels:
            assert rel_err(op(strided, wg, wd, wu), _dense(m, x)) < 1e-5
        cases = [
            ((x[0], wg, wd, wu), ValueError, "x must be 2-D"),
            ((x[None], wg, wd, wu), ValueError, "x must be 2-D"),
            ((x.long(), wg, wd, wu), TypeError, "x must have dtype"),
            ((x.half(), wg, wd, wu), TypeError, "w_first .* must match x"),
            ((x[:, :8], wg, wd, wu), ValueError, r"w_first must be \[f, d\] = \[40, 8\]"),
            ((x, wg, wd, wu[:30]), ValueError, r"w_up must be \[f, d\] = \[40, 16\], got \[30, 16\]"),
            ((x, wg, wd[:, :30], wu), ValueError, r"w_down_t must be \[f, d\] = \[40, 16\], got \[30, 16\]"),
            ((strided, wg, wd, wu), ValueError, "unit-stride rows"),
        ]
        for args, error, match in cases if kernels else cases[:2] + cases[2:7]:
            if kernels or match == "x must be 2-D":
                with pytest.raises(error, match=match):
                    op(*args)
            else:
                with pytest.raises(RuntimeError):
                    op(*args)


def test_split_decode_kernels_and_their_rule(monkeypatch):
    """DECODE_SPLIT off: decode calls run the fused kernels and make no split buffers. On (the
    default): calls of SPLIT_MIN_M to 64 tokens whose expected fires (tokens times the measured
    mean active units, else the fitted rate times f) are at most SPLIT_MAX_FIRES take the split
    kernels (buffers made at the first eager call; with no estimate yet, split), others the fused
    ones, and forced calls of more than 64 tokens the three-launch kernels; every call gives the
    dense answer, and the statistics come from the kernels. Inside a capture, "auto" takes decode
    for a batch whose fires the split kernels can take although its union share is too large for
    the fused kernel."""
    from twell.inference import dispatch

    assert dispatch.DECODE_SPLIT  # the default
    torch.manual_seed(5)
    m = SparseGatedMLP(40, 100).eval()
    m.kernel_mode = "decode"
    state = m._twell_layer
    x = torch.randn(8, 40)
    monkeypatch.setattr(dispatch, "DECODE_SPLIT", False)
    with torch.no_grad():
        assert rel_err(m(x), _dense(m, x)) < 1e-5
    assert state.last_decode_kernels == "fused" and state.split_scratch is None
    monkeypatch.setattr(dispatch, "DECODE_SPLIT", True)
    with torch.no_grad():
        assert rel_err(m(x), _dense(m, x)) < 1e-5  # no estimate yet: split (buffers made first)
        assert state.last_decode_kernels == "split" and state.split_scratch is not None
        cases = [(3.0, None, 8, "split"), (3.0, None, dispatch.SPLIT_MIN_M - 1, "fused"), (3.0, None, 64, "split"),
                 (3.0, None, 65, "three-launch"), (100.0, None, 64, "fused"), (100.0, None, 16, "split"),
                 (None, 0.5, 64, "split"), (None, 0.9, 64, "fused")]
        for k, rate, M, expect in cases:  # f = 100: 64 tokens at k 100 are 6400 fires
            state.k_est, state.union_rate = k, rate
            xi = torch.randn(M, 40)
            assert rel_err(m(xi), _dense(m, xi)) < 1e-5, (k, rate, M)
            assert state.last_decode_kernels == expect, (k, rate, M)
        state.k_est, state.union_rate = 3.0, None
        m.track_stats = True
        y = m(x)
    assert state.last_decode_kernels == "split" and rel_err(y, _dense(m, x)) < 1e-5
    pattern = (x @ m.gate_proj.weight.T) > 0
    assert torch.equal(m.stats.unit_counts, pattern.sum(0)) and int(m.stats.active_max) == int(pattern.sum(1).max())
    assert int(state.split_scratch.fires()) == int(pattern.sum())
    # the capture's choice (k 29 of 5632 at 64 tokens: 1856 fires, 28% of the units in the batch)
    state.k_est, state.union_rate = 29.0, None
    assert state.choose(64, 5632, "auto", None, capturing=True) == "decode"
    assert state.choose(64, 5632, "auto", None, capturing=False) == "dense"  # eager small calls: dense
    state.k_est = 80.0  # 5120 fires
    assert state.choose(64, 5632, "auto", None, capturing=True) == "dense"
    monkeypatch.setattr(dispatch, "DECODE_SPLIT", False)
    state.k_est = 29.0
    assert state.choose(64, 5632, "auto", None, capturing=True) == "dense"
    monkeypatch.setattr(dispatch, "DECODE_SPLIT", True)
    # given the call's input, the split kernels take the layer's kept buffers where they fit it,
    # else buffers of the call's own (a capture made before any eager call keeps none): f = 100
    state.k_est = 0.5  # 64 tokens: 32 fires, 27% of the units
    x64 = torch.randn(64, 40)
    assert state.choose(64, 100, "auto", None, True, x64) == "decode"
    assert state._split_for(x64, 64, 100) is state.split_scratch
    own = state._split_for(x64.half(), 64, 100)  # the kept buffers are for fp32
    assert own is not state.split_scratch and own.gates.dtype == torch.float16
    assert state.choose(64, 100, "auto", None, True, x64.half()) == "decode"
    saved, state.split_scratch = state.split_scratch, None
    assert state.choose(64, 100, "auto", None, True, x64) == "decode" and state._split_for(x64, 64, 100) is not None
    state.split_scratch = saved
    # a model cast afterwards decodes on the split kernels with buffers of each call, exactly
    m.half()
    with torch.no_grad():
        y = m(x.half())
    assert state.last_decode_kernels == "split" and rel_err(y, _dense(m, x.half())) < 3e-3


def test_layers_share_the_decode_buffers():
    """The split kernels' list (and on CUDA the accumulator) is one per device and shape, shared
    by the layers: each call leaves it empty, so layers called in turn on one buffer each give
    their own dense answer and fires count; another f or dtype gets its own buffer, and the
    buffer goes with the last layer holding it."""
    import gc

    from twell.inference import dispatch

    torch.manual_seed(7)
    layers = [SparseGatedMLP(40, 100).eval() for _ in range(3)] + [SparseMLP(40, 100).eval()]
    others = [SparseGatedMLP(40, 72).eval(), SparseGatedMLP(40, 100).eval().half()]  # another f, dtype
    for m in layers + others:
        m.kernel_mode = "decode"
    x = torch.randn(8, 40)
    with torch.no_grad():
        for _ in range(2):
            for m in layers + others:
                xm = x.to(m.down_proj.weight.dtype)
                want = (_dense(m, xm) if isinstance(m, SparseGatedMLP) else
                        R.mlp(x.double(), m.up_proj.weight.double(), m.down_proj.weight.double()))
                assert rel_err(m(xm), want) < (3e-3 if xm.dtype == torch.half else 1e-5)
                assert m._twell_layer.last_decode_kernels == "split"
                first = m._first_projection().weight
                assert int(m._twell_layer.split_scratch.fires()) == int(((xm @ first.T) > 0).sum())
    scratches = {id(m._twell_layer.split_scratch) for m in layers}
    assert len(scratches) == 1 and all(id(o._twell_layer.split_scratch) not in scratches for o in others)
    assert others[0]._twell_layer.split_scratch is not others[1]._twell_layer.split_scratch
    key = next(k for k, v in dispatch._SCRATCH.items() if v is layers[0]._twell_layer.split_scratch)
    del layers, m
    gc.collect()
    assert key not in dispatch._SCRATCH


def test_decode_buffers_per_layer_when_not_shared(monkeypatch):
    from twell.inference import dispatch

    monkeypatch.setattr(dispatch, "SHARE_DECODE_BUFFERS", False)
    torch.manual_seed(8)
    layers = [SparseGatedMLP(40, 100).eval() for _ in range(2)]
    x = torch.randn(8, 40)
    with torch.no_grad():
        for m in layers:
            m.kernel_mode = "decode"
            assert rel_err(m(x), _dense(m, x)) < 1e-5 and m._twell_layer.last_decode_kernels == "split"
    assert layers[0]._twell_layer.split_scratch is not layers[1]._twell_layer.split_scratch


def test_decode_keeps_no_buffers_when_asked(monkeypatch):
    """DECODE_SCRATCH off: decode calls make their own buffers and keep none (no accumulator,
    no list, nothing in the shared table), yet take the same kernels as with kept buffers (the
    split kernels from SPLIT_MIN_M tokens, also in a capture's choice, and the fused one below)
    and give the dense answer, call after call, for several layers in turn, gated or not."""
    from twell.inference import dispatch

    monkeypatch.setattr(dispatch, "DECODE_SCRATCH", False)
    before = set(dispatch._SCRATCH.keys())
    torch.manual_seed(9)
    layers = [SparseGatedMLP(40, 100).eval(), SparseGatedMLP(40, 100).eval(), SparseMLP(40, 100).eval()]
    with torch.no_grad():
        for M, kernels in ((8, "split"), (2, "fused"), (64, "split"), (8, "split")):
            for m in layers:
                m.kernel_mode = "decode"
                x = torch.randn(M, 40)
                want = (_dense(m, x) if isinstance(m, SparseGatedMLP) else
                        R.mlp(x.double(), m.up_proj.weight.double(), m.down_proj.weight.double()))
                assert rel_err(m(x), want) < 1e-5, (M, type(m).__name__)
                state = m._twell_layer
                assert state.last_decode_kernels == kernels, M
                assert state.scratch is None and state.split_scratch is None
    assert set(dispatch._SCRATCH.keys()) == before
    # a kept accumulator from before the flag went off is not used (NaN-filled here)
    from twell.kernels.decode_fused import DecodeScratch

    state = layers[0]._twell_layer
    state.scratch = DecodeScratch(40, "cpu")
    state.scratch.acc.fill_(float("nan"))
    x = torch.randn(2, 40)
    with torch.no_grad():
        assert rel_err(layers[0](x), _dense(layers[0], x)) < 1e-5 and state.last_decode_kernels == "fused"
    state.scratch = None
    state.k_est, state.union_rate = 0.5, None  # 64 tokens: 32 fires, 27% of the units
    assert state.choose(64, 100, "auto", None, True, torch.randn(64, 40)) == "decode"
    assert state._split_for(torch.randn(64, 40), 64, 100).acc.shape == (64, 40)


def test_per_layer_compile_shares_one_graph():
    """Regional compilation (each decoder layer compiled on its own) must not compile once per
    layer: past dynamo's recompile limit (8) the other layers would silently run eager."""
    from torch._dynamo.utils import counters

    torch.manual_seed(4)
    layers = [SparseGatedMLP(24, 60).eval() for _ in range(3)]
    for m in layers:
        m.kernel_mode = "decode"
        m.compile(backend="eager", dynamic=False)
    x = torch.randn(3, 24)
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        for m in layers:
            assert rel_err(m(x), _dense(m, x)) < 1e-5
            assert m.last_path == "decode"
    assert counters["stats"]["unique_graphs"] == 1


# --- GPU ---------------------------------------------------------------------------------------


def _gpu_stack(layers=2, k=29, d=2048, f=5632, seed=0, M=8192):
    from twell.bench.synthetic import make_ffn

    mods, xs = [], None
    for i in range(layers):
        s = make_ffn(M, d, f, k, "even", dtype=torch.bfloat16, device="cuda", seed=seed + i)
        m = SparseGatedMLP(d, f, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            m.gate_proj.weight.copy_(s.w_gate)
            m.up_proj.weight.copy_(s.w_up)
            m.down_proj.weight.copy_(s.w_down)
        mods.append(m)
        xs = s.x if xs is None else xs
    return torch.nn.Sequential(*mods).eval(), xs


class _Residual(torch.nn.Module):
    """x + mlp(x) per layer, so that each layer sees the previous layer's (sparse-gated) input."""

    def __init__(self, stack):
        super().__init__()
        self.stack = stack

    def forward(self, x):
        for m in self.stack:
            x = x + m(x)
        return x


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 16, 24, 64, 1024, 8192])
def test_cuda_graph_replay_equals_eager(M, monkeypatch):
    monkeypatch.setattr(twell.inference.eager_graphs, "ENABLED", False)  # eager calls: twell's plain path
    stack, xs = _gpu_stack()
    model = _Residual(stack)
    x = xs[:M].clone()
    with torch.no_grad():
        for _ in range(3):  # eager calls: estimates arrive
            model(x)
            torch.cuda.synchronize()
        eager = model(x)
        paths = [m.last_path for m in stack]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            model(x)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = model(x)
        x.copy_(xs[:M])
        g.replay()
        torch.cuda.synchronize()
    assert paths[0] == ("dense" if M < EAGER_PREFILL_MIN_M else "prefill")  # eager
    # in the graph: decode up to 64 tokens (k = 29 of 5632: at most 1856 fires, within
    # dispatch.SPLIT_MAX_FIRES; one token on the fused kernel, within FUSED_MAX_UNION), else as eager
    assert stack[0].last_path == ("decode" if M <= 64 else paths[0])
    assert rel_err(out, eager) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("M,kernels,keep", [(6, "split", True), (8, "split", True), (12, "split", True),
                                           (1, "fused", False), (16, "split", False)])
def test_cuda_graph_replay_with_split_decode(M, kernels, keep, monkeypatch):
    """With DECODE_SPLIT on, a layer whose small eager calls measured a low union share takes
    the split kernels inside a capture (k 29 of 5632: 3% to 6% of the units active in a batch of
    6 to 12); replays equal eager (dense path) within bf16 rounding, and a replay after new
    inputs were copied in uses them. With DECODE_SCRATCH off (``keep`` False) the decode kernels
    take each call's own buffers (from the graph's pool) and the layer keeps none."""
    from twell.inference import dispatch
    from twell.bench.timing import capture

    monkeypatch.setattr(dispatch, "DECODE_SPLIT", True)
    monkeypatch.setattr(dispatch, "DECODE_SCRATCH", keep)
    stack, xs = _gpu_stack(layers=1)
    m = stack[0]
    x = xs[:M].clone()
    with torch.no_grad():
        for _ in range(3):  # eager calls: the union estimate arrives, the buffers are made (if kept)
            m(x)
            torch.cuda.synchronize()
        eager = m(x)
        captured = {}
        g = capture(lambda: captured.__setitem__("y", m(x)), warmup=1)
        g.replay()
        torch.cuda.synchronize()
        out = captured["y"]
        assert m.last_path == "decode" and m._twell_layer.last_decode_kernels == kernels
        kept = m._twell_layer.split_scratch is not None
        assert kept == keep and (keep or m._twell_layer.scratch is None)
        assert rel_err(out, eager) < 1e-2
        x.copy_(xs[M:2 * M])
        g.replay()
        torch.cuda.synchronize()
        assert rel_err(out, m(xs[M:2 * M].clone())) < 1e-2


@pytest.mark.gpu
def test_no_host_sync_at_any_batch_size():
    stack, xs = _gpu_stack(layers=1)
    with torch.no_grad():
        for M in (1, 64, 1024, 8192):
            stack(xs[:M])
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                for _ in range(10):
                    stack(xs[:M])
            finally:
                torch.cuda.set_sync_debug_mode(0)


def _expected_path(M):
    # k 29 of 5632 at d 2048: the decode kernels up to DECODE_MAX_M tokens (split from 3), the
    # prefill kernels from PREFILL_MIN_M (replayed from twell's graphs below EAGER_PREFILL_MIN_M)
    return "decode" if M <= DECODE_MAX_M else "prefill" if M >= 4096 else "dense"


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 4, 64, 4096, 8192])
def test_compiled_model_takes_the_eager_path_without_any_eager_call(M):
    """torch.compile(fullgraph=True), default mode, of a model that never ran eagerly: every layer
    takes the path eager calls take at that batch size (decode kernels from twell's own graphs
    at small batches, prefill kernels at large ones), with the eager output."""
    torch._dynamo.reset()
    eager_stack, xs = _gpu_stack(seed=7)
    stack, _ = _gpu_stack(seed=7)
    x = xs[:M].clone()
    eager_model, compiled = _Residual(eager_stack), torch.compile(_Residual(stack), fullgraph=True)
    with torch.no_grad():
        for _ in range(5):
            eager = eager_model(x)
            y = compiled(x)
        torch.cuda.synchronize()
    assert [m.last_path for m in stack] == [m.last_path for m in eager_stack]
    assert stack[0].last_path == _expected_path(M)
    assert rel_err(y, eager) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("M", [2, 64, 4096])
def test_reduce_overhead_compile_without_any_eager_call_captures_the_kernels(M):
    """mode="reduce-overhead" of a model that never ran eagerly: inductor's warm-up call takes the
    layer's first estimate (waited for), so its capture records the decode or prefill kernels,
    not a blind dense path, on every layer where eager calls take them (the second layer's input
    is the first's output, which its synthetic weights need not keep sparse: there eager calls
    run dense too); replays give the eager output."""
    torch._dynamo.reset()
    stack, xs = _gpu_stack(seed=9)
    eager_stack, _ = _gpu_stack(seed=9)
    model, eager_model = _Residual(stack), _Residual(eager_stack)
    x = xs[:M].clone()
    with torch.no_grad():
        compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
        for _ in range(4):
            y = compiled(x).clone()
            eager = eager_model(x)
        torch.cuda.synchronize()
    paths = [m.last_path for m in stack]  # what the capture recorded (replays call no op)
    assert paths == [m.last_path for m in eager_stack]
    assert paths[0] == _expected_path(M)
    assert rel_err(y, eager) < 1e-2


@pytest.mark.gpu
def test_reduce_overhead_compile_matches_eager():
    stack, xs = _gpu_stack()
    model = _Residual(stack)
    x = xs[:2].clone()
    with torch.no_grad():
        eager = model(x)
        compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
        for _ in range(4):
            y = compiled(x).clone()
        torch.cuda.synchronize()
    assert rel_err(y, eager) < 1e-2 and stack[0].last_path == "decode"  # recorded in a capture


_FSDP_EVAL = r"""
import os, torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.device_mesh import init_device_mesh
from twell import SparseGatedMLP
dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:%d")
torch.manual_seed(0)
mlp = SparseGatedMLP(32, 64)
model = torch.nn.Sequential(mlp)
mesh = init_device_mesh("cpu", (1,))
fully_shard(mlp, mesh=mesh)
fully_shard(model, mesh=mesh)
opt = torch.optim.SGD(model.parameters(), lr=1.0)
x = torch.randn(3, 32)
def err():
    g, u, d = (p.full_tensor().detach() for p in (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight))
    with torch.no_grad():
        return float((model(x) - (torch.relu(x @ g.T) * (x @ u.T)) @ d.T).abs().max())
model.eval(); mlp.kernel_mode = "decode"
w = mlp.down_proj.weight
print("STRIDES", tuple(w.stride()), tuple(w.to_local().stride()))
e1 = err()
model.train(); model(torch.randn(8, 32)).square().sum().backward(); opt.step(); opt.zero_grad(); model.eval()
print("ERRORS", e1, err())
dist.destroy_process_group()
"""


def _one_gloo_process(script: str) -> str:
    """stdout of ``script`` (a ``%d`` for the process group's port) run in one fresh Python
    process under the Triton interpreter; fails the test on a non-zero exit."""
    import subprocess
    import sys

    from test_train_dist import _free_port

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", script % _free_port()], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_fsdp2_eval_after_a_step_reads_the_current_weights():
    """Under FSDP2 the unsharded parameters are FSDP's buffers: the inference path must not lay
    them out anew (the module would read a stale copy after the next optimizer step); it runs
    dense there. One gloo process, the Triton interpreter, a kernel path forced."""
    stdout = _one_gloo_process(_FSDP_EVAL)
    e1, e2 = (float(v) for v in stdout.split("ERRORS")[1].split())
    assert e1 < 1e-5 and e2 < 1e-5, (e1, e2)
    # eval() left the DTensor and its local shard in the Hugging Face layout ([d, f] rows)
    assert stdout.split("STRIDES")[1].split("\n")[0].strip() == "(64, 1) (64, 1)", stdout


_FSDP_FROM_EVAL = r"""
import torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.device_mesh import init_device_mesh
from transformers import LlamaConfig, LlamaForCausalLM
import twell
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, hidden_act="relu")
early = twell.SparseGatedMLP(32, 64).eval()  # put in eval mode before the process group
dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:%d")
early.eval()
print("EARLY", tuple(early.down_proj.weight.stride()))
model = twell.sparsify(LlamaForCausalLM(cfg)).eval()  # as from_pretrained leaves a model
print("EVAL", tuple(model.model.layers[0].mlp.down_proj.weight.stride()))
mesh = init_device_mesh("cpu", (1,))
for layer in model.model.layers:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
model.train()
ids = torch.randint(0, 64, (2, 8))
model(ids, labels=ids).loss.backward()
print("GRAD", all(p.grad is not None for p in model.parameters()))
dist.destroy_process_group()
"""


def test_a_model_put_in_eval_mode_under_a_process_group_can_be_sharded():
    """The usual FSDP2 script: process group first, then a model in eval mode (from_pretrained
    leaves it so; sparsify keeps the mode), then fully_shard, which refuses non-contiguous
    parameters. Under a process group eval() therefore leaves the layout alone; a module put in
    eval mode before the group keeps the kernels' layout. One gloo process on the CPU."""
    stdout = _one_gloo_process(_FSDP_FROM_EVAL)
    lines = dict(line.split(" ", 1) for line in stdout.splitlines() if line.split(" ")[0] in ("EARLY", "EVAL", "GRAD"))
    assert lines == {"EARLY": "(1, 32)", "EVAL": "(64, 1)", "GRAD": "True"}, stdout


_PER_RANK_INFERENCE = r"""
import torch, torch.distributed as dist, warnings, twell
dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:%d")
torch.manual_seed(0)
m = twell.SparseGatedMLP(16, 40).eval()
m.kernel_mode = "prefill"
x = torch.randn(5, 16)
g, u, d = m.gate_proj.weight.detach(), m.up_proj.weight.detach(), m.down_proj.weight.detach()
ref = (torch.relu(x @ g.T) * (x @ u.T)) @ d.T
with warnings.catch_warnings(record=True) as ws, torch.no_grad():
    warnings.simplefilter("always")
    first, second = m(x), m(x)
print("BEFORE", m.last_path, sum("use_kernel_layout" in str(w.message) for w in ws))
print("LAID", twell.use_kernel_layout(m), twell.use_kernel_layout(m))
with torch.no_grad():
    y = m(x)
print("AFTER", m.last_path, float((y - ref).abs().max()), float((first - ref).abs().max()))
dist.destroy_process_group()
"""


def test_per_rank_inference_under_a_process_group():
    """Under a process group eval() leaves the layout alone, so a kernel path runs dense: once
    per process a warning says so and names twell.use_kernel_layout, which lays the module out
    (once: a second call finds nothing to do), after which the kernel path runs and is exact."""
    stdout = _one_gloo_process(_PER_RANK_INFERENCE)
    lines = {line.split(" ", 1)[0]: line.split(" ")[1:] for line in stdout.splitlines()}
    assert lines["BEFORE"] == ["dense", "1"], stdout
    assert lines["LAID"] == ["1", "0"], stdout
    assert lines["AFTER"][0] == "prefill" and max(float(v) for v in lines["AFTER"][1:]) < 1e-5, stdout


def test_use_kernel_layout_refuses_what_is_not_a_module():
    with pytest.raises(TypeError, match="torch.nn.Module"):
        twell.use_kernel_layout([SparseGatedMLP(8, 24)])


def test_eval_layout_leaves_weights_that_view_a_larger_buffer():
    """A down weight that is a view into a larger buffer (as FSDP1's flat parameter makes them)
    keeps pointing into it through eval(): laying it out anew would cut it loose from the buffer
    its owner updates. Weights that own their storage are laid out as usual."""
    m = twell.SparseGatedMLP(8, 12)
    flat = torch.zeros(8 * 12 + 5)
    m.down_proj.weight.data = flat[5:].view(8, 12)
    m.eval()
    assert m.down_proj.weight.data_ptr() == flat[5:].data_ptr() and m.down_proj.weight.is_contiguous()
    flat[5:].fill_(2.0)  # the owner's update is what the module reads
    assert torch.all(m.down_proj.weight == 2.0)
    own = twell.SparseGatedMLP(8, 12).eval()
    assert own.down_proj.weight.t().is_contiguous()  # the kernel layout


@pytest.mark.parametrize("cls", [SparseGatedMLP, SparseMLP])
def test_a_meta_module_takes_the_training_layout_when_materialised(cls, monkeypatch):
    """Built on the meta device in training mode, the down weight keeps the nn.Linear layout
    (what FSDP2's fully_shard accepts); to_empty() on a device that trains in the kernel layout
    (here the interpreter) lays it out there, before an optimizer records its strides."""
    from twell.training import path as train_path

    monkeypatch.setattr(train_path, "KERNEL_LAYOUT", True)
    monkeypatch.setattr(twell.nn, "triton_interpreting", lambda: True)
    m = cls(8, 16, device="meta")
    assert m.down_proj.weight.is_contiguous()
    m.to_empty(device="cpu")
    assert m.down_proj.weight.device.type == "cpu" and m.down_proj.weight.stride() == (1, 8)


def test_a_gradient_kept_from_eval_takes_the_training_layout(monkeypatch):
    """The other direction of test_layout_changes_carry_gradients_copies_and_swaps: a gradient
    kept in the kernel layout (accumulated in eval mode) becomes contiguous with its weight when
    training mode takes the nn.Linear layout, values unchanged."""
    from twell.training import path as train_path

    monkeypatch.setattr(train_path, "KERNEL_LAYOUT", False)
    m = SparseGatedMLP(8, 24).eval()
    w = m.down_proj.weight
    g = torch.randn(8, 24)
    w.grad = torch.empty_like(w).copy_(g)
    assert w.grad.stride() == (1, 8)
    m.train()
    assert w.is_contiguous() and w.grad.is_contiguous() and torch.equal(w.grad, g)


def test_use_kernel_layout_lays_out_every_module(monkeypatch):
    """Where eval() leaves the layout (a process group is up), use_kernel_layout lays out every
    twell FFN now, whatever its mode, and counts them; a second call finds nothing to do."""
    from twell.training import path as train_path

    monkeypatch.setattr(train_path, "KERNEL_LAYOUT", False)
    monkeypatch.setattr(twell.nn, "_distributed", lambda: True)
    model = torch.nn.Sequential(SparseGatedMLP(8, 24).eval(), SparseMLP(8, 24))
    assert all(m.down_proj.weight.is_contiguous() for m in twell.sparse_modules(model))
    assert twell.use_kernel_layout(model) == 2 and twell.use_kernel_layout(model) == 0
    assert all(m.down_proj.weight.stride() == (1, 8) for m in twell.sparse_modules(model))


_SHARDED_DOWN = r"""
import torch, torch.distributed as dist, twell
from torch.distributed.tensor import DeviceMesh, Shard, distribute_tensor
dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:%d")
m = twell.SparseGatedMLP(8, 16)
m.down_proj.weight = torch.nn.Parameter(distribute_tensor(m.down_proj.weight.detach(), DeviceMesh("cpu", [0]), [Shard(0)]))
w = m.down_proj.weight
ptr = w.to_local().data_ptr()
print("LAID", twell.use_kernel_layout(m), m.down_proj.weight is w, w.to_local().data_ptr() == ptr)
dist.destroy_process_group()
"""


def test_use_kernel_layout_leaves_sharded_weights_alone():
    """A down weight that is a DTensor (FSDP2's sharded parameter) is FSDP's: use_kernel_layout
    must not give it new data (it would be cut loose from what FSDP updates). One gloo process."""
    stdout = _one_gloo_process(_SHARDED_DOWN)
    assert "LAID 0 True True" in stdout, stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("M", [16, 256, 1024])
def test_dense_probe_never_raises_the_peak_and_measures_the_pattern(M, monkeypatch):
    """An eager dense call that takes the sparsity probe allocates no more at its peak than one
    that does not, and the probe's mean active units per token (and, up to 64 tokens, the share
    of units active in the batch) are the pattern's."""
    monkeypatch.setattr(twell.inference.eager_graphs, "ENABLED", False)  # eager calls: the dense path
    stack, xs = _gpu_stack(layers=1, M=1024)
    m = stack[0]
    s = m._twell_layer
    x = xs[:M].contiguous()
    pattern = (x @ m.gate_proj.weight.T) > 0

    def peak(probe: bool) -> int:
        torch.cuda.synchronize()
        s._poll()
        assert s._event is None
        s._calls = 0 if probe else 1  # the probe runs at the call whose count is 1 modulo its spacing
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        m(x)
        torch.cuda.synchronize()
        assert m.last_path == "dense" and (s._event is not None) == probe
        return torch.cuda.max_memory_allocated() - base

    with torch.no_grad():
        for _ in range(3):
            m(x)
        plain, probed = peak(False), peak(True)
        torch.cuda.synchronize()
        s._poll()
    assert probed <= plain, (probed, plain)
    assert s.k_est == pytest.approx(float(pattern.sum(1).float().mean()), rel=1e-6)
    if M <= 64:
        assert s.union_share(M, pattern.shape[1]) == pytest.approx(float(pattern.any(0).float().mean()), rel=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_small_eager_calls_measure_the_union_and_make_the_decode_accumulator(monkeypatch):
    """Eager calls of 16 tokens run dense, and their probes (every PROBE_EVERY_SMALL calls)
    measure the share of units active for some token of the batch: the layer's union estimate
    for 16 tokens then equals the measured share, and the fused decode's accumulator exists
    before any capture."""
    monkeypatch.setattr(twell.inference.eager_graphs, "ENABLED", False)  # eager calls: the dense path
    stack, xs = _gpu_stack(layers=1)
    m = stack[0]
    x = xs[:16].contiguous()
    with torch.no_grad():
        for _ in range(3):
            m(x)
            torch.cuda.synchronize()
    s = m._twell_layer
    assert m.last_path == "dense" and s.union_rate is not None
    share = float(((x.float() @ m.gate_proj.weight.float().T) > 0).any(0).float().mean())
    assert s.union_share(16, 5632) == pytest.approx(share, rel=0.02)
    # 64 rows: the split kernels' accumulator too (dispatch.DECODE_SPLIT), with their list beside it
    assert s.scratch is not None and s.scratch.acc.shape == (64, 2048) and bool(torch.all(s.scratch.acc == 0))
    assert s.split_scratch is not None and s.split_scratch.acc is s.scratch.acc


@pytest.mark.gpu
@pytest.mark.parametrize("mode,M,kernels", [("prefill", 4096, None), ("decode", 1, "fused"), ("decode", 16, "split"),
                                            ("decode", 64, "split"), ("decode", 100, "three-launch")])
def test_gpu_nan_comes_out_where_dense_puts_it(mode, M, kernels):
    """bf16 at the real shape (k 29): a NaN in one token's input gives that token a NaN row and
    the others dense's values; a NaN in one unit's gate weights gives NaN everywhere (the
    hardware's unordered compare, `setp.gtu`, on every kernel path)."""
    stack, xs = _gpu_stack(layers=1)
    m = stack[0]
    m.kernel_mode = mode
    x = xs[:M].clone()
    x[M // 2, 5] = float("nan")
    with torch.no_grad():
        y = m(x)
    assert m.last_path == mode
    if kernels is not None:
        assert m._twell_layer.last_decode_kernels == kernels
    rest = torch.ones(M, dtype=torch.bool, device="cuda")
    rest[M // 2] = False
    assert torch.isnan(y[M // 2]).all() and not torch.isnan(y[rest]).any()
    assert rel_err(y[rest].float(), _dense(m, x)[rest].float()) < 1e-2
    x[M // 2, 5] = 0.0
    with torch.no_grad():
        m.gate_proj.weight[77, 3] = float("nan")
        y = m(x)
    assert m.last_path == mode and torch.isnan(y).all()


# --- eager calls replayed from twell's own CUDA graphs (twell.inference.eager_graphs) ---------------------


class _FakeGraph:
    """Stands in for a CUDA graph on the CPU: a replay writes y = 2 x, after a pause that lets
    another thread run (a GPU replay is asynchronous: the host moves on before it is done)."""

    def __init__(self, x, y):
        self.x, self.y, self.replays = x, y, 0

    def replay(self):
        import time

        self.replays += 1
        x = self.x.clone()
        time.sleep(1e-4)
        self.y.copy_(2 * x)


def _fake_capture(self, state, x, w_first, w_down, w_up, key):
    from twell.inference.eager_graphs import _Graph, _buffer, _output

    xs, out = _buffer(x, key[1]), _output(x, key[1])  # shared by the layers, as on the GPU
    out.y.fill_(float("nan"))
    g = self._graphs[key] = _Graph(_FakeGraph(xs, out.y), xs, out, "decode", "fused")
    self.captures += 1
    return g


def test_eager_graphs_bookkeeping(monkeypatch):
    """When a size is captured, what a replay returns, and when graphs are dropped or no longer
    made (sizes per layer, weights moved, too many moves); CPU, with a stand-in graph."""
    from twell.inference import eager_graphs as EG

    monkeypatch.setattr(EG.EagerGraphs, "_capture", _fake_capture)
    state = LayerState(SparseGatedMLP(4, 8))
    g = EG.EagerGraphs()
    wf, wu, wd = torch.randn(8, 4), torch.randn(8, 4), torch.randn(4, 8)

    def call(M, w_down=wd, seed=0):
        x = torch.randn(M, 4, generator=torch.Generator().manual_seed(seed))
        return x, g.call(state, x, wf, w_down, wu)

    for i in range(EG.CAPTURE_AFTER - 1):
        assert call(3)[1] is None and g.captures == 0
    x, y = call(3)
    assert g.captures == 1 and g.replays == 1 and g.last and state.last_path == "decode"
    torch.testing.assert_close(y, 2 * x)
    del y  # (a held output is test_eager_graphs_hand_out_their_buffer's)
    x2, y2 = call(3, seed=1)  # a replay reads the new input
    torch.testing.assert_close(y2, 2 * x2)
    del y2
    assert g.captures == 1 and g.replays == 2 and len(g) == 1 and g.held_outputs == 0
    with torch.inference_mode():  # its own graph: inference tensors are written only in inference mode
        assert all(call(3)[1] is None for _ in range(EG.CAPTURE_AFTER - 1))
        assert call(3)[1] is not None and len(g) == 2
    for M in range(4, 4 + EG.MAX_SIZES):
        for _ in range(EG.CAPTURE_AFTER):
            call(M)
    assert len(g) == EG.MAX_SIZES  # the ninth size is not captured
    # a weight that moved: every graph dropped, the count starts again
    wd2 = wd.clone()
    assert call(3, wd2)[1] is None and len(g) == 0 and g.recaptures == 1
    for _ in range(EG.CAPTURE_AFTER - 1):
        call(3, wd2)
    assert len(g) == 1
    # the same address, fewer units (a weight sliced in place): dropped too
    for _ in range(EG.CAPTURE_AFTER):
        call(3, wd2)
    assert len(g) == 1 and call(3, wd2[:, :6])[1] is None and len(g) == 0 and g.recaptures == 2
    for _ in range(EG.CAPTURE_AFTER):  # back to the full weight: captured again
        call(3, wd2)
    assert len(g) == 1
    # moving weights once too often stops the layer's captures for good
    for i in range(EG.MAX_RECAPTURES):
        w = wd.clone()
        for _ in range(EG.CAPTURE_AFTER):
            call(3, w)
    assert g.disabled is not None and "moved" in g.disabled and call(3, w)[1] is None and len(g) == 0


def test_eager_graphs_hand_out_their_buffer(monkeypatch):
    """A replay returns its graph's output buffer (no copy) while nobody holds an earlier output
    of it; a call that finds one held (by the caller, by a view of it, as its own input, or by a
    caller of another layer sharing the buffer) leaves it intact: the layer captures again on a
    new buffer, and that size hands out copies from then on. HAND_OUT False: copies always. CPU,
    with a stand-in graph."""
    from twell.inference import eager_graphs as EG

    monkeypatch.setattr(EG.EagerGraphs, "_capture", _fake_capture)
    monkeypatch.setattr(EG, "_COPY_KEYS", set())
    state = LayerState(SparseGatedMLP(4, 8))
    g, other, third = EG.EagerGraphs(), EG.EagerGraphs(), EG.EagerGraphs()  # layers sharing buffers
    wf, wu, wd = torch.randn(8, 4), torch.randn(8, 4), torch.randn(4, 8)

    def call(layer, M=5, seed=0, x=None):
        if x is None:
            x = torch.randn(M, 4, generator=torch.Generator().manual_seed(seed))
        return x, layer.call(state, x, wf, wd, wu)

    def buffer_of(layer, M=5):
        return layer._graphs[(M, False)].out.y

    for layer in (g, other):
        for _ in range(EG.CAPTURE_AFTER - 1):
            call(layer)
    for _ in range(EG.CAPTURE_AFTER):
        call(third)  # captured on the shared buffer; its outputs dropped
    x, y = call(g)
    assert buffer_of(g).data_ptr() == y.data_ptr()  # handed out, not copied
    torch.testing.assert_close(y, 2 * x)
    del y
    x, y = call(other, seed=1)  # the other layer's graph writes the same buffer: nobody holds it
    assert buffer_of(other).data_ptr() == buffer_of(g).data_ptr() == y.data_ptr()
    torch.testing.assert_close(y, 2 * x)
    view, first = y[1:], y.data_ptr()  # the caller keeps a view, not the tensor it got
    del y
    x2, y2 = call(g, seed=2)
    torch.testing.assert_close(view, (2 * x)[1:])  # not written over
    torch.testing.assert_close(y2, 2 * x2)
    assert g.held_outputs == 1 and g.captures == 2 and len(g) == 1
    assert buffer_of(g).data_ptr() != first and y2.data_ptr() != buffer_of(g).data_ptr()
    # the other layer's graph still writes the held buffer: it captures again too, on the new one
    x3, y3 = call(other, seed=3)
    torch.testing.assert_close(view, (2 * x)[1:])
    torch.testing.assert_close(y3, 2 * x3)
    assert other.held_outputs == 1 and buffer_of(other).data_ptr() == buffer_of(g).data_ptr() != y3.data_ptr()
    # a layer whose graph still writes the given-away buffer, once its holder let go: it
    # replays there (nobody holds it) but hands out a copy, as every buffer of that size now does
    del view
    x4, y4 = call(third, seed=9)
    torch.testing.assert_close(y4, 2 * x4)
    assert third.held_outputs == 0 and third.captures == 1 and y4.data_ptr() != first
    # copies from then on: outputs kept by the caller cost no more captures
    kept = [call(layer, seed=4 + i) for i in range(3) for layer in (g, other)]
    for xi, yi in kept:
        torch.testing.assert_close(yi, 2 * xi)
    assert g.captures == other.captures == 2 and g.held_outputs == other.held_outputs == 1
    # an output passed back in as the input: the buffer it views is not replayed over before it is read
    layer = EG.EagerGraphs()
    for _ in range(EG.CAPTURE_AFTER):
        x, y = call(layer, M=6)
    assert y.data_ptr() == buffer_of(layer, 6).data_ptr()
    _, y2 = call(layer, x=y)
    torch.testing.assert_close(y2, 4 * x)
    assert layer.held_outputs == 1
    # a layer's first capture of a size while another layer's output of that size is kept: the
    # new graph must not take (and replay into) the kept buffer
    first, second = EG.EagerGraphs(), EG.EagerGraphs()
    for _ in range(EG.CAPTURE_AFTER):
        x, y = call(first, M=8)
    assert y.data_ptr() == buffer_of(first, 8).data_ptr()
    for _ in range(EG.CAPTURE_AFTER):
        x2, y2 = call(second, M=8, seed=5)
    torch.testing.assert_close(y, 2 * x)
    torch.testing.assert_close(y2, 2 * x2)
    assert second.held_outputs == 1 and buffer_of(second, 8).data_ptr() != y.data_ptr()
    # a caller that keeps only the output's storage object
    layer = EG.EagerGraphs()
    for _ in range(EG.CAPTURE_AFTER):
        x, y = call(layer, M=9)
    storage, expected = y.untyped_storage(), (2 * x).flatten()
    del y
    call(layer, M=9, seed=6)
    assert layer.held_outputs == 1
    torch.testing.assert_close(torch.tensor([], dtype=x.dtype).set_(storage), expected)
    # HAND_OUT off: a copy every call
    monkeypatch.setattr(EG, "HAND_OUT", False)
    layer = EG.EagerGraphs()
    for _ in range(EG.CAPTURE_AFTER + 1):
        x, y = call(layer, M=7)
        assert y is None or y.data_ptr() != buffer_of(layer, 7).data_ptr()
    torch.testing.assert_close(y, 2 * x)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 4, 16, 64, 256, 1024])
@pytest.mark.filterwarnings("error::RuntimeWarning")  # a failed capture warns
def test_eager_graphs_replay_equals_the_plain_path(M, monkeypatch):
    """Eager small calls: captured at the third call of a size and replayed after; every output
    (checked after the later calls ran, with the graphs' output buffers pre-filled with NaN)
    equals the plain eager path's on the same input, and each layer captured once. 256 and 1024
    tokens with MAX_M raised to them (the dense path's graphs)."""
    from twell.inference import eager_graphs as EG

    monkeypatch.setattr(EG, "MAX_M", max(EG.MAX_M, M))
    monkeypatch.setattr(EG, "_COPY_KEYS", set())
    stack, xs = _gpu_stack()
    model = _Residual(stack)
    inputs = [xs[i * M:(i + 1) * M].clone() for i in range(5)]
    outs = []
    with torch.no_grad():
        for i, x in enumerate(inputs):
            if i == EG.CAPTURE_AFTER:
                for m in stack:
                    for g in m.eager_graphs._graphs.values():
                        g.out.y.fill_(float("nan"))
            outs.append(model(x))
        assert all(m.eager_graphs.captures == 1 and m.eager_graphs.last for m in stack)
        assert [m.eager_graphs.replays for m in stack] == [5 - EG.CAPTURE_AFTER + 1] * 2
        path = stack[0].last_path
        monkeypatch.setattr(EG, "ENABLED", False)
        refs = [model(x) for x in inputs]
    # as inside a user's capture (test_cuda_graph_replay_equals_eager)
    assert path == ("decode" if M <= 64 else "dense")
    assert all(m.eager_graphs.held_outputs == 0 for m in stack)
    for out, ref in zip(outs, refs):
        assert not torch.isnan(out).any() and rel_err(out, ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("M", [4, 64, 4096])
@pytest.mark.filterwarnings("error::RuntimeWarning")  # a failed capture warns
def test_eager_graphs_outputs_kept_from_the_first_call_stay_intact(M, monkeypatch):
    """Forward hooks that keep every MLP output from the first call on: no graph ever replays
    into a kept output (the second layer's first capture finds the first layer's output held),
    and every kept output equals the plain path's."""
    from twell.inference import eager_graphs as EG

    monkeypatch.setattr(EG, "_COPY_KEYS", set())
    stack, xs = _gpu_stack(layers=1 if M == 4096 else 2, k=8 if M == 4096 else 29, M=max(8192, 6 * M))
    model = _Residual(stack)
    inputs = [xs[i * M:(i + 1) * M].clone() for i in range(6)]

    def run(kept):
        hooks = [m.register_forward_hook(lambda mod, inp, out: kept.append(out)) for m in stack]
        outs = []
        for x in inputs:
            outs.append(model(x))
            torch.cuda.synchronize()
        for h in hooks:
            h.remove()
        return kept + outs

    with torch.no_grad():
        got = run([])
        assert all(m.eager_graphs.last and m.eager_graphs.held_outputs >= 1 for m in stack)
        monkeypatch.setattr(EG, "ENABLED", False)
        ref = run([])
    for out, r in zip(got, ref):
        assert rel_err(out, r) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("M", [4, 64, 4096])
@pytest.mark.filterwarnings("error::RuntimeWarning")  # a failed capture warns
def test_eager_graphs_outputs_kept_by_hooks_stay_intact(M, monkeypatch):
    """Replayed outputs are the graphs' shared buffer while the model drops them (a residual
    stack); forward hooks that keep every MLP output make the layers capture again on copies, and
    every kept output equals the plain path's (none written over by a later replay). 4096
    tokens: the prefill band's graphs (k 8), one layer (the second layer's input, x + mlp(x), is
    not sparse enough for the band to capture it)."""
    from twell.inference import eager_graphs as EG

    monkeypatch.setattr(EG, "_COPY_KEYS", set())
    stack, xs = _gpu_stack(layers=1 if M == 4096 else 2, k=8 if M == 4096 else 29, M=max(8192, 6 * M))
    model = _Residual(stack)
    inputs = [xs[i * M:(i + 1) * M].clone() for i in range(6)]
    with torch.no_grad():
        for x in inputs[:4]:
            model(x)
            torch.cuda.synchronize()  # the first sparsity probe arrives: the band captures at the third call
        assert all(m.eager_graphs.last and m.eager_graphs.held_outputs == 0 for m in stack)
        buffers = {g.out.y.data_ptr() for m in stack for g in m.eager_graphs._graphs.values()}
        assert len(buffers) == 1  # one shared output buffer, handed out and dropped
        if M == 4096:
            assert stack[0].last_path == "prefill"
        kept = []
        hooks = [m.register_forward_hook(lambda mod, inp, out: kept.append(out)) for m in stack]
        outs = [model(x) for x in inputs[4:]]
        for h in hooks:
            h.remove()
        assert all(m.eager_graphs.held_outputs == 1 and m.eager_graphs.captures == 2 for m in stack)
        monkeypatch.setattr(EG, "ENABLED", False)
        ref_kept = []
        hooks = [m.register_forward_hook(lambda mod, inp, out: ref_kept.append(out)) for m in stack]
        refs = [model(x) for x in inputs[4:]]
        for h in hooks:
            h.remove()
    for out, ref in zip(kept + outs, ref_kept + refs):
        assert rel_err(out, ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.filterwarnings("error::RuntimeWarning")  # a failed capture warns
def test_eager_graphs_follow_the_weights():
    """A graph reads weights updated in place; a weight replaced (or laid out again by
    train()/eval()) drops the layer's graphs and the next ones read the new weight; inference mode
    and no_grad calls each get their own graph."""
    stack, xs = _gpu_stack(layers=1)
    m = stack[0]
    x = xs[:4].clone()

    def check(ctx=torch.no_grad):
        with ctx():
            for _ in range(3):
                m(x)  # dropped: a kept output would make the layer capture again (on copies)
            y = m(x)
        assert m.eager_graphs.last
        assert rel_err(y.double(), _dense(m, x)) < 1e-2

    check()
    with torch.no_grad():
        m.up_proj.weight.mul_(-0.5)
        m.gate_proj.weight[:, :7] *= -1
    check()
    assert m.eager_graphs.captures == 1
    m.down_proj.weight = torch.nn.Parameter(m.down_proj.weight.detach() * 3)
    m.train()
    m.eval()
    check()
    assert m.eager_graphs.captures == 2 and m.eager_graphs.recaptures == 1
    check(torch.inference_mode)
    check()
    assert m.eager_graphs.captures == 3 and len(m.eager_graphs) == 2
    with torch.no_grad():  # above MAX_M tokens: never captured
        for _ in range(4):
            m(xs[:twell.inference.eager_graphs.MAX_M + 1])
    assert not m.eager_graphs.last and m.eager_graphs.captures == 3


def test_eager_graphs_prefill_band_slots_and_hysteresis(monkeypatch):
    """Band sizes (above MAX_M) have MAX_BAND_SIZES slots of their own, so they never take the
    decode sizes' slots; a capture's path choices leave the layer's eager prefill hysteresis as
    it was (CPU, stand-in graphs)."""
    from twell.inference import eager_graphs as EG

    w = torch.randn(8, 4), torch.randn(4, 8), torch.randn(8, 4)
    state = LayerState(SparseGatedMLP(4, 8))
    state._on_kernels = True

    def flipping(self, st, *args):
        st._on_kernels = False  # as LayerState.choose does inside a capture's choice
        return None

    g = EG.EagerGraphs()
    monkeypatch.setattr(EG.EagerGraphs, "_capture_path", flipping)
    for _ in range(EG.CAPTURE_AFTER):
        assert g.call(state, torch.randn(3, 4), *w) is None
    assert state._on_kernels is True
    monkeypatch.setattr(EG.EagerGraphs, "_capture", _fake_capture)
    monkeypatch.setattr(EG, "MAX_M", 4)
    for M in (5, 6, 7, 1, 2, 3, 4):
        for _ in range(EG.CAPTURE_AFTER):
            g.call(state, torch.randn(M, 4), *w)
    sizes = sorted(k[0] for k in g._graphs)
    assert sizes == [1, 2, 3, 4, 5, 6] and EG.MAX_BAND_SIZES == 2


def test_eager_graphs_weights_key_and_recapture_limit(monkeypatch):
    """What test_eager_graphs_bookkeeping leaves out: a replaced up weight or an input of another
    dtype drops the layer's graphs; a layer still captures after exactly MAX_RECAPTURES moves and
    stops at the next; a size captured in inference mode first and in no_grad after gets an input
    buffer per mode (an inference tensor cannot be written outside inference mode). CPU, with a
    stand-in graph."""
    from twell.inference import eager_graphs as EG

    monkeypatch.setattr(EG.EagerGraphs, "_capture", _fake_capture)
    state = LayerState(SparseGatedMLP(4, 8))
    wf, wu, wd = torch.randn(8, 4), torch.randn(8, 4), torch.randn(4, 8)

    def capture(g, M=11, w_up=wu, w_down=wd, dtype=torch.float32):
        for _ in range(EG.CAPTURE_AFTER):
            x = torch.randn(M, 4, dtype=dtype)
            y = g.call(state, x, wf, w_down, w_up)
        torch.testing.assert_close(y, 2 * x)
        return x

    g = EG.EagerGraphs()
    capture(g)
    assert len(g) == 1 and g.call(state, torch.randn(11, 4), wf, wd, wu.clone()) is None and len(g) == 0
    capture(g)
    assert g.call(state, torch.randn(11, 4, dtype=torch.float64), wf, wd, wu) is None and len(g) == 0
    assert g.recaptures == 2
    g = EG.EagerGraphs()
    capture(g)
    # each move a new address: the clones are held, since a freed clone's memory may come back
    # for the next one (the key reads addresses; same address, same graph, rightly)
    moves = [wd.clone() for _ in range(EG.MAX_RECAPTURES)]
    for w in moves:
        capture(g, w_down=w)
    assert g.disabled is None and len(g) == 1 and g.recaptures == EG.MAX_RECAPTURES
    assert g.call(state, torch.randn(11, 4), wf, wd.clone(), wu) is None and g.disabled is not None
    g = EG.EagerGraphs()
    with torch.inference_mode():
        capture(g, M=12)
    with torch.no_grad():
        capture(g, M=12)
    assert len(g) == 2


def test_eager_graphs_band_sizes_leave_the_decode_slots_free(monkeypatch):
    """The decode sizes' MAX_SIZES slots and the band's MAX_BAND_SIZES are counted apart whatever
    the order: band sizes captured after the decode slots are full still get theirs, and neither
    kind takes more than its own. CPU, stand-in graphs."""
    from twell.inference import eager_graphs as EG

    monkeypatch.setattr(EG.EagerGraphs, "_capture", _fake_capture)
    monkeypatch.setattr(EG, "MAX_M", 4)
    monkeypatch.setattr(EG, "MAX_SIZES", 3)
    w = torch.randn(8, 4), torch.randn(4, 8), torch.randn(8, 4)
    state = LayerState(SparseGatedMLP(4, 8))
    g = EG.EagerGraphs()
    for M in (1, 2, 3, 5, 6, 4, 7):
        for _ in range(EG.CAPTURE_AFTER):
            g.call(state, torch.randn(M, 4), *w)
    assert sorted(k[0] for k in g._graphs) == [1, 2, 3, 5, 6] and EG.MAX_BAND_SIZES == 2


def test_eager_graphs_threads_share_the_buffers_one_call_at_a_time(monkeypatch):
    """Two layers share the input and output buffers of a size; calls from two threads at once
    still return each its own answer (CPU, stand-in graphs that pause mid-replay)."""
    import threading

    from twell.inference import eager_graphs as EG

    monkeypatch.setattr(EG.EagerGraphs, "_capture", _fake_capture)
    w = torch.randn(8, 4), torch.randn(4, 8), torch.randn(8, 4)
    layers = [(LayerState(SparseGatedMLP(4, 8)), EG.EagerGraphs()) for _ in range(2)]
    for state, g in layers:
        for _ in range(EG.CAPTURE_AFTER):
            g.call(state, torch.randn(3, 4), w[0], w[1], w[2])
    assert layers[0][1]._graphs[(3, False)].x is layers[1][1]._graphs[(3, False)].x
    bad = []

    def work(state, g, seed):
        gen = torch.Generator().manual_seed(seed)
        for _ in range(30):
            x = torch.randn(3, 4, generator=gen)
            y = g.call(state, x, w[0], w[1], w[2])
            if not torch.equal(y, 2 * x):
                bad.append(seed)

    threads = [threading.Thread(target=work, args=(*layers[i], i)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad


@pytest.mark.gpu
def test_eager_graphs_not_with_statistics_or_a_forced_path():
    """Statistics must count every call and a forced path is a test of that path: neither is
    replayed from a graph."""
    stack, xs = _gpu_stack(layers=1)
    m = stack[0]
    x = xs[:4].clone()
    with torch.no_grad():
        m.track_stats = True
        for _ in range(5):
            m(x)
        assert m.eager_graphs.captures == 0 and int(m.tokens_seen) == 20
        m.track_stats = None
        m.kernel_mode = "dense"
        for _ in range(5):
            m(x)
        assert m.eager_graphs.captures == 0 and m.last_path == "dense"
        m.kernel_mode = "auto"
        for _ in range(3):
            m(x)
    assert m.eager_graphs.captures == 1 and m.eager_graphs.last


@pytest.mark.gpu
@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_eager_graphs_on_cublas_survive_other_graphs_dying():
    """Dense-path graphs (cuBLAS) of one layer keep working, and write nowhere else, after another
    layer's graphs are destroyed and the allocator's cache is emptied: their cuBLAS workspace lives
    in the graphs' pool, not in memory the allocator may hand out again."""
    stack, xs = _gpu_stack(k=280)  # 64 tokens at k 280: most units fire for the batch, so dense
    a, b = stack
    x = xs[:64].clone()
    with torch.no_grad():
        for _ in range(3):
            a(x), b(x)
        assert a.last_path == b.last_path == "dense" and a.eager_graphs.last and b.eager_graphs.last
        a.up_proj.weight = torch.nn.Parameter(a.up_proj.weight.detach().clone())
        a(x)  # drops a's graph
        assert len(a.eager_graphs) == 0
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        sentinels = [torch.full((1 << 20,), 7.0, device="cuda") for _ in range(64)]  # 256 MiB
        outs = [b(xs[i * 64:(i + 1) * 64].clone()) for i in range(8)]
        torch.cuda.synchronize()
    assert all(bool((t == 7.0).all()) for t in sentinels)
    for i, out in enumerate(outs):
        assert rel_err(out.double(), _dense(b, xs[i * 64:(i + 1) * 64])) < 1e-2


@pytest.mark.gpu
def test_a_failed_eager_capture_leaves_torch_working(monkeypatch):
    """A capture that raises: the call runs eagerly with the right answer, one warning says why,
    no layer of the device captures again, and random numbers and user captures still work."""
    from twell.inference import eager_graphs as EG

    monkeypatch.setattr(EG, "_BROKEN", {})  # this test's verdict stays here
    stack, xs = _gpu_stack(layers=2)
    a, b = stack
    x = xs[:4].clone()
    run = LayerState.run

    def broken(self, *args, **kw):
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("broken on purpose")
        return run(self, *args, **kw)

    with torch.no_grad():
        with monkeypatch.context() as mp:
            mp.setattr(LayerState, "run", broken)
            with pytest.warns(RuntimeWarning, match="broken on purpose"):
                for _ in range(3):
                    y = a(x)
        assert a.eager_graphs.disabled is not None and not a.eager_graphs.last
        assert rel_err(y.double(), _dense(a, x)) < 1e-2
        for _ in range(4):
            b(x)
        assert b.eager_graphs.captures == 0 and b.eager_graphs.disabled is not None
        torch.rand(10, device="cuda")
        g = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            a(x)
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(g):
            out = a(x)
        g.replay()
        torch.cuda.synchronize()
    assert rel_err(out.double(), _dense(a, x)) < 1e-2


@pytest.mark.gpu
def test_eager_graphs_across_streams():
    """Calls alternating between two streams (each waiting for the other's result as a caller
    would) get the right answers: the shared buffers are ordered between the streams."""
    stack, xs = _gpu_stack(layers=1)
    m = stack[0]
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    outs, inputs = [], [xs[i:i + 1].clone() for i in range(12)]
    torch.cuda.synchronize()
    with torch.no_grad():
        for i, x in enumerate(inputs):
            with torch.cuda.stream(s1 if i % 2 else s2):
                outs.append(m(x))
    torch.cuda.synchronize()
    assert m.eager_graphs.replays >= 9
    for x, out in zip(inputs, outs):
        assert rel_err(out.double(), _dense(m, x)) < 1e-2


@pytest.mark.gpu
def test_eager_graphs_warm_up_on_the_callers_stream(monkeypatch):
    """A capture's warm-up runs on the caller's stream and the capture on twell's capture stream:
    a warm-up stream of its own would keep a second cuBLAS workspace (32 MiB on the H200) once a
    dense-path call was captured."""
    from twell.inference import dispatch
    from twell.inference import eager_graphs as EG

    stack, xs = _gpu_stack(layers=1)
    m = stack[0]
    x = xs[:128].clone()  # 128 tokens: the dense path, whose matmuls call cuBLAS
    seen = []
    run = dispatch.LayerState.run

    def recording(self, *args, **kwargs):
        seen.append((torch.cuda.current_stream().cuda_stream, torch.cuda.is_current_stream_capturing()))
        return run(self, *args, **kwargs)

    monkeypatch.setattr(dispatch.LayerState, "run", recording)
    caller = torch.cuda.Stream()
    caller.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(caller):
        outs = [m(x).clone() for _ in range(EG.CAPTURE_AFTER + 1)]  # (no output held: one capture)
    torch.cuda.synchronize()
    assert m.eager_graphs.captures == 1 and m.last_path == "dense"
    capture_stream = EG._capture_stream(x.device).cuda_stream
    # eager calls, then the warm-up (caller's stream, not capturing), then the capture
    assert seen[-2] == (caller.cuda_stream, False), seen
    assert seen[-1] == (capture_stream, True), seen
    ref = _dense(m, x)
    for out in outs:
        assert rel_err(out.double(), ref) < 1e-2


@pytest.mark.gpu
def test_hf_generate_with_eager_graphs_follows_the_dense_model(monkeypatch):
    """Hugging Face ``generate`` as most users call it (eager, dynamic cache) on a sparsified
    Llama: from the third step each MLP replays its graph, and every step's logits equal a
    teacher-forced dense forward of the generated sequence within bf16 rounding."""
    from twell.inference import eager_graphs as EG
    from twell.bench.model import calibrate_sparsity
    from twell.nn import sparse_modules
    from twell.recipe.model import make_config

    torch.manual_seed(0)
    config = make_config("tiny", 300)
    config.hidden_act = "relu"
    config.use_cache = True  # one token per step through the KV cache: what this test is about
    model = LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()
    calibrate_sparsity(model, 8, torch.randint(0, 300, (2, 64), device="cuda"))
    twell.sparsify(model)
    model.eval()
    prompt = torch.randint(0, 300, (2, 9), device="cuda")
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=16, do_sample=False,
                             return_dict_in_generate=True, output_logits=True)
        mlps = sparse_modules(model)
        assert all(m.eager_graphs.replays >= 12 for m in mlps), [m.eager_graphs.replays for m in mlps]
        monkeypatch.setattr(EG, "ENABLED", False)
        ref = model(out.sequences).logits[:, prompt.shape[1] - 1:-1].float()  # 50 tokens: the dense path
    got = torch.stack(out.logits, dim=1).float()
    assert rel_err(got, ref) < 2e-2


@pytest.mark.gpu
def test_eager_graphs_prefill_band(monkeypatch):
    """With twell.inference.eager_graphs.PREFILL_BAND on (the default), eager calls of
    4096 to 8191 tokens replay a graph of the prefill kernels where a capture would take them,
    with the plain path's answer; a layer whose capture would run dense keeps its eager calls."""
    from twell.inference import eager_graphs as EG

    monkeypatch.setattr(EG, "PREFILL_BAND", True)
    stack, xs = _gpu_stack(layers=1)
    m = stack[0]
    x = xs[:4096].clone()
    with torch.no_grad():
        for i in range(2):
            m(xs[i * 4096:(i + 1) * 4096].clone())
            torch.cuda.synchronize()
        outs = [m(x) for _ in range(3)]
    # captured at the third call; the fourth found that output kept (in outs) and captured again
    # on a new buffer, handing out copies since
    assert m.eager_graphs.captures == 2 and m.eager_graphs.held_outputs == 1
    assert m.eager_graphs.last and m.last_path == "prefill"
    ref = _dense(m, x)
    for out in outs:
        assert rel_err(out.double(), ref) < 1e-2
    dense_layer, xs2 = _gpu_stack(layers=1, k=280)  # k 280: the prefill kernels do not pay
    with torch.no_grad():
        for _ in range(5):
            dense_layer(xs2[:4096])
    assert dense_layer[0].eager_graphs.captures == 0 and dense_layer[0].last_path == "dense"


def test_optimizer_hook_leaves_other_optimizers_and_parametrized_weights_alone():
    """The global step pre-hook runs before every optimizer's step: per-parameter state that is
    not a dict (a tensor, a list: other optimizers keep such) must pass untouched, and a
    parametrized down_proj (spectral_norm) must not be recomputed by the walk (its power
    iteration would advance at every step of any optimizer)."""
    import gc

    from torch.nn.utils.parametrizations import spectral_norm

    from twell import optim_layout

    torch.manual_seed(5)
    live = SparseGatedMLP(8, 24)  # a registered module, so the hook is installed and walks
    spectral_norm(live.down_proj)

    class KeepsTensorsAndLists(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {"lr": 0.1})

        @torch.no_grad()
        def step(self):
            for group in self.param_groups:
                for i, p in enumerate(group["params"]):
                    st = self.state[p] = self.state.get(p, torch.zeros_like(p) if i % 2 else [0])
                    if isinstance(st, torch.Tensor):
                        st.add_(p.grad)
                    else:
                        st[0] += 1
                    p.add_(p.grad, alpha=-group["lr"])

    few = [torch.nn.Parameter(torch.randn(3, 4)) for _ in range(2)]
    more_modules = [SparseGatedMLP(4, 8) for _ in range(2)]  # so that the hook walks opt's state
    assert len(optim_layout._MODULES) >= len(few)
    opt = KeepsTensorsAndLists(few)
    for p in few:
        p.grad = torch.ones_like(p)
    opt.step()
    opt.step()  # the second step meets the tensor and list states
    assert opt.state[few[0]] == [2] and torch.equal(opt.state[few[1]], torch.full((3, 4), 2.0))
    del more_modules

    # an optimizer with more state entries than live twell modules: the hook walks the modules
    gc.collect()
    many = [torch.nn.Parameter(torch.randn(2)) for _ in range(len(optim_layout._MODULES) + 16)]
    sgd = torch.optim.SGD(many, lr=0.1, momentum=0.9)
    for p in many:
        p.grad = torch.ones_like(p)
    sgd.step()
    gc.collect()
    assert len(sgd.state) > len(optim_layout._MODULES)
    u = live.down_proj.parametrizations.weight[0]._u.clone()
    sgd.step()
    assert torch.equal(u, live.down_proj.parametrizations.weight[0]._u)
    live.eval()  # nor do the layout switches (a plain nn.Linear's train() leaves _u alone too)
    live.train()
    assert torch.equal(u, live.down_proj.parametrizations.weight[0]._u)


def test_optimizer_hook_walks_a_snapshot_of_the_modules(monkeypatch):
    """A module built on another thread while the hook walks the registry (follow_layout adds
    it) must not stop the walk: iterating the WeakSet itself raised "Set changed size during
    iteration" then. Here the set adds a module as soon as it is iterated."""
    import weakref

    from twell import optim_layout

    torch.manual_seed(7)
    m = SparseGatedMLP(8, 24)
    late = []

    class AddsWhileIterated(weakref.WeakSet):
        def __iter__(self):
            for i, item in enumerate(super().__iter__()):
                if i == 0:
                    late.append(SparseGatedMLP(8, 24))  # registers itself with follow_layout
                yield item

    registry = AddsWhileIterated([m])
    monkeypatch.setattr(optim_layout, "_MODULES", registry)
    params = [torch.nn.Parameter(torch.randn(2)) for _ in range(4)]  # more state than modules
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    opt.step()


def test_inference_ops_have_no_autograd_wrapper():
    """twell's inference ops are registered with one kernel for every backend and no Autograd
    kernel: ``torch.library.custom_op`` would add one, a Python wrapper that redispatches and
    checks aliasing on every call, which cost a compiled model more host time per layer than
    the op's own work at a few tokens."""
    import twell.inference.custom_op  # noqa: F401
    import twell.inference.fp8_ops  # noqa: F401

    for name in ("twell::ffn_infer", "twell::ffn_fp8"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeExplicitAutograd"), name
        assert not torch._C._dispatch_has_kernel_for_dispatch_key(name, "Autograd"), name

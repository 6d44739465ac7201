"""The inference runtime as users run it: every batch size, default settings, eager and in CUDA
graphs, host time and peak memory beside GPU time (``twell bench batch``), and small batches in
CUDA graphs (``twell bench decode``).

Dense is :class:`DenseMLP`, the three-``nn.Linear`` PyTorch MLP (what Hugging Face's LlamaMLP
computes with a ReLU gate); twell is :class:`twell.SparseGatedMLP` in eval mode with default
settings. Both hold the same weights, one copy each, and run side by side in one process.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
from torch import nn

from .inference import errors, machine_info, reference_fp32
from .synthetic import make_ffn
from .timing import alternating, chain_graph_ms, eager_ms, graph_ms, host_us, interleaved_ms

__all__ = ["DenseMLP", "batch_grid", "compile_compare", "decode_grid"]

D, F = 2048, 5632


class DenseMLP(nn.Module):
    """``down(relu(gate(x)) * up(x))`` with three ``nn.Linear``: the dense baseline."""

    def __init__(self, d: int, f: int, device=None, dtype=None):
        super().__init__()
        kw = dict(bias=False, device=device, dtype=dtype)
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(d, f, **kw), nn.Linear(d, f, **kw), nn.Linear(f, d, **kw)

    def forward(self, x):
        return self.down_proj(torch.relu(self.gate_proj(x)) * self.up_proj(x))


def _pair(s) -> tuple[nn.Module, nn.Module]:
    from .. import SparseGatedMLP

    d, f = s.w_gate.shape[1], s.w_gate.shape[0]
    dense = DenseMLP(d, f, device="cuda", dtype=torch.bfloat16).eval()
    twell = SparseGatedMLP(d, f, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        for m in (dense, twell):
            m.gate_proj.weight.copy_(s.w_gate)
            m.up_proj.weight.copy_(s.w_up)
            m.down_proj.weight.copy_(s.w_down)
    return dense, twell.eval()


def _peak(fn: Callable[[], object], weights: int) -> int:
    """Weight bytes plus the most memory allocated above what was allocated before the call."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return weights + int(torch.cuda.max_memory_allocated() - base)


def _warm(twell, x, calls: int = 3) -> None:
    for _ in range(calls):  # the layer's first estimate arrives after a call completes
        twell(x)
        torch.cuda.synchronize()


def batch_grid(Ms=(1, 4, 16, 64, 256, 1024, 4096, 16384, 131072), ks=(29, 280), dists=("even", "heavy"),
               log: Callable[[str], None] = print, d: int = D, f: int = F) -> list[dict]:
    """The batch grid: one record per (M, k, distribution) for an MLP of width ``d`` and ``f``
    units; see ``twell bench batch --help``."""
    info = machine_info()
    out = []
    for k in ks:
        for dist in dists:
            s = make_ffn(max(Ms), d, f, k, dist, dtype=torch.bfloat16, device="cuda", seed=k + 11)
            dense, twell = _pair(s)
            weights = 3 * d * f * 2
            for M in Ms:
                t0 = time.time()
                x = s.x[:M].contiguous()
                with torch.no_grad():
                    _warm(twell, x)
                    rec = dict(M=M, k=k, distribution=dist, d=d, f=f)
                    rec["k_measured"] = float(((x.float() @ s.w_gate.float().T) > 0).sum(dim=1).float().mean()) if M <= 16384 else None
                    # eager small batches are bound by the host, whose speed drifts: call by call in
                    # turn up to 16384 tokens (a 131072-token call takes 14 ms: one round each)
                    if M <= 16384:
                        rec["dense_ms"], rec["twell_ms"] = interleaved_ms([lambda: dense(x), lambda: twell(x)],
                                                                          calls=200 if M <= 1024 else 50)
                    else:
                        rec["dense_ms"], rec["twell_ms"] = alternating(eager_ms, [lambda: dense(x), lambda: twell(x)], rounds=1)
                    rec["path"] = twell.last_path
                    rec["hot_units"] = twell._twell_layer.last_hot_units  # (dispatch.HOT_UNITS)
                    rec["eager_graph"] = twell.inference.eager_graphs.last  # replayed from twell's own graph
                    rec["dense_graph_ms"], rec["twell_graph_ms"] = alternating(
                        graph_ms, [lambda: dense(x), lambda: twell(x)], rounds=3 if M <= 16384 else 1)
                    rec["graph_path"] = twell.last_path
                    calls, rounds = (20, 7) if M <= 16384 else (3, 3)
                    rec["host_us"], rec["dense_host_us"] = alternating(
                        lambda fn: host_us(fn, calls=calls, rounds=rounds), [lambda: twell(x), lambda: dense(x)],
                        rounds=3 if M <= 16384 else 1)
                    ref = reference_fp32(x, s.w_gate, s.w_up, s.w_down)
                    rec["rel_err"], rec["max_row_err"] = errors(twell(x), ref)
                    rec["dense_rel_err"], rec["dense_max_row_err"] = errors(dense(x), ref)
                    del ref
                    rec["peak_bytes"] = _peak(lambda: twell(x), weights)
                    rec["dense_peak_bytes"] = _peak(lambda: dense(x), weights)
                rec["speedup"] = rec["dense_ms"] / rec["twell_ms"]
                rec["graph_speedup"] = rec["dense_graph_ms"] / rec["twell_graph_ms"]
                rec.update(info)
                out.append(rec)
                log(f"M={M:6d} k={k:3d} {dist:6s} eager {rec['dense_ms']:.4f}/{rec['twell_ms']:.4f} x{rec['speedup']:.2f} ({rec['path']}{'*' if rec['eager_graph'] else ''}) "
                    f"graph {rec['dense_graph_ms']:.4f}/{rec['twell_graph_ms']:.4f} x{rec['graph_speedup']:.2f} ({rec['graph_path']}) "
                    f"host {rec['host_us']:.0f}/{rec['dense_host_us']:.0f} us err {rec['rel_err']:.1e} "
                    f"row {rec['max_row_err']:.1e}/{rec['dense_max_row_err']:.1e} "
                    f"peak {rec['peak_bytes'] / 2**20:.0f}/{rec['dense_peak_bytes'] / 2**20:.0f} MiB [{time.time() - t0:.1f}s]")
            del s, dense, twell
            torch.cuda.empty_cache()
    return out


class ResidualStack(nn.Module):
    """``h + mlp(h)`` for each MLP in turn."""

    def __init__(self, mlps):
        super().__init__()
        self.mlps = nn.ModuleList(mlps)

    def forward(self, h):
        for m in self.mlps:
            h = h + m(h)
        return h


def residual_stacks(M: int = 16384, layers: int = 4, k: int = 29) -> tuple[tuple[nn.Module, nn.Module], torch.Tensor]:
    """``((dense, twell), x)``: two residual stacks of ``layers`` MLPs with the same weights, eval
    mode, and the input ``x [M, d]``. Every layer is sparse at about ``k``: each is made so for
    inputs distributed as ``x`` (:func:`twell.bench.synthetic.make_ffn`), and its ``w_down`` is
    damped by ``DAMP_DOWN`` with row 0 zeroed, so that the residual stream keeps that distribution
    (channel 0, the gates' threshold input, stays 1; the rest gains under 0.1% of its variance
    per layer). Undamped, the residual sum grew layer by layer and layers 2 to 4 had 270 to
    1200 active units (all dense path)."""
    pairs = []
    for i in range(layers):
        s = make_ffn(M, D, F, k, "even", dtype=torch.bfloat16, device="cuda", seed=100 + i)
        s.w_down.mul_(DAMP_DOWN)
        s.w_down[0] = 0.0
        pairs.append(_pair(s))
    x = make_ffn(M, D, F, k, "even", dtype=torch.bfloat16, device="cuda", seed=100).x
    return tuple(ResidualStack([p[i] for p in pairs]).eval() for i in (0, 1)), x


DAMP_DOWN = 0.05


def compile_compare(M: int = 16384, layers: int = 4, k: int = 29, log: Callable[[str], None] = print) -> list[dict]:
    """A residual stack of ``layers`` MLPs, dense and twell, eager and ``torch.compile``d
    (default mode, ``fullgraph=True``): milliseconds per forward."""
    import torch._dynamo

    out = []
    stacks, x = residual_stacks(M, layers, k)
    with torch.no_grad():
        for name, model in zip(("dense", "twell"), stacks):
            for m in model.mlps:
                _warm(m, x, 1)
            eager = model(x)
            ms = eager_ms(lambda: model(x))
            t0 = time.time()
            compiled = torch.compile(model, fullgraph=True)
            y = compiled(x)
            torch.cuda.synchronize()
            compile_s = time.time() - t0
            for _ in range(10):  # settle after compiling, as the eager side was warmed
                compiled(x)
            torch.cuda.synchronize()
            cms = eager_ms(lambda: compiled(x))
            rec = dict(variant=name, M=M, layers=layers, k=k, eager_ms=ms, compiled_ms=cms, compile_s=compile_s,
                       compiled_rel_to_eager=float((y.float() - eager.float()).norm() / eager.float().norm()),
                       paths=[getattr(m, "last_path", None) for m in model.mlps])
            out.append(rec)
            log(f"{name}: eager {ms:.3f} ms, compiled {cms:.3f} ms (compile {compile_s:.0f} s), paths {rec['paths']}")
            torch._dynamo.reset()
    dense, tw = out
    for r in out:
        r["eager_speedup"] = dense["eager_ms"] / tw["eager_ms"]
        r["compiled_speedup"] = dense["compiled_ms"] / tw["compiled_ms"]
    return out


CHAIN_LAYERS = 8
GRAPH_ROUNDS = 3  # decode_grid's rounds of dense and twell in graphs, alternating


def decode_grid(Ms=(1, 4, 16, 64, 256), ks=(8, 29, 56), dists=("even", "skewed"), layers: int = CHAIN_LAYERS,
                log: Callable[[str], None] = print, d: int = D, f: int = F) -> list[dict]:
    """The decode grid's MLP records, both sides in CUDA graphs: twell with default settings (after
    eager warm-up calls) and with the decode kernels forced, against dense.

    ``*_graph_us`` (and ``speedup``) time ``layers`` layers with their own copies of the weights
    back to back in one graph, per layer (:func:`twell.bench.timing.chain_graph_ms`): each
    layer's weights cold in L2 because the other layers' reads evicted them, as in a model's
    decoding step; dense and twell medians of GRAPH_ROUNDS alternating rounds, the forced
    decode kernels' of one. ``*_flushed_us`` (and ``speedup_flushed``) time one layer's graph with
    L2 zeroed before each replay (``triton.testing.do_bench``), which leaves dirty lines a cold read
    must write back first."""
    info = machine_info()
    out = []
    for k in ks:
        for dist in dists:
            s = make_ffn(4096, d, f, k, dist, dtype=torch.bfloat16, device="cuda", seed=k + 23)
            pairs = [_pair(s) for _ in range(layers)]
            denses, twells = [p[0] for p in pairs], [p[1] for p in pairs]
            dense, twell = pairs[0]
            for M in Ms:
                x = s.x[:M].contiguous()
                with torch.no_grad():
                    for t in twells:
                        _warm(t, x)
                    rec = dict(M=M, k=k, distribution=dist, d=d, f=f, chain_layers=layers, graph_rounds=GRAPH_ROUNDS)
                    union = int(((x.float() @ s.w_gate.float().T) > 0).any(dim=0).sum())
                    rec["union"] = union
                    # three alternating rounds, medians: timing dense first, once, read 0.94x at 256
                    # tokens on the dense branch (H200, d 4096)
                    rec["dense_graph_us"], rec["twell_graph_us"] = (1e3 * v for v in alternating(
                        chain_graph_ms, [[lambda m=m: m(x) for m in denses], [lambda m=m: m(x) for m in twells]],
                        rounds=GRAPH_ROUNDS))
                    rec["dense_flushed_us"] = 1e3 * graph_ms(lambda: dense(x))
                    rec["twell_flushed_us"] = 1e3 * graph_ms(lambda: twell(x))
                    rec["path"] = twell.last_path
                    rec["decode_kernels"] = twell._twell_layer.last_decode_kernels if twell.last_path == "decode" else None
                    for t in twells:
                        t.kernel_mode = "decode"
                    rec["decode_graph_us"] = 1e3 * chain_graph_ms([lambda m=m: m(x) for m in twells])
                    rec["decode_flushed_us"] = 1e3 * graph_ms(lambda: twell(x))
                    rec["forced_decode_kernels"] = twell._twell_layer.last_decode_kernels
                    ref = reference_fp32(x, s.w_gate, s.w_up, s.w_down)
                    rec["decode_rel_err"], rec["decode_max_row_err"] = errors(twell(x), ref)
                    for t in twells:
                        t.kernel_mode = "auto"
                    rec["rel_err"], rec["max_row_err"] = errors(twell(x), ref)
                    rec["dense_rel_err"], rec["dense_max_row_err"] = errors(dense(x), ref)
                # bytes the decode path must read: the whole gate, and an up row and a down column per active unit
                need = (f * d + 2 * union * d) * 2
                rec["GBps"] = need / (rec["decode_graph_us"] * 1e3)
                rec["speedup"] = rec["dense_graph_us"] / rec["twell_graph_us"]
                rec["decode_speedup"] = rec["dense_graph_us"] / rec["decode_graph_us"]
                rec["speedup_flushed"] = rec["dense_flushed_us"] / rec["twell_flushed_us"]
                rec["decode_speedup_flushed"] = rec["dense_flushed_us"] / rec["decode_flushed_us"]
                rec.update(info)
                out.append(rec)
                log(f"M={M:4d} k={k:3d} {dist:6s} union {union:5d} dense {rec['dense_graph_us']:6.1f} us twell {rec['twell_graph_us']:6.1f} "
                    f"x{rec['speedup']:.2f} ({rec['path']}) decode forced {rec['decode_graph_us']:6.1f} x{rec['decode_speedup']:.2f} "
                    f"| flushed {rec['dense_flushed_us']:5.1f} / {rec['twell_flushed_us']:5.1f} x{rec['speedup_flushed']:.2f} "
                    f"| {rec['GBps']:.0f} GB/s err {rec['rel_err']:.1e} row {rec['max_row_err']:.1e}/{rec['dense_max_row_err']:.1e}")
            del s, pairs, denses, twells, dense, twell
            torch.cuda.empty_cache()
    return out

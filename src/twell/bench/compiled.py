"""twell under ``torch.compile``, as users run it (``twell bench compiled``).

Two parts, each dense and twell side by side in one process:

- :func:`compiled_grid`, the MLP at every batch size: one record per (M, k, distribution) with
  the eager ratio, the ratio in CUDA graphs (both captured by hand), the ratio with both
  modules compiled (``torch.compile(module, fullgraph=True, dynamic=True)``, default mode) and
  with both compiled in ``mode="reduce-overhead"`` (inductor's CUDA graphs), and the path twell
  took in each. Dense is the three-``nn.Linear`` PyTorch MLP; twell is ``SparseGatedMLP`` in eval
  mode with default settings. Dynamic shapes: one compile per module serves every batch size, as
  it does for a user whose batch sizes vary.
- :func:`compiled_model`, a model of a preset's shape (``layers`` decoder layers, sparsity
  calibrated as ``twell bench model`` constructs it) in three variants, ``dense`` (Hugging Face's
  MLPs, ReLU), ``twell_defaults`` (after ``twell.sparsify``, default settings) and
  ``twell_stats_off`` (``track_stats = False`` on every MLP), each as its constructor leaves it
  (training mode: the state where statistics used to be on by default) and called under
  ``torch.no_grad()``: prefill of ``batch x seq`` tokens (the base model, no LM head), eager and
  compiled (each decoder layer compiled, one graph for all), peak memory beside time; and greedy
  generation at batch 1 through Hugging Face ``generate`` with a static cache and the forward
  compiled in ``mode="reduce-overhead"`` (its documented fast path), tokens/s and whether the
  tokens equal dense's.
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import Callable

import torch

from .inference import errors, machine_info, reference_fp32
from .runtime import _pair, _warm
from .synthetic import make_ffn
from .timing import alternating, eager_ms, graph_ms, interleaved_ms, reset_peak

__all__ = ["compiled_grid", "compiled_model"]

MS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 131072)


def _raise_recompile_limits(n: int = 64) -> None:
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), n))


def compiled_grid(Ms=MS, ks=(29, 280), dists=("even", "heavy"), log: Callable[[str], None] = print,
                  d: int = 2048, f: int = 5632) -> list[dict]:
    """The batch grid under ``torch.compile``: see the module's text. Each record has ``M``,
    ``k``, ``distribution``, ``eager_speedup``, ``graph_speedup``, ``compiled_speedup``,
    ``compiled_graph_speedup``, the milliseconds behind them, ``eager_path``, ``graph_path``,
    ``compiled_path``, ``compiled_graph_path``, and the compiled twell output's errors against an
    fp32 reference beside dense's."""
    import torch._dynamo

    _raise_recompile_limits()
    info = machine_info()
    out = []
    for k in ks:
        for dist in dists:
            s = make_ffn(max(Ms), d, f, k, dist, dtype=torch.bfloat16, device="cuda", seed=k + 11)
            dense, twell = _pair(s)
            torch._dynamo.reset()
            compiled = {(mode, name): torch.compile(mod, fullgraph=True, dynamic=True, mode=mode)
                        for mode in ("default", "reduce-overhead") for name, mod in (("dense", dense), ("twell", twell))}
            for M in Ms:
                t0 = time.time()
                x = s.x[:M].contiguous()
                rec = dict(M=M, k=k, distribution=dist, d=d, f=f)
                small = M <= 16384
                with torch.no_grad():
                    _warm(twell, x)
                    calls = 100 if M <= 1024 else 30
                    if small:
                        rec["dense_ms"], rec["twell_ms"] = interleaved_ms([lambda: dense(x), lambda: twell(x)], calls=calls)
                    else:
                        rec["dense_ms"], rec["twell_ms"] = alternating(eager_ms, [lambda: dense(x), lambda: twell(x)], rounds=1)
                    rec["eager_path"] = twell.last_path
                    rec["dense_graph_ms"], rec["twell_graph_ms"] = alternating(
                        graph_ms, [lambda: dense(x), lambda: twell(x)], rounds=3 if small else 1)
                    rec["graph_path"] = twell.last_path
                    for mode, key in (("default", "compiled"), ("reduce-overhead", "compiled_graph")):
                        cd, ct = compiled[(mode, "dense")], compiled[(mode, "twell")]
                        for _ in range(4):  # compile (first size of this mode), warm up, record graphs
                            cd(x)
                            y = ct(x)
                        torch.cuda.synchronize()
                        rec[f"{key}_path"] = twell.last_path
                        if mode == "default":
                            ref = reference_fp32(x, s.w_gate, s.w_up, s.w_down)
                            rec["compiled_rel_err"], rec["compiled_max_row_err"] = errors(y, ref)
                            rec["dense_rel_err"], rec["dense_max_row_err"] = errors(cd(x), ref)
                            del ref
                        del y
                        if small:
                            rec[f"dense_{key}_ms"], rec[f"twell_{key}_ms"] = interleaved_ms([lambda: cd(x), lambda: ct(x)], calls=calls)
                        else:
                            rec[f"dense_{key}_ms"], rec[f"twell_{key}_ms"] = alternating(
                                eager_ms, [lambda: cd(x), lambda: ct(x)], rounds=1)
                for key in ("", "graph_", "compiled_", "compiled_graph_"):
                    rec[f"{key}speedup"] = rec[f"dense_{key}ms"] / rec[f"twell_{key}ms"]
                rec["eager_speedup"] = rec.pop("speedup")
                rec.update(info)
                out.append(rec)
                log(f"M={M:6d} k={k:3d} {dist:6s} eager x{rec['eager_speedup']:.2f} ({rec['eager_path']}) "
                    f"graph x{rec['graph_speedup']:.2f} ({rec['graph_path']}) compiled x{rec['compiled_speedup']:.2f} "
                    f"({rec['compiled_path']}) reduce-overhead x{rec['compiled_graph_speedup']:.2f} "
                    f"({rec['compiled_graph_path']}) err {rec['compiled_rel_err']:.1e} [{time.time() - t0:.1f}s]")
            del s, dense, twell, compiled
            torch._dynamo.reset()
            torch.cuda.empty_cache()
    return out


def _compile_layers(model) -> None:
    for layer in model.model.layers:
        layer.compile(dynamic=False)


@torch.no_grad()
def _generate(model, prompt: torch.Tensor, new_tokens: int, runs: int = 5) -> tuple[torch.Tensor, float]:
    """Greedy ``generate`` with a static cache, which Hugging Face runs through its forward
    compiled in ``mode="reduce-overhead"`` on CUDA (warmed up twice), then timed ``runs`` times:
    ``(new tokens, tokens/s of the median run)``. One timed run of a few dozen tokens varies by
    several percent from run to run, more than the gap it is meant to show."""
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, cache_implementation="static")
    for _ in range(2):
        model.generate(prompt, **kw)
    seconds = []
    for _ in range(runs):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(prompt, **kw)
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
    return out[:, prompt.shape[1]:].cpu(), new_tokens * prompt.shape[0] / statistics.median(seconds)


def _paths(model) -> list:
    return sorted({m.last_path for m in model.modules() if getattr(m, "last_path", None) is not None})


def compiled_model(preset: str = "2b", layers: int = 16, k: float = 29, batch: int = 16, seq: int = 2048,
                   prompt_len: int = 64, new_tokens: int = 64, log: Callable[[str], None] = print) -> list[dict]:
    """The whole model, eager and compiled: see the module's text. One record per (variant,
    mode) with ``prefill_ms``, ``peak_bytes`` (the model's weights and the most its prefill call allocated), ``rel_err_vs_dense`` (final
    hidden states) and ``mlp_paths``; the compiled records add ``generate_tok_per_s_b1`` and
    ``tokens_match`` (greedy tokens equal to dense's)."""
    import torch._dynamo
    from transformers import LlamaForCausalLM

    from .. import sparsify
    from ..recipe.model import make_config
    from .model import calibrate_sparsity

    _raise_recompile_limits()
    info = machine_info()
    torch.manual_seed(0)
    config = make_config(preset, 49152)
    config.hidden_act, config.num_hidden_layers = "relu", layers
    with torch.device("cuda"):
        base = LlamaForCausalLM(config).to(torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(1)
    rand = lambda *shape: torch.randint(0, config.vocab_size, shape, device="cuda", generator=gen)  # noqa: E731
    cal = calibrate_sparsity(base.eval(), k, rand(4, seq))
    log(f"calibrated {layers} layers: mean active {min(cal['active_mean']):.1f} to {max(cal['active_mean']):.1f}")
    ids, prompt = rand(batch, seq), rand(1, prompt_len)
    base.train()  # as the constructor leaves a model: training mode, called under no_grad
    # every variant made before anything compiles (a copy of a model must not copy its compiled calls)
    models = {"dense": base, "twell_defaults": sparsify(copy.deepcopy(base)), "twell_stats_off": sparsify(copy.deepcopy(base))}
    for m in models["twell_stats_off"].modules():
        if hasattr(m, "track_stats"):
            m.track_stats = False
    out, hidden, tokens = [], {}, {}
    for variant, model in models.items():
        fn = lambda: model.model(input_ids=ids, use_cache=False).last_hidden_state  # noqa: E731
        for mode in ("eager", "compiled"):
            torch._dynamo.reset()
            if mode == "compiled":
                for layer in model.model.layers:  # regional: one graph serves every layer
                    layer.compile(dynamic=False)
            t0 = time.time()
            with torch.no_grad():
                for _ in range(3):
                    y = fn()
                torch.cuda.synchronize()
                warm_s = time.time() - t0
                del y
                ms = eager_ms(fn, rep=1000, min_reps=10)
                reset_peak()
                before = torch.cuda.memory_allocated()
                y = fn()
                torch.cuda.synchronize()
                # this model's weights and what its call allocated (the other variants' weights,
                # also on the GPU, are no part of its peak)
                weights = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
                peak = weights + int(torch.cuda.max_memory_allocated() - before)
            h = y.float()
            del y
            if variant == "dense":
                hidden[mode], err = h.cpu(), 0.0
            else:
                ref = hidden[mode].to(h.device)
                err = float((h - ref).norm() / ref.norm())
                del ref
            del h
            rec = dict(preset=preset, layers=layers, k=k, batch=batch, seq=seq, mode=mode, variant=variant,
                       prefill_ms=ms, peak_bytes=peak, rel_err_vs_dense=err, warm_s=warm_s, mlp_paths=_paths(model))
            if mode == "compiled":
                for layer in model.model.layers:  # generate compiles the whole forward instead
                    layer._compiled_call_impl = None  # (what nn.Module.compile set)
                torch._dynamo.reset()
                t1 = time.time()
                toks, tps = _generate(model, prompt, new_tokens)
                tokens[variant] = toks
                rec.update(generate_tok_per_s_b1=tps, generate_compile_and_run_s=time.time() - t1,
                           tokens_match=bool(torch.equal(toks, tokens["dense"])), generate_paths=_paths(model))
            rec.update(info)
            out.append(rec)
            log(f"{variant:16s} {mode:8s} prefill {ms:8.2f} ms peak {peak / 2**30:6.2f} GiB err {err:.1e} "
                f"paths {rec['mlp_paths']}"
                + (f" generate b1 {rec['generate_tok_per_s_b1']:.0f} tok/s tokens equal {rec['tokens_match']} "
                   f"paths {rec['generate_paths']}" if mode == "compiled" else ""))
        torch.cuda.empty_cache()
    for rec in out:
        dense = next(r for r in out if r["variant"] == "dense" and r["mode"] == rec["mode"])
        rec["prefill_speedup"] = dense["prefill_ms"] / rec["prefill_ms"]
        rec["peak_vs_dense"] = rec["peak_bytes"] / dense["peak_bytes"]
        if "generate_tok_per_s_b1" in rec:
            rec["generate_speedup_b1"] = rec["generate_tok_per_s_b1"] / dense["generate_tok_per_s_b1"]
    return out

"""FP8 beside bf16 (``twell bench fp8``): dense bf16, dense FP8, twell bf16 and twell FP8, side by
side in one process.

One record per ``(M, k, distribution, mode)``, d 2048, f 5632, inputs from
:func:`twell.bench.synthetic.make_ffn` (bf16):

- ``dense_bf16``: the three-``nn.Linear`` PyTorch MLP;
- ``dense_fp8``: :func:`twell.inference.fp8_ops.dense_fp8_ffn`, all three products
  rowwise-scaled FP8 (``torch._scaled_mm``), x and h quantised per token;
- ``twell_bf16``: :class:`twell.SparseGatedMLP` in eval mode, default settings;
- ``twell_fp8``: :class:`twell.fp8_nn.Fp8SparseGatedMLP` from the same weights (as
  ``twell.sparsify(model, fp8=True)`` makes it): up to 8 tokens the fused FP8 decode kernel,
  else the FP8 gate, TwELL, and up and down rows gathered from FP8, or dense FP8 where the
  layer's measured sparsity would not pay (``twell_fp8_path``).

``mode`` ``"eager"`` times calls in turn (``interleaved_ms``); ``"graph"`` each captured in a
CUDA graph and replayed. Errors (worst row, :func:`twell.bench.inference.errors`) are against an
fp32 computation with each variant's own dequantised weights and bf16 x: ``max_row_err`` twell
FP8's, ``dense_fp8_max_row_err`` dense FP8's. ``same_active_set``: twell FP8's per-token active
counts equal those of the dense FP8 gate's output (``> 0``) on the same quantised inputs.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from .inference import errors, machine_info
from .runtime import _pair, _warm
from .synthetic import make_ffn
from .timing import alternating, graph_ms, interleaved_ms

__all__ = ["fp8_grid"]

MS = (1, 16, 256, 4096, 16384, 131072)


def _fp32(x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor, chunk: int = 16384) -> torch.Tensor:
    """fp32 gated MLP of bf16 ``x`` with fp32 weights ``wg, wu [f, d]``, ``wd [d, f]``."""
    out = torch.empty(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for s in range(0, x.shape[0], chunk):
        xs = x[s : s + chunk].float()
        out[s : s + chunk] = (torch.relu(xs @ wg.T) * (xs @ wu.T)) @ wd.T
    return out


def fp8_grid(Ms=MS, ks=(29, 280), dists=("even", "heavy"), modes=("eager", "graph"), d: int = 2048, f: int = 5632,
             log: Callable[[str], None] = print) -> list[dict]:
    """The records described in the module's text."""
    from ..fp8 import fp8_gated_weights
    from ..inference.fp8_ops import _scaled_mm, dense_fp8_ffn, dense_fp8_weights, quantize_activations
    from ..inference.ops import DEFAULT_COMPRESSION, default_tile
    from ..kernels import pack_relu
    from ..fp8_nn import Fp8SparseGatedMLP

    info = machine_info()
    out = []
    for k in ks:
        for dist in dists:
            s = make_ffn(max(Ms), d, f, k, dist, dtype=torch.bfloat16, device="cuda", seed=k + 11)
            dense, twell = _pair(s)
            w8 = fp8_gated_weights(s.w_gate, s.w_up, s.w_down)
            d8 = dense_fp8_weights(s.w_gate, s.w_up, s.w_down)
            m8 = Fp8SparseGatedMLP.from_weights(s.w_gate, s.w_up, s.w_down)
            for M in Ms:
                t0 = time.time()
                x = s.x[:M].contiguous()
                with torch.no_grad():
                    _warm(twell, x)
                    _warm(m8, x)
                    fns = {"dense_bf16": lambda: dense(x), "dense_fp8": lambda: dense_fp8_ffn(x, d8),
                           "twell_bf16": lambda: twell(x), "twell_fp8": lambda: m8(x)}
                    y8 = fns["twell_fp8"]()
                    yd8 = fns["dense_fp8"]()
                    ref = _fp32(x, w8.gate.dequantize(), w8.up.dequantize(), w8.down_t.dequantize().t())
                    err = errors(y8, ref)[1]
                    del ref
                    ref = _fp32(x, d8.gate.dequantize(), d8.up.dequantize(), d8.down.dequantize())
                    derr = errors(yd8, ref)[1]
                    del ref, y8, yd8
                    # the dense FP8 gate (its own weights) against the TwELL twell FP8 packs
                    gate = _scaled_mm(quantize_activations(x), d8.gate, x.dtype)
                    pre = _scaled_mm(quantize_activations(x), w8.gate, x.dtype)
                    same = bool(torch.equal(pack_relu(pre, default_tile(f), DEFAULT_COMPRESSION).counts.sum(dim=1),
                                            (gate > 0).sum(dim=1).to(torch.int32)))
                    del gate, pre
                    names = list(fns)
                    for mode in modes:
                        if mode == "eager":
                            times = interleaved_ms([fns[n] for n in names], calls=100 if M <= 4096 else 30)
                        else:
                            times = alternating(graph_ms, [fns[n] for n in names], rounds=3 if M <= 16384 else 1)
                        rec = dict(M=M, k=k, distribution=dist, d=d, f=f, mode=mode,
                                   **{f"{n}_ms": t for n, t in zip(names, times)},
                                   max_row_err=err, dense_fp8_max_row_err=derr, same_active_set=same,
                                   twell_bf16_path=twell.last_path, twell_fp8_path=m8.last_path, **info)
                        rec["fp8_vs_dense_fp8_speedup"] = rec["dense_fp8_ms"] / rec["twell_fp8_ms"]
                        rec["fp8_vs_dense_bf16_speedup"] = rec["dense_bf16_ms"] / rec["twell_fp8_ms"]
                        rec["bf16_vs_dense_bf16_speedup"] = rec["dense_bf16_ms"] / rec["twell_bf16_ms"]
                        out.append(rec)
                        log(f"M={M:6d} k={k:3d} {dist:6s} {mode:5s} dense bf16 {rec['dense_bf16_ms']:.3f} fp8 "
                            f"{rec['dense_fp8_ms']:.3f} | twell bf16 {rec['twell_bf16_ms']:.3f} fp8 {rec['twell_fp8_ms']:.3f} ms: "
                            f"twell fp8 {rec['fp8_vs_dense_fp8_speedup']:.2f}x dense fp8, {rec['fp8_vs_dense_bf16_speedup']:.2f}x dense bf16 "
                            f"(twell bf16 {rec['bf16_vs_dense_bf16_speedup']:.2f}x, fp8 path {m8.last_path}) | row err {err:.1e} vs {derr:.1e}, same set {same} "
                            f"[{time.time() - t0:.1f}s]")
            del s, dense, twell, w8, d8, m8
            torch.cuda.empty_cache()
    return out


class _DenseFp8MLP(torch.nn.Module):
    """A Hugging Face gated MLP (ReLU) as dense FP8 serving runs it: :func:`dense_fp8_ffn` on
    per-row e4m3 copies of its weights."""

    def __init__(self, mlp: torch.nn.Module) -> None:
        from ..inference.fp8_ops import dense_fp8_weights

        super().__init__()
        self.w = dense_fp8_weights(mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from ..inference.fp8_ops import dense_fp8_ffn

        shape = x.shape
        return dense_fp8_ffn(x.reshape(-1, shape[-1]), self.w).reshape(shape)


def fp8_model(preset: str = "2b", k: float = 29, batch: int = 16, seq: int = 2048,
              log: Callable[[str], None] = print) -> list[dict]:
    """Prefill of ``batch x seq`` tokens through a ``preset``-shaped model (Hugging Face's default
    path, eager, the base model without its LM head), its MLPs given about ``k`` active units
    per token (:func:`twell.bench.model.calibrate_sparsity`), in four variants from the same
    weights: ``dense_bf16``, ``dense_fp8`` (each MLP dense FP8), ``twell_bf16``
    (``twell.sparsify``) and ``twell_fp8`` (``twell.sparsify(fp8=True)``); attention stays bf16 in
    all. One record per variant: ``prefill_ms`` (median of timed calls), ``prefill_speedup`` over
    dense bf16 and ``fp8_speedup`` over dense FP8, and the final hidden states' relative error
    against dense bf16's."""
    import copy

    from transformers import LlamaForCausalLM

    from .. import sparsify
    from ..recipe.model import make_config
    from .model import calibrate_sparsity
    from .timing import eager_ms

    info = machine_info()
    torch.manual_seed(0)
    config = make_config(preset, 49152)
    config.hidden_act = "relu"
    with torch.device("cuda"):
        base = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    gen = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (batch, seq), device="cuda", generator=gen)
    with torch.no_grad():
        cal = calibrate_sparsity(base, k, ids[:4])
    log(f"calibrated {len(base.model.layers)} layers: mean active {min(cal['active_mean']):.1f} to {max(cal['active_mean']):.1f}")
    out, ref = [], None
    for variant in ("dense_bf16", "dense_fp8", "twell_bf16", "twell_fp8"):
        model = copy.deepcopy(base) if variant != "dense_bf16" else base
        if variant == "dense_fp8":
            for layer in model.model.layers:
                layer.mlp = _DenseFp8MLP(layer.mlp)
        elif variant != "dense_bf16":
            sparsify(model, fp8=variant == "twell_fp8")
        model.eval()
        fn = lambda: model.model(input_ids=ids, use_cache=False).last_hidden_state  # noqa: E731
        with torch.no_grad():
            for _ in range(3):
                h = fn()
            torch.cuda.synchronize()
            ms = eager_ms(fn, rep=1000, min_reps=10)
            h = fn().float()
        err = 0.0 if ref is None else float((h - ref).norm() / ref.norm())
        if ref is None:
            ref = h
        del h
        out.append(dict(preset=preset, variant=variant, k=k, batch=batch, seq=seq, prefill_ms=ms, rel_err_vs_dense_bf16=err, **info))
        log(f"{variant:10s} prefill {ms:8.2f} ms, error against dense bf16 {err:.1e}")
        if variant != "dense_bf16":
            del model
        torch.cuda.empty_cache()
    for r in out:
        r["prefill_speedup"] = out[0]["prefill_ms"] / r["prefill_ms"]
        r["fp8_speedup"] = out[1]["prefill_ms"] / r["prefill_ms"]
    return out

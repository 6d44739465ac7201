"""Whole-model benchmark: a randomly initialised model of a preset's shape, given a chosen
activation sparsity without training, then dense against twell on the same weights.

Sparsity by construction (:func:`calibrate_sparsity`):

1. Residual channel 0 is held constant: embedding column 0 is set to ``scale`` and row 0 of
   every ``o_proj`` and ``down_proj`` to zero, so no layer writes it. After each RMSNorm it is a
   positive per-token value ``n0``, and the channel-0 weight of gate row ``j`` acts as a bias.
2. ``o_proj`` and ``down_proj`` are scaled by ``residual_damping`` (``16 / d``). At
   initialisation, attention at early positions averages few values, so those tokens write far
   larger vectors into the residual stream than later ones (at d = 2048 the first position's
   attention output is about 40 times the norm of an embedding row, and the ratio grows with
   d); a unit's threshold, set on the typical token, is then crossed by hundreds of units on
   them, a heavy tail that grows with depth and that the dispatcher rightly refuses (2b shape,
   mean 30: heaviest rows of about 2300 active units undamped, 1250 with a damping of 0.1).
   With ``16 / d`` each layer writes about a third of an embedding row's norm at any width,
   token norms stay uniform and the heaviest row holds a few times the mean.
3. Layer by layer on calibration tokens, each bias is set so that unit ``j`` fires for a share
   ``k / f`` of them: ``w_gate[j, 0] = -quantile_(1 - k/f)(z_j / n0)``, ``z_j`` the rest of the
   gate's dot product.

Neither step changes any shape or the work of the dense model: only where units fire.
"""

from __future__ import annotations

import contextlib
import copy
import math
import statistics
import time
from typing import Callable, Optional

import torch

from .timing import reset_peak

__all__ = ["calibrate_sparsity", "active_units", "greedy_decode", "random_model", "eager_decode_interleaved", "bench_model"]

RESIDUAL_DAMPING_WIDTH = 16.0  # residual_damping = this / d
SCALE_OVER_REST = 8.0


def _gated_mlps(model) -> list:
    return [layer.mlp for layer in model.model.layers]


@torch.no_grad()
def calibrate_sparsity(model, k: float, ids: torch.Tensor, scale: Optional[float] = None,
                       residual_damping: Optional[float] = None) -> dict:
    """Give the gated MLPs of a Llama-style ``model`` (Hugging Face ``LlamaForCausalLM``, dense or
    sparsified, ReLU gate) about ``k`` active units per token, in place (see the module's text).

    Args:
        k: mean active units per token to aim for, in every layer.
        ids: ``[B, T]`` calibration token ids.
        scale: value of embedding column 0; default ``SCALE_OVER_REST`` times the norm of the
            rest of an average embedding row, so that channel 0 dominates every RMS.
        residual_damping: factor on ``o_proj`` and ``down_proj``; default ``16 / d``.

    Returns:
        ``{"active_mean": [per layer], "active_max": [per layer]}`` on ``ids`` after calibration.
    """
    base = model.model
    emb = base.embed_tokens.weight
    d = emb.shape[1]
    if residual_damping is None:
        residual_damping = RESIDUAL_DAMPING_WIDTH / d
    if scale is None:
        scale = SCALE_OVER_REST * float(emb[:, 1:].float().pow(2).mean().sqrt()) * d**0.5
    emb[:, 0] = scale
    for layer in base.layers:
        for w in (layer.self_attn.o_proj.weight, layer.mlp.down_proj.weight):
            # down_proj may be kept transposed in eval (twell's layout): index it by output row
            w.mul_(residual_damping)
            w[0].zero_()
    out = {"active_mean": [], "active_max": [], "residual_damping": residual_damping, "scale": scale}
    captured = {}

    def hook(_module, args):
        captured["x"] = args[0].reshape(-1, d).float()

    for mlp in _gated_mlps(model):
        handle = mlp.register_forward_pre_hook(hook)
        try:
            base(input_ids=ids, use_cache=False)
        finally:
            handle.remove()
        x = captured.pop("x")
        wg = mlp.gate_proj.weight
        f = wg.shape[0]
        n0 = x[:, 0].clamp(min=1e-6)
        z = (x[:, 1:] @ wg[:, 1:].float().T) / n0[:, None]  # [T, f]
        T = z.shape[0]
        q = max(1, min(T, int(round(T * (1 - k / f)))))
        wg[:, 0] = (-torch.kthvalue(z, q, dim=0).values).to(wg.dtype)
        per_token = ((x @ wg.float().T) > 0).sum(dim=1).float()
        out["active_mean"].append(float(per_token.mean()))
        out["active_max"].append(int(per_token.max()))
    return out


@torch.no_grad()
def active_units(model, ids: torch.Tensor) -> dict:
    """Per layer, mean / 99th percentile / max of active gate units per token of ``ids [B, T]``."""
    rows: list[torch.Tensor] = []

    def hook(mlp, args):
        x = args[0].reshape(-1, args[0].shape[-1])
        rows.append((torch.mm(x, mlp.gate_proj.weight.t()) > 0).sum(dim=1).float())

    handles = [mlp.register_forward_pre_hook(hook) for mlp in _gated_mlps(model)]
    try:
        model.model(input_ids=ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return {"active_mean": [round(float(r.mean()), 2) for r in rows],
            "active_p99": [float(r.quantile(0.99)) for r in rows],
            "active_max": [int(r.max()) for r in rows]}


class _GreedyState:
    """Greedy generation after ``prompt [B, P]`` with a Hugging Face ``StaticCache`` of
    ``P + new_tokens`` positions: the prompt's forward runs here (eager), then :meth:`step`
    (``stepper``'s forward of the last token, argmax, bookkeeping: all on the device, no host
    sync) appends one token a call. ``stepper`` defaults to ``model``."""

    def __init__(self, model, prompt: torch.Tensor, new_tokens: int, stepper=None):
        from transformers import StaticCache

        B, P = prompt.shape
        dev = prompt.device
        self.cache = StaticCache(config=model.config, max_cache_len=P + new_tokens)
        self.tokens = torch.zeros(B, P + new_tokens, dtype=torch.long, device=dev)
        self.tokens[:, :P] = prompt
        logits = model(input_ids=prompt, past_key_values=self.cache, cache_position=torch.arange(P, device=dev),
                       use_cache=True).logits
        self.first_logits = logits[:, -1].float()
        self.ids = logits[:, -1:].argmax(-1)  # [B, 1]: the token at position P
        self.tokens[:, P] = self.ids[:, 0]
        self.cur = torch.full((1,), P, dtype=torch.long, device=dev)  # position of `ids`
        self.stepper = model if stepper is None else stepper
        self.steps = new_tokens - 1  # the token at position P came from the prompt's forward

    def step(self) -> None:
        lg = self.stepper(input_ids=self.ids, past_key_values=self.cache, cache_position=self.cur, use_cache=True).logits
        nxt = lg[:, -1].argmax(-1)  # [B]
        self.tokens.index_copy_(1, self.cur + 1, nxt[:, None])
        self.ids.copy_(nxt[:, None])
        self.cur.add_(1)


def _untimed_eager_steps() -> int:
    """Eager steps run before timing: until every twell layer has captured its graph of this
    batch size (at its ``CAPTURE_AFTER``-th call) and replayed it once."""
    from ..inference import eager_graphs

    return eager_graphs.CAPTURE_AFTER + 2


@torch.no_grad()
def greedy_decode(model, prompt: torch.Tensor, new_tokens: int, graph: bool = True, warmup: int = 3,
                  step_model=None) -> dict:
    """Greedy generation of ``new_tokens`` after ``prompt [B, P]`` with a Hugging Face
    ``StaticCache``: the prompt in one eager forward, then one token per step; with ``graph`` the
    step (forward, argmax, bookkeeping) is captured once in a CUDA graph after ``warmup`` eager
    steps and replayed, as ``generate`` with a static cache and CUDA graphs does. ``step_model``
    (e.g. ``torch.compile(model)``) runs the steps instead of ``model``.

    Returns ``{"tokens": [B, P + new_tokens], "first_logits": [B, vocab] fp32,
    "step_ms": mean ms per timed step (one event pair around all of them), "timed_steps": n, "graph": bool}``.
    """
    state = _GreedyState(model, prompt, new_tokens, step_model)
    dev = prompt.device
    steps = state.steps
    run, used_graph = state.step, False
    if graph and dev.type == "cuda":
        from .timing import capture

        steps -= warmup  # capture() runs `warmup` real steps before it captures one
        run, used_graph = capture(state.step, warmup=warmup).replay, True
    # untimed: the first replays upload the graph; eager steps, until twell's layers replay
    for _ in range(min(2 if used_graph else _untimed_eager_steps(), steps)):
        run()
        steps -= 1
    if dev.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            run()
        end.record()
        end.synchronize()
        ms = start.elapsed_time(end) / max(steps, 1)
    else:
        t0 = time.perf_counter()
        for _ in range(steps):
            run()
        ms = (time.perf_counter() - t0) * 1e3 / max(steps, 1)
    return {"tokens": state.tokens.cpu(), "first_logits": state.first_logits.cpu(), "step_ms": ms, "timed_steps": steps,
            "graph": used_graph}


@torch.no_grad()
def eager_decode_interleaved(dense, twell, prompt: torch.Tensor, new_tokens: int) -> dict:
    """Every-step-eager greedy decoding of ``dense`` and ``twell`` (same weights) step by step in
    lockstep: each step of one model is followed by the same step of the other (the order
    swapped every step), each timed alone by the host's clock between two device
    synchronisations. An eager step is bound by the host, whose speed here moved a step by up to a
    third between runs and by 15% between rounds a minute apart; paired steps see the same host
    phase, so their ratio holds where separate runs do not.

    Returns ``{"dense": result, "twell": result}`` as :func:`greedy_decode` returns it (``graph``
    False), ``step_ms`` the median of the timed steps, with ``steps_ms`` each step's time and
    ``step_ratios`` each pair's dense / twell."""
    cuda = prompt.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    states = {name: _GreedyState(m, prompt, new_tokens) for name, m in (("dense", dense), ("twell", twell))}
    steps = states["dense"].steps
    for _ in range(min(_untimed_eager_steps(), steps)):
        for st in states.values():
            st.step()
    times: dict = {"dense": [], "twell": []}
    for i in range(steps - min(_untimed_eager_steps(), steps)):
        for name in (("dense", "twell") if i % 2 == 0 else ("twell", "dense")):
            sync()
            t0 = time.perf_counter()
            states[name].step()
            sync()
            times[name].append((time.perf_counter() - t0) * 1e3)
    out = {}
    for name, st in states.items():
        out[name] = {"tokens": st.tokens.cpu(), "first_logits": st.first_logits.cpu(),
                     "step_ms": statistics.median(times[name]) if times[name] else math.nan,
                     "steps_ms": times[name], "timed_steps": len(times[name]), "graph": False}
    out["twell"]["step_ratios"] = [d / t for d, t in zip(times["dense"], times["twell"])]
    return out


def _nvml_handle():
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
    except Exception:  # no nvidia-ml-py, or no NVML: energy is not reported
        return None


def _energy_mj_per_call(fn: Callable[[], object], nv, seconds: float) -> Optional[float]:
    """Millijoules per call of ``fn`` from NVML's total-energy counter over ``seconds`` of calls."""
    if nv is None or seconds <= 0:
        return None
    import pynvml

    torch.cuda.synchronize()
    e0, t0, n = pynvml.nvmlDeviceGetTotalEnergyConsumption(nv), time.time(), 0
    while time.time() - t0 < seconds:
        fn()
        n += 1
    torch.cuda.synchronize()
    return (pynvml.nvmlDeviceGetTotalEnergyConsumption(nv) - e0) / n


def _rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.float().cpu(), ref.float().cpu()
    return float((a - ref).norm() / ref.norm())


@torch.no_grad()
def _prefill(model, ids, nv, energy_s: float) -> dict:
    from .timing import eager_ms

    fn = lambda: model.model(input_ids=ids, use_cache=False).last_hidden_state  # noqa: E731
    for _ in range(2):
        fn()
    ms = eager_ms(fn, rep=1500, min_reps=10)
    reset_peak()
    out = fn()
    torch.cuda.synchronize()
    peak = int(torch.cuda.max_memory_allocated())
    hidden = out.float().cpu()  # the reference stays off the GPU: it would count in later peaks
    del out
    mj = _energy_mj_per_call(fn, nv, energy_s)
    return {"ms": ms, "peak": peak, "hidden": hidden, "mj_per_token": mj / ids.numel() if mj else None}


def _mlp_ms(model, tokens: int) -> float:
    """Milliseconds of one of the model's MLPs on ``tokens`` random rows (the dense MLP's share)."""
    from .timing import eager_ms

    mlp = model.model.layers[0].mlp
    x = torch.randn(tokens, model.config.hidden_size, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        return eager_ms(lambda: mlp(x), rep=300)


def _train_step(model, batch: int, seq: int, steps: int = 4, compiled: bool = True) -> dict:
    """Tokens/s and peak memory of forward + backward + AdamW (lr 0: the weights stay as they
    are) on ``batch x seq`` random tokens, bf16 weights: ``train_tok_per_s``,
    ``train_peak_bytes``; with ``compiled``, the same with each decoder layer compiled (as
    ``twell train --compile`` does; three warm-up steps compile it): ``train_compiled_tok_per_s``,
    ``train_compiled_peak_bytes``."""
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.0, weight_decay=0.0,
                            fused=True)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = {}
    layers = list(model.model.layers)
    try:
        for sfx, warm in (("", 2), ("_compiled", 3))[:2 if compiled else 1]:
            if sfx:
                torch._dynamo.reset()
                for layer in layers:
                    layer.compile(dynamic=False)
            reset_peak()
            for i in range(steps + warm):
                if i == warm:
                    start.record()
                model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            end.record()
            end.synchronize()
            out[f"train{sfx}_tok_per_s"] = steps * batch * seq / (start.elapsed_time(end) / 1e3)
            out[f"train{sfx}_peak_bytes"] = int(torch.cuda.max_memory_allocated())
        return out
    finally:
        del opt
        for layer in layers:  # (what nn.Module.compile set)
            layer._compiled_call_impl = None
        model.eval()
        torch.cuda.empty_cache()


def _attention_backends():
    """The fastest SDPA backends for causal bf16 attention here, in priority order (the first
    that runs; the others stay allowed for calls it does not support, such as masked decoding)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(1, 32, 256, 64, device="cuda", dtype=torch.bfloat16)
    rest = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    for name, first in (("sdpa-cudnn", [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]),
                        ("sdpa-flash", [SDPBackend.FLASH_ATTENTION])):
        try:
            with sdpa_kernel(first[:1]):
                torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
            torch.cuda.synchronize()
            return name, first + rest
        except RuntimeError:
            continue
    return "sdpa", None


def _decode_all(model, prompts: dict, new_tokens: int, variant: str, label: str, log, step_model=None,
                graph: bool = True) -> dict:
    """greedy_decode at each batch of ``prompts`` ({batch: [batch, P] ids}), one CUDA graph per
    step (``graph``) or every step eager; a failed capture is reported and replaced by eager
    steps, not hidden."""
    out = {}
    cuda = any(p.is_cuda for p in prompts.values())  # (the CPU for tests: no peak)
    for b, prompt in prompts.items():
        if cuda:
            reset_peak()
        try:
            tc = time.time()
            g = greedy_decode(model, prompt, new_tokens, graph=graph, step_model=step_model)
            g["seconds"] = time.time() - tc
        except Exception as e:
            if not graph:
                raise
            log(f"{variant} {label} decode batch {b}: CUDA graph failed ({type(e).__name__}: {e}); eager instead")
            torch.cuda.synchronize()
            g = greedy_decode(model, prompt, new_tokens, graph=False, step_model=step_model)
        g["peak"] = int(torch.cuda.max_memory_allocated()) if cuda else 0
        if variant == "twell":
            mods = [m for m in model.modules() if hasattr(m, "eager_graphs")]
            g["paths"] = sorted({m.last_path for m in mods if m.last_path})
            g["eager_graph_replays"] = sum(m.eager_graphs.replays for m in mods)  # (cumulative)
        out[b] = g
        log(f"{variant} {label} decode batch {b}: {g['step_ms'] * 1e3:.0f} us per step ({b * 1e3 / g['step_ms']:.0f} "
            f"tokens/s, graph {g['graph']}) {g.get('paths', '')}")
    return out


def random_model(preset: str, device="cuda"):
    """A randomly initialised ``LlamaForCausalLM`` of ``preset``'s shape with ReLU gates, bf16, in
    eval mode (seed 0; a 49152-id vocabulary, as the paper's tokenizer): what the whole-model
    benchmark and its probes construct sparsity on (:func:`calibrate_sparsity`)."""
    from transformers import LlamaForCausalLM

    from ..recipe.model import make_config

    torch.manual_seed(0)
    config = make_config(preset, 49152)
    config.hidden_act = "relu"
    with torch.device(device):
        return LlamaForCausalLM(config).to(torch.bfloat16).eval()


def bench_model(preset: str = "2b", k: float = 29, batch: int = 16, seq: int = 2048, decode_batches=(1, 16),
                prompt_len: int = 128, new_tokens: int = 128, train_batch: int = 8, energy_s: float = 5.0,
                lean: bool = True, log: Callable[[str], None] = print, model_path: Optional[str] = None,
                tokens: Optional[torch.Tensor] = None) -> dict:
    """Dense (Hugging Face's MLPs, ReLU) and twell (after ``twell.sparsify``) on one set of weights.

    Per variant, on two paths: Hugging Face's default (eager, SDPA's default choice) and a lean
    one (``torch.compile``, the fastest SDPA backend first), each measured for prefill tokens/ms
    of the base model (``batch x seq`` tokens, no LM head), its peak memory and energy per
    token, and greedy decoding tokens/s at each of ``decode_batches`` (static cache, one CUDA
    graph per step). The lean prefill compiles each decoder layer (one graph serves them all);
    the lean decoding step compiles the whole model, as ``generate`` does with a static cache
    (per layer, the cache's layer index would make one graph per layer). Then a training step's tokens/s
    (``train_batch x seq``, default path; twell trains on its dense path until the training
    kernels land). twell is checked against dense: final hidden states' relative error, greedy
    tokens.

    A trained model instead (``model_path``: a twell checkpoint or export, :func:`twell.recipe.export.load_model`):
    its own sparsity, no construction (``k`` is then only a label), ``sparsity_source`` "trained";
    ``tokens`` (a 1-D id stream, e.g. its validation split) supplies the benchmark's sequences
    and prompts, which otherwise are uniform random ids.

    Returns ``{"records": [per variant], "decode": [per path and batch], "sparsity": {...}}``.
    """
    from .. import sparsify
    from .inference import machine_info

    info = machine_info()
    torch.manual_seed(0)  # (random_model seeds it again: the same draws as before it existed)
    if model_path is None:
        model = random_model(preset)
        config = model.config
    else:
        from ..recipe.export import load_model

        model = load_model(model_path, dtype=torch.bfloat16).to("cuda").eval()
        config = model.config
        if config.hidden_act != "relu":
            raise ValueError(f"{model_path}: the MLPs use {config.hidden_act!r}; twell needs a ReLU gate")
    attention = getattr(model.config, "_attn_implementation", None)
    gen = torch.Generator(device="cuda").manual_seed(1)
    if tokens is None:
        rand = lambda *shape: torch.randint(0, config.vocab_size, shape, device="cuda", generator=gen)  # noqa: E731
    else:
        stream = tokens.reshape(-1).to("cuda", torch.long)
        if stream.numel() <= max(seq, prompt_len):
            raise ValueError(f"tokens: {stream.numel()} ids, fewer than one sequence of {max(seq, prompt_len)} and one more")

        def rand(*shape):  # windows of the stream at random offsets
            n = shape[-1]
            starts = torch.randint(0, stream.numel() - n, shape[:-1], device="cuda", generator=gen)
            return stream[starts.unsqueeze(-1) + torch.arange(n, device="cuda")]
    t0 = time.time()
    source = "calibrated" if model_path is None else "trained"
    cal = calibrate_sparsity(model, k, rand(4, seq)) if model_path is None else None
    ids = rand(batch, seq)
    fresh = active_units(model, ids[:2])
    log(f"{'calibrated ' + str(len(cal['active_mean'])) + ' layers' if cal else 'trained model ' + model_path} in "
        f"{time.time() - t0:.0f}s; on the benchmark's tokens: "
        f"mean active {min(fresh['active_mean']):.1f} to {max(fresh['active_mean']):.1f} per layer, "
        f"p99 up to {max(fresh['active_p99']):.0f}, max {max(fresh['active_max'])}")
    nv = _nvml_handle()
    lean_name, lean_backends = _attention_backends() if lean else (None, None)
    prompts = {b: rand(b, prompt_len) for b in decode_batches}
    for name in ("recompile_limit", "cache_size_limit"):  # one graph per input shape, all layers share it
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 64))
    records, decodes, ref = [], {}, {}
    paths = [("hf", contextlib.nullcontext)]
    if lean:
        from torch.nn.attention import sdpa_kernel

        lean_ctx = (lambda: sdpa_kernel(lean_backends, set_priority=True)) if lean_backends else contextlib.nullcontext
        paths.append(("lean", lean_ctx))
    # every-step-eager decoding is bound by the host, whose speed drifts by up to a third here:
    # dense (a copy kept for it) and twell decode in lockstep, step by step, not one after the
    # other (the copy kept on the CPU until then, so that no other measurement's peak memory
    # counts it)
    dense_twin = copy.deepcopy(model).cpu()
    torch.cuda.empty_cache()
    for variant in ("dense", "twell"):
        torch._dynamo.reset()  # each variant compiles afresh, within the recompile limit
        if variant == "twell":
            sparsify(model)
            model.eval()
        rec = dict(preset=preset, sparsity_source=source, variant=variant, k=k if cal else None, batch=batch, seq=seq,
                   attention=attention, lean_attention=lean_name)
        for path, ctx in paths:
            sfx = "" if path == "hf" else "_lean"
            layers = list(model.model.layers)
            with ctx():
                if path == "lean":
                    for layer in layers:
                        layer.compile(dynamic=False)
                    tc = time.time()
                    with torch.no_grad():
                        model.model(input_ids=ids, use_cache=False)
                    rec["lean_compile_s"] = time.time() - tc
                p = _prefill(model, ids, nv, energy_s)
                rec.update({f"prefill{sfx}_ms": p["ms"], f"prefill{sfx}_tok_per_ms": ids.numel() / p["ms"],
                            f"peak_bytes{sfx}": p["peak"], f"mj_per_token{sfx}": p["mj_per_token"]})
                if variant == "dense":
                    ref[path] = p["hidden"]
                    rec[f"mlp_share{sfx}"] = config.num_hidden_layers * _mlp_ms(model, ids.numel()) / p["ms"]
                rec[f"rel_err_vs_dense{sfx}"] = _rel_err(p["hidden"], ref[path])
                del p
                if variant == "twell":
                    mods = [m for m in model.modules() if hasattr(m, "last_path")]
                    rec[f"prefill_paths{sfx}"] = sorted({m.last_path for m in mods if m.last_path})
                    rec["overflow_rows"] = int(sum(int(m.overflow_counters.rows) for m in mods
                                                   if m.overflow_counters is not None))
                log(f"{variant} {path}: prefill {rec[f'prefill{sfx}_ms']:.1f} ms ({rec[f'prefill{sfx}_tok_per_ms']:.1f} "
                    f"tokens/ms), peak {rec[f'peak_bytes{sfx}'] / 2**30:.2f} GiB, "
                    f"{rec[f'mj_per_token{sfx}'] or math.nan:.3f} mJ/token, rel err {rec[f'rel_err_vs_dense{sfx}']:.1e} "
                    f"{rec.get(f'prefill_paths{sfx}', '')}" + (f", compiled in {rec['lean_compile_s']:.0f}s" if sfx else ""))
                step_model = None
                if path == "lean":
                    for layer in layers:  # the whole model is compiled for the decoding steps
                        layer._compiled_call_impl = None
                    step_model = torch.compile(model, dynamic=False)
                for b, g in _decode_all(model, prompts, new_tokens, variant, path, log, step_model).items():
                    decodes[(variant, path, b)] = g
                    rec[f"decode{sfx}_tok_per_s_b{b}"] = b * 1e3 / g["step_ms"]
                    if path == "lean":
                        rec[f"decode_lean_compile_and_run_s_b{b}"] = g.get("seconds")
                del step_model
                if path == "hf" and variant == "twell":  # and as most users generate: every step eager
                    dense_twin.to(ids.device)  # (both models on the GPU: these records' peaks count both)
                    for b, prompt in prompts.items():
                        reset_peak()
                        pair = eager_decode_interleaved(dense_twin, model, prompt, new_tokens)
                        peak = int(torch.cuda.max_memory_allocated())
                        mods = [m for m in model.modules() if hasattr(m, "eager_graphs")]
                        pair["twell"]["paths"] = sorted({m.last_path for m in mods if m.last_path})
                        pair["twell"]["eager_graph_replays"] = sum(m.eager_graphs.replays for m in mods)
                        for name, g in pair.items():  # one peak of the pair: both records carry it
                            decodes[(name, "hf-eager", b)] = {**g, "peak": peak}
                        log(f"hf eager decode batch {b}, steps interleaved: dense {pair['dense']['step_ms'] * 1e3:.0f} us, "
                            f"twell {pair['twell']['step_ms'] * 1e3:.0f} us per step (median of {pair['twell']['timed_steps']})")
                    del dense_twin
                    torch.cuda.empty_cache()
        if train_batch:
            rec.update(_train_step(model, train_batch, seq))
            log(f"{variant} train step ({train_batch} x {seq}): {rec['train_tok_per_s']:.0f} tokens/s, peak "
                f"{rec['train_peak_bytes'] / 2**30:.1f} GiB; decoder layers compiled "
                f"{rec['train_compiled_tok_per_s']:.0f} tokens/s, peak {rec['train_compiled_peak_bytes'] / 2**30:.1f} GiB")
        rec.update(info)
        records.append(rec)
    decode = []
    for path in [p for p, _ in paths] + ["hf-eager"]:
        for b in decode_batches:
            dn, tw = decodes[("dense", path, b)], decodes[("twell", path, b)]
            same = (dn["tokens"] == tw["tokens"]).all(dim=0)
            diverge = None if bool(same.all()) else int((~same).nonzero()[0]) - prompt_len
            ratios = tw.get("step_ratios")
            decode.append(dict(
                preset=preset, path=path, batch=b, prompt_len=prompt_len, new_tokens=new_tokens, k=k if cal else None, sparsity_source=source,
                dense_tok_s=b * 1e3 / dn["step_ms"], twell_tok_s=b * 1e3 / tw["step_ms"],
                speedup=dn["step_ms"] / tw["step_ms"],
                **({"step_ratio_quartiles": statistics.quantiles(ratios, n=4)} if ratios and len(ratios) > 1 else {}),
                tokens_match=diverge is None, first_divergence=diverge,
                first_logits_rel_err=_rel_err(tw["first_logits"], dn["first_logits"]),
                peak_bytes=tw["peak"], dense_peak_bytes=dn["peak"], graph=dn["graph"] and tw["graph"],
                twell_paths=tw.get("paths"), attention=lean_name if path == "lean" else attention,
                method=("Hugging Face forward with a StaticCache, greedy; every step eager (twell replays its own "
                        "CUDA graphs of small MLP calls: twell.inference.eager_graphs); dense and twell in lockstep, each step "
                        "of one followed by the same step of the other (order swapped every step), each timed "
                        "between two device synchronisations: tokens/s and speedup from the median steps, "
                        "step_ratio_quartiles of the pairs' dense / twell; both models decode at once on the GPU, "
                        "so peak_bytes and dense_peak_bytes are the same figure: the pair's peak, two models, "
                        "two caches; eager_graph_replays: cumulative over the batches")
                if path == "hf-eager" else
                       ("Hugging Face forward with a StaticCache, greedy; prompt eager, then one CUDA graph replay "
                        "per token" + ("; decoder layers compiled" if path == "lean" else "")),
                **({"eager_graph_replays": tw.get("eager_graph_replays")} if path == "hf-eager" else {}),
                **info))
    sparsity = {"source": source, "benchmark_tokens": fresh}
    if cal:
        sparsity.update({"k": k, "calibration": cal,
                         "construction": {"residual_damping": cal["residual_damping"], "scale": cal["scale"],
                                          "scale_over_rest": SCALE_OVER_REST}})
    return {"records": records, "decode": decode, "sparsity": sparsity}

"""Training benchmark of the gated FFN: forward + backward, dense PyTorch against twell's sparse
training kernels (:func:`twell.training.ops.sparse_gated_ffn`), side by side in one process.

For each ``(M, k, distribution)`` (inputs from :func:`twell.bench.synthetic.make_ffn`, bf16,
d 2048, f 5632) it times, with CUDA events through ``triton.testing.do_bench`` (medians, after
warm-up):

- dense: ``torch.autograd.grad`` of the three-Linear PyTorch MLP for the gradient ``dy`` of y:
  what a user's training step runs today (no L1 term, which would only add to dense's time);
- twell (``twell_ms``, ``speedup``): what a user trains with, :class:`twell.SparseGatedMLP`
  holding the same weights with default settings (``train_kernels = "auto"``, statistics on),
  in training mode, the same gradients with its L1 term in the loss (``y . dy + lam * l1``), timed
  after warm-up calls that let the layer measure its sparsity and choose its path
  (``twell_path``: the path the timed calls took);
- sparse (``sparse_ms``, ``sparse_speedup``): the sparse training kernels forced
  (:func:`sparse_gated_ffn`), with the L1 term;
- dense path (``dense_path_ms``, ``dense_path_speedup``): twell's dense training op forced
  (:func:`twell.training.ops.dense_gated_ffn`: cuBLAS and one fused element-wise pass each way),
  with the L1 term: what ``"auto"`` runs on a layer the sparse kernels would not pay on;
- module sparse and module dense (``module_sparse_ms``, ``module_dense_ms`` and their speedups):
  the same module with ``train_kernels`` forced to "sparse" and to "dense", timed in turn with the
  rest: the two paths "auto" chooses between as a user runs them (the module's own work, its
  statistics and L1 term included), where the bare ops above leave that work out;
  ``module_auto_gap`` = 1 - speedup / the faster of the two (0: "auto" took the faster path;
  ``auto_gap`` compares with the bare ops instead);
- ``dense_host_us``, ``twell_host_us``, ``module_sparse_host_us``, ``module_dense_host_us``:
  microseconds of CPU time to issue one call (:func:`twell.bench.timing.host_us`; on the GPU, up
  to ``HOST_TIMED_TOKENS`` tokens). The sparse path's backward waits on the host for counts its
  forward copies there, so its figure includes that wait: an upper bound on its host work;
- ``plain_module_ms`` (only where ``plain_module`` asks, M 16384 by default): the module on
  its dense path with ``twell.training.path.FUSED_DENSE`` off, i.e. PyTorch ops for the relu, the
  product, the L1 term and the statistics: what the dense path costs without the fused op;
- ``breakeven_path``, ``auto_width``: the rule :func:`twell.training.path.choose_path` for this
  sparsity (mean and share of rows above its width, else the light-row rule at the probe widths);
  ``auto_path``: what the modules' ``train_kernels = "auto"`` trains with (the same rule while
  ``twell.training.path.AUTO_SPARSE`` is on, as it is by default, on calls of at least
  ``twell.training.path.MIN_SPARSE_TOKENS`` tokens).

Gradients are compared with fp32 autograd of the same bf16 inputs: relative error of each
(x, gate, up, down), and the worst row of dx against dense bf16's worst row. ``saved_bytes`` are
what autograd keeps for backward besides x and the weights (both keep those).
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from .inference import bench_ms, errors, machine_info
from .synthetic import make_ffn
from .timing import host_us, interleaved_ms, reset_peak

__all__ = ["run_training_grid", "train_step_records", "constructed_state", "sparse_model", "train_step"]

LAM = 2e-5  # the L1 coefficient in the sparse variant's loss (its gradient path is timed too)
# Calls a module makes before it is timed: enough for its sparsity probe to land and (near the
# token floor, twell.training.path_timing) for its path trials to settle.
MODULE_WARMUP = 20
# Calls of up to this many tokens also get their host time recorded (at more, the GPU's work is
# far longer than the host's on every machine measured).
HOST_TIMED_TOKENS = 4096


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.float(), ref.float()
    return float((a - ref).norm() / ref.norm().clamp(min=1e-30))


def _worst_row(a: torch.Tensor, ref: torch.Tensor) -> float:
    return errors(a, ref.float())[1]


def _fp32_grads(x, wg, wu, wd, dy, chunk: int = 16384):
    """fp32 autograd of the dense gated MLP on the bf16 inputs, in row chunks (memory)."""
    ws = [w.detach().float().requires_grad_(True) for w in (wg, wu, wd)]
    dx = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    for s in range(0, x.shape[0], chunk):
        xs = x[s : s + chunk].detach().float().requires_grad_(True)
        y = (torch.relu(xs @ ws[0].T) * (xs @ ws[1].T)) @ ws[2].T
        y.backward(dy[s : s + chunk].float())
        dx[s : s + chunk] = xs.grad
    return dx, ws[0].grad, ws[1].grad, ws[2].grad


def _dense_fn(x, wg, wu, wd, dy) -> Callable[[], tuple]:
    F = torch.nn.functional

    def run():
        y = F.linear(torch.relu(F.linear(x, wg)) * F.linear(x, wu), wd)
        return torch.autograd.grad(y, (x, wg, wu, wd), dy)

    return run


def _sparse_fn(x, wg, wu, wd, dy, width: int) -> Callable[[], tuple]:
    from ..training.ops import sparse_gated_ffn

    lam = torch.full((), LAM, device=x.device)

    def run():
        out = sparse_gated_ffn(x, wg, wu, wd, width)
        return torch.autograd.grad((out.y, out.l1), (x, wg, wu, wd), (dy, lam))

    return run


def _load_module(m: torch.nn.Module, wg, wu, wd, kernels: str = "auto") -> None:
    """Give the twell module ``m`` (training mode) copies of ``wg, wu, wd`` and a fresh path
    state, as a module built with these weights has: what lets one compiled module serve every
    record of the grid (one compile, not one per record)."""
    from ..training.path import TrainPath

    with torch.no_grad():
        for lin, w in ((m.gate_proj, wg), (m.up_proj, wu), (m.down_proj, wd)):
            lin.weight.copy_(w)
    m.__dict__["_twell_train"] = TrainPath()
    m.train()
    m.train_kernels = kernels


def _module_fn(x, wg, wu, wd, dy, kernels: str = "auto", module: Optional[torch.nn.Module] = None,
               call: Optional[Callable] = None, warmup: int = MODULE_WARMUP) -> tuple[Callable[[], tuple], torch.nn.Module]:
    """``(run, module)``: forward + backward of a :class:`twell.SparseGatedMLP` in training mode
    holding ``wg, wu, wd`` (copies), ``train_kernels = kernels``, loss ``y . dy + LAM l1``.
    ``module``: the module to load them into (else a new one); ``call``: what runs it (a
    compiled module, say; else the module). ``warmup`` calls are made first, so that the layer
    has measured its sparsity and chosen its path."""
    from ..nn import SparseGatedMLP

    f, d = wg.shape
    m = module if module is not None else SparseGatedMLP(d, f, device=x.device, dtype=x.dtype)
    _load_module(m, wg, wu, wd, kernels)
    fn = call if call is not None else m
    params = tuple(m.parameters())
    lam = torch.full((), LAM, device=x.device)

    def run():
        y = fn(x)
        return torch.autograd.grad((y, m.l1), (x, *params), (dy, lam))

    # the layer's first calls measure its sparsity, then (near the token floor) time its two
    # paths (twell.training.path_timing): timed from here, it runs what it settled on
    for _ in range(warmup):
        run()
        _sync(x.device)
    return run, m


class _DenseMLP(torch.nn.Module):
    """The three-Linear PyTorch MLP (ReLU gate), as a user would write it."""

    def __init__(self, d: int, f: int, **kw) -> None:
        super().__init__()
        self.gate_proj = torch.nn.Linear(d, f, bias=False, **kw)
        self.up_proj = torch.nn.Linear(d, f, bias=False, **kw)
        self.down_proj = torch.nn.Linear(f, d, bias=False, **kw)

    def forward(self, x: torch.Tensor, with_l1: bool = False):
        h = torch.relu(self.gate_proj(x)) * self.up_proj(x)
        y = self.down_proj(h)
        if with_l1:
            from ..reference import l1_penalty

            return y, l1_penalty(h)
        return y


def run_training_grid(Ms=(1024, 4096, 16384, 65536), ks=(8, 29, 56, 280),
                      distributions=("even", "skewed", "heavy"), d: int = 2048, f: int = 5632, calls: int = 40,
                      log: Callable[[str], None] = print, partial_path: Optional[str] = None,
                      plain_module: tuple = (16384,), compiled: bool = True, device: str = "cuda",
                      dtype: torch.dtype = torch.bfloat16, module_warmup: int = MODULE_WARMUP) -> list[dict]:
    """One record per ``(M, k, distribution)`` (see the module's text), each variant timed over
    ``calls`` calls in turn with the others; ``partial_path``: a JSONL file each record is
    appended to as it is measured, so a cut run keeps what it did; ``plain_module``: the M at
    which the module's plain PyTorch dense path is timed too; ``compiled``: also time the dense
    MLP and the twell module each compiled (``torch.compile(fullgraph=True)``, one compile of
    each serving every record: the weights are copied in). ``device``, ``dtype``: where and in
    what the inputs are made (a CPU run, under the Triton interpreter at tiny shapes, checks the
    benchmark itself: its times mean nothing); ``module_warmup``: calls each module makes before
    it is timed."""
    import json

    from ..nn import SparseGatedMLP
    from ..reference import l1_penalty

    from ..training import path as train_path
    from ..training.ops import choose_width, dense_gated_ffn, saved_bytes, sparse_gated_ffn
    from ..training.path import choose_path, probe_values, read_probe

    info = machine_info()
    records = []
    F = torch.nn.functional
    if compiled:
        from .compiled import _raise_recompile_limits

        _raise_recompile_limits()
        ctwell = SparseGatedMLP(d, f, device=device, dtype=dtype)
        cdense = _DenseMLP(d, f, device=device, dtype=dtype)
        ctwell_call, cdense_call = torch.compile(ctwell, fullgraph=True), torch.compile(cdense, fullgraph=True)
    for M in Ms:
        for dist in distributions:
            for k in ks:
                if dist == "skewed" and k > 0.35 * f:
                    log(f"M {M} k {k} skewed: skipped (this distribution reaches at most 0.35 f active units)")
                    continue
                ffn = make_ffn(M, d, f, k, dist, dtype, device, seed=k)
                x = ffn.x.requires_grad_(True)
                wg, wu, wd = (w.requires_grad_(True) for w in (ffn.w_gate, ffn.w_up, ffn.w_down))
                dy = torch.randn(M, d, device=device, dtype=dtype) / math.sqrt(d)
                with torch.no_grad():
                    counts = (torch.mm(x, wg.t()) > 0).sum(1)
                k_mean, k_max = float(counts.float().mean()), int(counts.max())
                probe = read_probe(probe_values(counts, f).tolist())  # what the layer's probe measures
                heavy_share = probe[2]
                width = choose_width(k_mean, k_max, f)
                dense, sparse = _dense_fn(x, wg, wu, wd, dy), _sparse_fn(x, wg, wu, wd, dy, width)
                ref = _fp32_grads(x, wg, wu, wd, dy)
                g_dense = dense()
                names = ("x", "gate", "up", "down")
                # the sparse loss adds lam * l1: its gradient is compared without it
                out = sparse_gated_ffn(x, wg, wu, wd, width)
                g_plain = torch.autograd.grad(out.y, (x, wg, wu, wd), dy)
                n_heavy = int(out.n_heavy)
                del out
                module, m = _module_fn(x, wg, wu, wd, dy, warmup=module_warmup)  # after its warm-up calls: the path it keeps
                g_module = torch.autograd.grad(m(x), (x, *m.parameters()), dy)
                rec = dict(M=M, d=d, f=f, k=k, distribution=dist, k_measured=k_mean, k_max=k_max, width=width,
                           heavy_rows=n_heavy,
                           grad_rel_err={n: _rel(a, r) for n, a, r in zip(names, g_plain, ref)},
                           dense_grad_rel_err={n: _rel(a, r) for n, a, r in zip(names, g_dense, ref)},
                           twell_grad_rel_err={n: _rel(a, r) for n, a, r in zip(names, g_module, ref)},
                           max_row_err=_worst_row(g_plain[0], ref[0]), dense_max_row_err=_worst_row(g_dense[0], ref[0]),
                           twell_max_row_err=_worst_row(g_module[0], ref[0]))
                del g_plain, g_dense, g_module, ref
                lam_t = torch.full((), LAM, device=x.device)

                def dense_path(x=x, wg=wg, wu=wu, wd=wd, dy=dy):
                    out = dense_gated_ffn(x, wg, wu, wd)
                    return torch.autograd.grad((out.y, out.l1), (x, wg, wu, wd), (dy, lam_t))

                def dense_l1(x=x, wg=wg, wu=wu, wd=wd, dy=dy):
                    h = torch.relu(F.linear(x, wg)) * F.linear(x, wu)
                    return torch.autograd.grad((F.linear(h, wd), l1_penalty(h)), (x, wg, wu, wd), (dy, lam_t))

                fns = {"dense": dense, "sparse": sparse, "dense_path": dense_path, "twell": module, "dense_l1": dense_l1}
                # the module's two paths forced: what "auto" chooses between, module work included
                for forced in ("sparse", "dense"):
                    fns[f"module_{forced}"], _ = _module_fn(x, wg, wu, wd, dy, kernels=forced, warmup=module_warmup)
                if M in plain_module:
                    plain_run, _ = _module_fn(x, wg, wu, wd, dy, kernels="dense", warmup=module_warmup)

                    def plain(run=plain_run):
                        was = train_path.FUSED_DENSE
                        train_path.FUSED_DENSE = False
                        try:
                            return run()
                        finally:
                            train_path.FUSED_DENSE = was

                    fns["plain_module"] = plain
                if compiled:
                    with torch.no_grad():
                        for lin, w in ((cdense.gate_proj, wg), (cdense.up_proj, wu), (cdense.down_proj, wd)):
                            lin.weight.copy_(w)
                    dparams = tuple(cdense.parameters())

                    def compiled_dense(x=x, dy=dy):
                        return torch.autograd.grad(cdense_call(x), (x, *dparams), dy)

                    for _ in range(3):
                        compiled_dense()
                    fns["compiled_dense"] = compiled_dense
                    fns["compiled_twell"], _ = _module_fn(x, wg, wu, wd, dy, module=ctwell, call=ctwell_call,
                                                          warmup=module_warmup)
                # call by call in turn, so that every variant sees the same host and clocks
                times = dict(zip(fns, interleaved_ms(list(fns.values()), calls=calls, warmup=2)))
                rec["timed_calls"] = calls
                for name, ms in times.items():
                    rec[f"{name}_ms"] = ms
                if device == "cuda" and M <= HOST_TIMED_TOKENS:  # where the host may set the pace
                    for name in ("dense", "twell", "module_sparse", "module_dense"):
                        rec[f"{name}_host_us"] = host_us(fns[name], calls=5, rounds=5)
                rec["sparse_speedup"] = rec["dense_ms"] / rec["sparse_ms"]
                rec["dense_path_speedup"] = rec["dense_ms"] / rec["dense_path_ms"]
                rec["speedup"] = rec["dense_ms"] / rec["twell_ms"]
                rec["speedup_with_l1"] = rec["dense_l1_ms"] / rec["twell_ms"]
                # how far "auto" is from the faster of the module's two paths (0: it took the faster)
                rec["auto_gap"] = 1 - rec["speedup"] / max(rec["sparse_speedup"], rec["dense_path_speedup"])
                for forced in ("sparse", "dense"):
                    rec[f"module_{forced}_speedup"] = rec["dense_ms"] / rec[f"module_{forced}_ms"]
                # the same against the module's own two paths (its statistics and L1 term on both)
                rec["module_auto_gap"] = 1 - rec["speedup"] / max(rec["module_sparse_speedup"], rec["module_dense_speedup"])
                if compiled:
                    rec["compiled_speedup"] = rec["compiled_dense_ms"] / rec["compiled_twell_ms"]
                    rec["compiled_path"] = ctwell.last_train_path
                rec["twell_path"] = m.last_train_path
                del module, m, dense_path, dense_l1, fns
                rec["heavy_share"] = heavy_share
                rec["breakeven_path"], rec["auto_width"] = choose_path(k_mean, heavy_share, *probe[3:], f)
                rec["auto_path"] = ("sparse" if (train_path.AUTO_SPARSE and rec["breakeven_path"] == "sparse"
                                                 and train_path.large_enough(M)) else "dense")
                rec["dense_saved_bytes"] = saved_bytes(lambda a, b, c, e: F.linear(torch.relu(F.linear(a, b)) * F.linear(a, c), e),
                                                       x, wg, wu, wd)
                rec["saved_bytes"] = saved_bytes(lambda a, b, c, e: sparse_gated_ffn(a, b, c, e, width), x, wg, wu, wd)
                rec.update(info)
                records.append(rec)
                e = rec["grad_rel_err"]
                plain = f", plain module {rec['plain_module_ms']:7.3f}" if "plain_module_ms" in rec else ""
                log(f"M {M:>6} k {k:>5} {dist:6} (mean {k_mean:7.1f}, W {width:3}, heavy {n_heavy:6}): dense "
                    f"{rec['dense_ms']:7.3f} ms, sparse {rec['sparse_ms']:7.3f} ({rec['sparse_speedup']:.2f}x), dense path "
                    f"{rec['dense_path_ms']:7.3f} ({rec['dense_path_speedup']:.2f}x){plain}, module {rec['twell_ms']:7.3f} "
                    f"({rec['speedup']:.2f}x, {rec['twell_path']}; with L1 {rec['speedup_with_l1']:.2f}x, auto gap {rec['auto_gap']:+.3f}; "
                    f"module forced sparse {rec['module_sparse_speedup']:.2f}x, dense {rec['module_dense_speedup']:.2f}x, "
                    f"gap {rec['module_auto_gap']:+.3f})"
                    + (f" compiled {rec['compiled_speedup']:.2f}x ({rec['compiled_path']})" if compiled else "")
                    + f" | err x {e['x']:.1e} g {e['gate']:.1e} u {e['up']:.1e} "
                    f"d {e['down']:.1e} | saved {rec['saved_bytes'] / 2**20:.0f} / {rec['dense_saved_bytes'] / 2**20:.0f} MiB")
                if partial_path:
                    with open(partial_path, "a") as fh:
                        fh.write(json.dumps(rec) + "\n")
                del x, wg, wu, wd, dy, ffn, dense, sparse
                if device == "cuda":
                    torch.cuda.empty_cache()
    return records


def constructed_state(preset: str, k: float, calib_ids: torch.Tensor, vocab: int = 49152):
    """``(config, state)``: a ``preset``-shaped Llama (ReLU MLPs, ``vocab`` ids) given about ``k``
    active units per token by :func:`twell.bench.model.calibrate_sparsity` on ``calib_ids
    [B, T]`` (on the device where it is built), its weights as fp32 tensors, so that every
    variant starts from the same ones."""
    from transformers import LlamaForCausalLM

    from ..recipe.model import make_config
    from .model import calibrate_sparsity

    config = make_config(preset, vocab)
    config.hidden_act = "relu"
    device = calib_ids.device
    torch.manual_seed(0)
    with torch.device(device):
        base = LlamaForCausalLM(config)
    with torch.no_grad():
        calibrate_sparsity(base.to(torch.bfloat16 if device.type == "cuda" else torch.float32), k, calib_ids)
    return config, {n: t.detach().float().clone() for n, t in base.state_dict().items()}


def sparse_model(config, state: dict, kernels: str, device: str = "cuda"):
    """The model of ``config`` with ``state``, sparsified, in training mode, its MLPs on ``kernels``."""
    from transformers import LlamaForCausalLM

    from .. import sparsify
    from ..nn import sparse_modules

    with torch.device(device):
        model = LlamaForCausalLM(config)
    model.load_state_dict(state)
    sparsify(model)
    model.train()
    for m in sparse_modules(model):
        m.train_kernels = kernels
    return model


def train_step(model, opt, ids: torch.Tensor, lam: float = 2e-5) -> torch.Tensor:
    """One optimizer step on ``ids [B, T + 1]`` (next-token cross entropy + ``lam`` x L1, bf16
    autocast on CUDA, gradient clipping at 1); returns the cross entropy (a device scalar)."""
    from ..nn import l1_loss

    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=ids.is_cuda):
        logits = model(input_ids=ids[:, :-1], use_cache=False).logits
    ce = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    (ce + lam * l1_loss(model).to(ce.device)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return ce.detach()


def train_step_records(preset: str = "0.5b", k: float = 29, batch: int = 8, seq: int = 2048, steps: int = 50,
                       lrs: tuple = (0.0, 3e-4), compiled: bool = True,
                       log: Callable[[str], None] = print) -> list[dict]:
    """Training steps of ``preset`` (constructed sparsity: :func:`twell.bench.model.calibrate_sparsity`)
    with the MLPs' dense and sparse kernels, from the same weights and batches: tokens/s over the
    steps after the warm-up steps, peak memory (the model, optimizer state and steps: what the
    process held before the model was built is not counted), and the loss curve (AdamW, bf16
    autocast, L1 term).

    Four eager records per learning rate in ``lrs``, by ``kernels``: "dense" (the modules' plain
    PyTorch math, ``twell.training.path.FUSED_DENSE`` off: the baseline), "dense_fused" (the dense
    path as it ships: :func:`twell.training.ops.dense_gated_ffn`), "sparse", "auto" (the default).
    With ``compiled``, two more at lr 0 with each decoder layer compiled (as ``twell train
    --compile`` does): "dense" (the plain PyTorch math, which inductor fuses) and "auto". Each
    record says ``compile``. The constructed sparsity is not a trained one: nothing holds it while
    the weights move (the first steps at lr 3e-4 made most rows heavier than the ELL width), so lr
    0 (every step's work done, the weights kept) is the timing at the constructed sparsity, and
    lr 3e-4 the loss-curve check. Each record has the layers' active units per token after the
    first and the last step."""
    from ..training import path as train_path

    vocab = 49152
    gen = torch.Generator(device="cuda").manual_seed(3)
    warm = 8  # (compiled layers compile in the first steps)
    ids = torch.randint(0, vocab, (steps + warm, batch, seq + 1), device="cuda", generator=gen)
    config, state = constructed_state(preset, k, ids[0, :4, :seq], vocab)
    variants = [(lr, kernels, False) for lr in lrs for kernels in ("dense", "dense_fused", "sparse", "auto")]
    if compiled:
        variants += [(0.0, "dense", True), (0.0, "auto", True)]
    out = []
    was = train_path.FUSED_DENSE
    try:
        for lr, kernels, compile_layers in variants:
            train_path.FUSED_DENSE = kernels != "dense"
            rec = _time_train_steps(config, state, ids, kernels.replace("_fused", ""), lr, compile_layers, warm)
            rec.update(preset=preset, kernels=kernels, compile=compile_layers, lr=lr, k=k, batch=batch, seq=seq,
                       steps=steps)
            out.append(rec)
            log(f"train step {preset} lr {lr:g} kernels {kernels}{' compiled' if compile_layers else ''}: "
                f"{rec['tokens_per_s']:.0f} tokens/s, peak {rec['peak_bytes'] / 2**30:.1f} GiB, loss "
                f"{rec['losses'][0]:.4f} -> {rec['losses'][-1]:.4f}, paths {rec['paths']}, active per layer first/last "
                f"step {[round(v, 1) for v in rec['active_mean_first_step']]} / "
                f"{[round(v, 1) for v in rec['active_mean_last_step']]}, max {rec['active_max_first_step']} / "
                f"{rec['active_max_last_step']}")
    finally:
        train_path.FUSED_DENSE = was
    return out


def _time_train_steps(config, state: dict, ids: torch.Tensor, kernels: str, lr: float, compile_layers: bool,
                      warm: int) -> dict:
    """One record of :func:`train_step_records`: the model built on ``kernels`` (each decoder
    layer compiled with ``compile_layers``), ``len(ids) - warm`` timed steps after ``warm``."""
    import time

    from ..nn import sparse_modules

    reset_peak()  # each variant makes its own cuBLAS workspaces inside its window
    held_before = torch.cuda.memory_allocated()  # the caller's tensors (the grid's, say): not this step's
    model = sparse_model(config, state, kernels)
    if compile_layers:
        for layer in model.model.layers:
            layer.compile()
    mods = sparse_modules(model)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1 if lr else 0.0, fused=True)
    losses = []
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = None
    first_mean = first_max = None
    for i in range(len(ids)):
        if i == warm:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        losses.append(train_step(model, opt, ids[i]))
        if i == 0:
            first_mean = [float(m.stats.active_mean) for m in mods]
            first_max = [int(m.stats.active_max) for m in mods]
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    steps, (batch, seq) = len(ids) - warm, ids.shape[1:]
    rec = dict(tokens_per_s=steps * batch * (seq - 1) / seconds,
               peak_bytes=int(torch.cuda.max_memory_allocated() - held_before),
               losses=[float(v) for v in torch.stack(losses)],
               paths=sorted({m.last_train_path for m in mods if getattr(m, "last_train_path", None)}),
               active_mean_first_step=first_mean, active_max_first_step=first_max,
               active_mean_last_step=[float(m.stats.active_mean) for m in mods],
               active_max_last_step=[int(m.stats.active_max) for m in mods], **machine_info())
    del model, opt, mods
    torch.cuda.empty_cache()
    return rec


def stage_tensors(M: int, k: float, distribution: str = "even", d: int = 2048, f: int = 5632, seed: int = 1):
    """The inputs and intermediates of one sparse forward + backward at the width "auto" gives,
    for timing its stages one by one: a ``SimpleNamespace`` with x, wg, wu, wd (synthetic, bf16,
    CUDA), dy, the pre-activation a, W, wdt (``w_down^T`` contiguous), the ELL rows cols, g, cnt,
    the forward's u, the L1 scale c (zero) and the backward's du, da."""
    from types import SimpleNamespace

    from ..training import ops as train_ops
    from ..kernels import train_ffn as K

    ffn = make_ffn(M, d, f, k, distribution, torch.bfloat16, "cuda", seed=seed)
    t = SimpleNamespace(x=ffn.x, wg=ffn.w_gate, wu=ffn.w_up, wd=ffn.w_down)
    t.dy = torch.randn(M, d, device="cuda", dtype=torch.bfloat16) / math.sqrt(d)
    with torch.no_grad():
        t.a = torch.mm(t.x, t.wg.t())
    t.W = train_ops.choose_width(float((t.a > 0).sum(1).float().mean()), None, f)
    t.wdt = t.wd.t().contiguous()
    t.cols, t.g, t.cnt = K.pack_rows(t.a, t.W, **train_ops.PACK_CONFIG)
    _, t.u, _ = K.ffn_rows_forward(t.x, t.cols, t.g, t.cnt, t.wdt, t.wu, **train_ops.ROWS_CONFIG)
    t.c = torch.zeros(1, device="cuda")
    _, t.du, t.da = K.ffn_rows_backward(t.dy, t.cols, t.g, t.u, t.cnt, t.wdt, t.wu, t.wg, t.c, **train_ops.ROWS_CONFIG)
    return t


def tune_configs(M: int = 16384, k: float = 29, d: int = 2048, f: int = 5632, rep: int = 50,
                 log: Callable[[str], None] = print) -> dict:
    """Time each stage of the sparse forward + backward at one shape, and each kernel over a few
    launch configurations; the fastest become :mod:`twell.training.ops`' configs for this process.

    Returns ``{"stages_ms": {...}, "candidates": [...], "best": {...}}``.
    """
    import itertools

    from ..training import ops as train_ops
    from ..kernels import train_ffn as K
    from ..kernels.train_index import heavy_and_hot, light_unit_counts, unit_index

    t = stage_tensors(M, k, "even", d, f)
    x, wg, wu, wd, dy, a, W, wdt = t.x, t.wg, t.wu, t.wd, t.dy, t.a, t.W, t.wdt
    cols, g, cnt, u, c, du, da = t.cols, t.g, t.cnt, t.u, t.c, t.du, t.da
    order, offsets = unit_index(cols, cnt, f)
    per = light_unit_counts(cols, cnt, f)
    stages = {
        "gate_mm": lambda: torch.mm(x, wg.t()),
        "w_down_t": lambda: wd.t().contiguous(),
        "pack": lambda: K.pack_rows(a, W, **train_ops.PACK_CONFIG),
        "unit_counts": lambda: light_unit_counts(cols, cnt, f),
        "heavy_and_hot": lambda: heavy_and_hot(cnt, W, per, train_ops.hot_limit(M), train_ops.HOT_FACTOR),
        "forward_rows": lambda: K.ffn_rows_forward(x, cols, g, cnt, wdt, wu, **train_ops.ROWS_CONFIG),
        "backward_rows": lambda: K.ffn_rows_backward(dy, cols, g, u, cnt, wdt, wu, wg, c, **train_ops.ROWS_CONFIG),
        "unit_index": lambda: unit_index(cols, cnt, f),
        "weight_grads": lambda: K.ffn_weight_grads(order, offsets, x, dy, g, u, du, da, dtype=wu.dtype, **train_ops.GRADS_CONFIG),
        "dense_gate_mm_x3": lambda: (torch.mm(x, wg.t()), torch.mm(x, wu.t())),
    }
    stage_ms = {name: bench_ms(fn, rep=rep) for name, fn in stages.items()}
    log(f"tune at M {M} k {k} (W {W}): " + ", ".join(f"{n} {v:.3f}" for n, v in stage_ms.items()) + " ms")
    cands, best = [], {}

    def trial(kind, cfg, fn):
        try:
            ms = bench_ms(fn, rep=rep)
        except Exception as e:  # a configuration the compiler or the GPU refuses: recorded, skipped
            log(f"  {kind} {cfg}: failed ({type(e).__name__}: {str(e)[:120]})")
            return
        cands.append({"kernel": kind, "config": cfg, "ms": ms})
        if kind not in best or ms < best[kind][1]:
            best[kind] = (cfg, ms)

    for bm, bf, nw in itertools.product((1, 4, 8), (256, 1024), (4, 8)):
        cfg = dict(block_m=bm, block_f=bf, num_warps=nw)
        trial("pack", cfg, lambda cfg=cfg: K.pack_rows(a, W, **cfg))
    for be, bd, nw in itertools.product((2, 4, 8, 16), (None, 512), (4, 8)):
        cfg = dict(block_e=be, block_d=bd, num_warps=nw)
        trial("forward_rows", cfg, lambda cfg=cfg: K.ffn_rows_forward(x, cols, g, cnt, wdt, wu, **cfg))
        trial("backward_rows", cfg, lambda cfg=cfg: K.ffn_rows_backward(dy, cols, g, u, cnt, wdt, wu, wg, c, **cfg))
    for bt, bd, nw, split in itertools.product((2, 4, 8, 32), (None, 256), (4, 8), (False, True)):
        cfg = dict(block_t=bt, block_d=bd, num_warps=nw, split=split)
        trial("weight_grads", cfg, lambda cfg=cfg: K.ffn_weight_grads(order, offsets, x, dy, g, u, du, da, dtype=wu.dtype, **cfg))
    for kind, (cfg, ms) in best.items():
        log(f"  best {kind}: {cfg} {ms:.3f} ms (default {stage_ms.get(kind, float('nan')):.3f})")
    # forward and backward rows share ROWS_CONFIG: the pair's best sum
    rows = {}
    for cnd in cands:
        if cnd["kernel"] in ("forward_rows", "backward_rows"):
            key = tuple(sorted(cnd["config"].items(), key=lambda kv: kv[0]))
            rows[key] = rows.get(key, 0.0) + cnd["ms"]
    if "pack" in best:
        train_ops.PACK_CONFIG = dict(best["pack"][0])
    if rows:
        train_ops.ROWS_CONFIG = dict(min(rows, key=rows.get))
    if "weight_grads" in best:
        train_ops.GRADS_CONFIG = dict(best["weight_grads"][0])
    chosen = {"pack": train_ops.PACK_CONFIG, "rows": train_ops.ROWS_CONFIG, "grads": train_ops.GRADS_CONFIG}
    log(f"  chosen: {chosen}")
    return {"M": M, "k": k, "width": W, "stages_ms": stage_ms, "candidates": cands, "chosen": chosen}

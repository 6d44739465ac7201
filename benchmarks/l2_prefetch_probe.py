"""Would reading a layer's gate weights into L2 during its attention speed up decoding?

    OUT=DIR python benchmarks/l2_prefetch_probe.py [batch ...]

At one token per call twell's MLP is mostly the gate product: 23 MB of w_gate read whole (8.7 us
in the cuBLAS gate, 2.65 TB/s), then the few active units' up and down rows. The attention
before it (projections, cache update, a short SDPA, norms) is latency-bound and leaves HBM
mostly idle. If a side stream reads w_gate into L2 while attention runs, the gate would read it
from L2. Dense cannot do this for its whole MLP: its three matrices (69 MB) do not fit the L2.

Here: the 2b shape (k 29 constructed, as ``twell bench model`` builds it), greedy decoding with a
static cache, the step captured in one CUDA graph (Hugging Face's default attention, no
compile); per decoder layer a forward pre-hook forks a side stream that reads the layer's
``mlp.gate_proj.weight`` (loads with an L2 evict-last hint, summed, a store that never happens),
and a pre-hook on the MLP joins it. Variants: dense and twell, each without and with the
prefetch (dense prefetching its gate too, for comparison). Tokens must equal without and with.
Writes OUT/l2_prefetch_probe.json; prints tokens/s and ratios.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import triton
import triton.language as tl

from twell import sparsify
from twell.bench.inference import machine_info
from twell.bench.model import calibrate_sparsity, greedy_decode
from twell.train.model import make_config

OUT = os.environ.get("OUT", "/tmp")


@triton.jit
def _touch_kernel(w_ptr, n, sink_ptr, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    # each program reads STEPS blocks; the store's condition keeps the loads alive
    base = tl.program_id(0).to(tl.int64) * BLOCK * STEPS
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(STEPS):
        offs = base + s * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(w_ptr + offs, mask=offs < n, other=0.0, eviction_policy="evict_last").to(tl.float32)
    total = tl.sum(acc, axis=0)
    tl.store(sink_ptr + tl.program_id(0), total, mask=total == 1.2345e38)


@triton.jit
def _bulk_prefetch_kernel(w_ptr, nbytes, sink_ptr, CHUNK: tl.constexpr, LANES: tl.constexpr):
    # Hopper's bulk L2 prefetch: one instruction per CHUNK bytes, no registers or loads held
    i = tl.program_id(0) * LANES + tl.arange(0, LANES)
    start = i.to(tl.int64) * CHUNK
    ok = start < nbytes
    size = tl.minimum(nbytes - start, CHUNK).to(tl.int32)
    ptr = w_ptr.to(tl.pointer_type(tl.int8)) + tl.where(ok, start, 0)
    r = tl.inline_asm_elementwise("@$3 cp.async.bulk.prefetch.L2.global [$1], $2;\n mov.u32 $0, 0;", "=r,l,r,b",
                                  [ptr, size, ok], dtype=tl.int32, is_pure=False, pack=1)
    tl.store(sink_ptr + i, r.to(tl.float32), mask=ok & (r == 12345))


MODE = os.environ.get("PREFETCH", "bulk")


def touch(w: torch.Tensor, sink: torch.Tensor, block: int = 4096, steps: int = 8) -> None:
    if MODE == "bulk":
        nbytes = w.numel() * w.element_size()
        chunk, lanes = 65536, 128
        _bulk_prefetch_kernel[(triton.cdiv(nbytes, chunk * lanes),)](w, nbytes, sink, CHUNK=chunk, LANES=lanes, num_warps=4)
        return
    n = w.numel()
    grid = (triton.cdiv(n, block * steps),)
    _touch_kernel[grid](w, n, sink, BLOCK=block, STEPS=steps, num_warps=8)


class Prefetch:
    """Pre-hooks: at each decoder layer's start, a side stream reads its MLP's gate weight; the
    MLP waits for it before it runs."""

    def __init__(self, model):
        self.side = torch.cuda.Stream()
        self.sink = torch.zeros(1 << 16, device="cuda")
        self.handles = []
        for layer in model.model.layers:
            ev = torch.cuda.Event()
            self.handles.append(layer.register_forward_pre_hook(self._fork(layer, ev)))
            self.handles.append(layer.mlp.register_forward_pre_hook(self._join(ev)))

    def _fork(self, layer, ev):
        def hook(_m, _args):
            self.side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.side):
                touch(layer.mlp.gate_proj.weight, self.sink)
                ev.record()
        return hook

    @staticmethod
    def _join(ev):
        def hook(_m, _args):
            torch.cuda.current_stream().wait_event(ev)
        return hook

    def remove(self):
        for h in self.handles:
            h.remove()


def main() -> None:
    from transformers import LlamaForCausalLM

    batches = [int(b) for b in sys.argv[1:]] or [1, 16]
    torch.manual_seed(0)
    config = make_config("2b", 49152)
    config.hidden_act = "relu"
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    gen = torch.Generator(device="cuda").manual_seed(1)
    calibrate_sparsity(model, 29, torch.randint(0, config.vocab_size, (4, 2048), device="cuda", generator=gen))
    prompts = {b: torch.randint(0, config.vocab_size, (b, 128), device="cuda", generator=gen) for b in batches}
    # the touch kernel alone, for its bandwidth
    w = model.model.layers[0].mlp.gate_proj.weight
    sink = torch.zeros(1 << 16, device="cuda")
    for _ in range(3):
        touch(w, sink)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for lay in model.model.layers:
        touch(lay.mlp.gate_proj.weight, sink)
    e.record()
    e.synchronize()
    us = s.elapsed_time(e) * 1e3 / len(model.model.layers)
    out = dict(preset="2b", k=29, prompt_len=128, new_tokens=128, **machine_info(),
               touch_us=us, touch_GBps=w.numel() * 2 / us / 1e3)
    print(f"touch of one gate weight: {us:.1f} us ({out['touch_GBps']:.0f} GB/s)", flush=True)
    tokens = {}
    for variant in ("dense", "twell"):
        if variant == "twell":
            sparsify(model)
            model.eval()
        for pre in (False, True):
            p = Prefetch(model) if pre else None
            with torch.no_grad():
                for b, prompt in prompts.items():
                    t0 = time.time()
                    g = greedy_decode(model, prompt, 128)
                    key = f"{variant}{'_prefetch' if pre else ''}_b{b}"
                    out[f"{key}_tok_s"] = b * 1e3 / g["step_ms"]
                    out[f"{key}_step_us"] = g["step_ms"] * 1e3
                    tokens[key] = g["tokens"]
                    print(f"{key}: {g['step_ms'] * 1e3:.0f} us per step, {out[f'{key}_tok_s']:.0f} tokens/s, graph {g['graph']} "
                          f"({time.time() - t0:.0f}s)", flush=True)
            if p is not None:
                p.remove()
    for b in batches:
        for variant in ("dense", "twell"):
            out[f"{variant}_b{b}_prefetch_tokens_equal"] = bool(torch.equal(tokens[f"{variant}_b{b}"], tokens[f"{variant}_prefetch_b{b}"]))
        out[f"twell_over_dense_b{b}"] = out[f"twell_b{b}_tok_s"] / out[f"dense_b{b}_tok_s"]
        out[f"twell_prefetch_over_dense_b{b}"] = out[f"twell_prefetch_b{b}_tok_s"] / out[f"dense_b{b}_tok_s"]
        out[f"twell_prefetch_over_dense_prefetch_b{b}"] = out[f"twell_prefetch_b{b}_tok_s"] / out[f"dense_prefetch_b{b}_tok_s"]
        print(f"batch {b}: twell/dense {out[f'twell_over_dense_b{b}']:.3f}x, with twell's prefetch "
              f"{out[f'twell_prefetch_over_dense_b{b}']:.3f}x, both prefetching {out[f'twell_prefetch_over_dense_prefetch_b{b}']:.3f}x; "
              f"tokens equal {out[f'dense_b{b}_prefetch_tokens_equal']} / {out[f'twell_b{b}_prefetch_tokens_equal']}", flush=True)
    with open(os.path.join(OUT, "l2_prefetch_probe.json"), "w") as fh:
        json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()

"""Would each MLP reading the *next* layer's gate weights into L2 speed up decoding?

    OUT=DIR python benchmarks/l2_next_gate_probe.py

At one token per call twell's MLP is mostly its gate product: 23 MB of w_gate read whole. The
thirteenth session forked a side stream at each decoder layer to read the layer's own gate into
L2 during its attention, and lost 3 to 9 us per layer (l2_prefetch_probe.py): the fork and join,
SMs taken from attention's kernels, and perhaps lines evicted again before the MLP came. Here the
prefetch has no fork or join: right after a layer's decode kernels, on the same stream, one small
launch issues L2 prefetches of the next layer's gate (``cp.async.bulk.prefetch.L2``: the copy
engine fetches while the SMs run attention), optionally with an evict-last cache policy so that
attention's streaming reads evict other lines first.

Part 1 (does a prefetch land?): one cuBLAS gate product at one token after L2 was evicted by
reading 256 MB, without and with a prefetch and a pause of about 20 or 40 us before it.
Part 2: greedy decoding of the 2b shape (k 29 constructed, as ``twell bench model`` builds it),
Hugging Face's default path and the lean one (compiled, cuDNN attention), the step in one CUDA
graph; twell without and with the prefetch variants, dense as the baseline. Tokens must equal.
Writes OUT/l2_next_gate_probe.json; prints a table.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import time

import torch
import triton
import triton.language as tl

OUT = os.environ.get("OUT", "/tmp")


@triton.jit
def _bulk_prefetch_kernel(w_ptr, nbytes, sink_ptr, CHUNK: tl.constexpr, LANES: tl.constexpr, LAST: tl.constexpr):
    # one bulk L2 prefetch per CHUNK bytes (the copy engine does the reads; nothing waits for them)
    i = tl.program_id(0) * LANES + tl.arange(0, LANES)
    start = i.to(tl.int64) * CHUNK
    ok = start < nbytes
    size = tl.minimum(nbytes - start, CHUNK).to(tl.int32)
    ptr = w_ptr.to(tl.pointer_type(tl.int8)) + tl.where(ok, start, 0)
    if LAST:
        r = tl.inline_asm_elementwise(
            "{ .reg .b64 pol; createpolicy.fractional.L2::evict_last.b64 pol, 1.0; "
            "@$3 cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol; }\n mov.u32 $0, 0;",
            "=r,l,r,b", [ptr, size, ok], dtype=tl.int32, is_pure=False, pack=1)
    else:
        r = tl.inline_asm_elementwise("@$3 cp.async.bulk.prefetch.L2.global [$1], $2;\n mov.u32 $0, 0;", "=r,l,r,b",
                                      [ptr, size, ok], dtype=tl.int32, is_pure=False, pack=1)
    tl.store(sink_ptr + i, r.to(tl.float32), mask=ok & (r == 12345))


@triton.jit
def _line_prefetch_kernel(w_ptr, nbytes, sink_ptr, LINES: tl.constexpr):
    # one prefetch.global.L2::evict_last per 128-byte line, LINES lines per program
    i = tl.program_id(0) * LINES + tl.arange(0, LINES)
    start = i.to(tl.int64) * 128
    ok = start < nbytes
    ptr = w_ptr.to(tl.pointer_type(tl.int8)) + tl.where(ok, start, 0)
    r = tl.inline_asm_elementwise("@$2 prefetch.global.L2::evict_last [$1];\n mov.u32 $0, 0;", "=r,l,b",
                                  [ptr, ok], dtype=tl.int32, is_pure=False, pack=1)
    tl.store(sink_ptr + i, r.to(tl.float32), mask=ok & (r == 12345))


SINK = {}


def prefetch(w: torch.Tensor, how: str) -> None:
    nbytes = w.numel() * w.element_size()
    sink = SINK.get(w.device)
    if sink is None:
        sink = SINK[w.device] = torch.zeros(1 << 20, device=w.device)
    if how in ("bulk", "bulk_last"):
        chunk, lanes = 16384, 16  # 88 programs for a 23 MB gate: many SMs' copy engines
        _bulk_prefetch_kernel[(triton.cdiv(nbytes, chunk * lanes),)](w, nbytes, sink, CHUNK=chunk, LANES=lanes,
                                                                     LAST=how == "bulk_last", num_warps=1)
    elif how == "lines_last":
        lines = 2048
        _line_prefetch_kernel[(triton.cdiv(nbytes, 128 * lines),)](w, nbytes, sink, LINES=lines, num_warps=4)
    else:
        raise ValueError(how)


def land_test(w: torch.Tensor) -> dict:
    """Part 1: a one-token gate product after L2 was evicted (by reads), with and without a
    prefetch and a pause."""
    flush = torch.empty(256 << 20, dtype=torch.int8, device=w.device)
    x = torch.randn(1, w.shape[1], device=w.device, dtype=w.dtype)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    res = {}
    cases = [("cold", None, 0), ("pause20", None, 40000), ("bulk_pause20", "bulk", 40000), ("bulk_pause40", "bulk", 80000),
             ("bulk_last_pause20", "bulk_last", 40000), ("lines_last_pause20", "lines_last", 40000),
             ("lines_last_pause40", "lines_last", 80000), ("warm", "warm", 0)]
    for name, how, cycles in cases:
        ts = []
        for i in range(30):
            flush.view(torch.int32).sum()  # read-evict: clean lines
            if how == "warm":
                torch.mm(x, w.t())
            elif how is not None:
                prefetch(w, how)
            if cycles:
                torch.cuda._sleep(cycles)
            s.record()
            torch.mm(x, w.t())
            e.record()
            e.synchronize()
            if i >= 5:
                ts.append(s.elapsed_time(e) * 1e3)
        res[name] = statistics.median(ts)
        print(f"gate product at one token, {name}: {res[name]:.1f} us", flush=True)
    return res


class NextGate:
    """Patches twell's decode launchers so that after a layer's decode kernels, the next layer's
    gate weights are prefetched (``how``), on the same stream."""

    def __init__(self, model, how: str):
        import twell.kernels.decode_fused as fused
        import twell.kernels.decode_split as split

        layers = list(model.model.layers)
        self.next = {layers[i].mlp.gate_proj.weight.data_ptr(): layers[i + 1].mlp.gate_proj.weight
                     for i in range(len(layers) - 1)}
        self.how, self.hits, self.miss = how, 0, 0
        self.saved = [(fused, "decode_fused_launch", fused.decode_fused_launch),
                      (split, "decode_split_launch", split.decode_split_launch)]
        for mod, name, fn in self.saved:
            setattr(mod, name, self._wrap(fn))

    def _wrap(self, fn):
        def launch(x, w_first, *args, **kwargs):
            out = fn(x, w_first, *args, **kwargs)
            nxt = self.next.get(w_first.data_ptr())
            if nxt is not None:
                self.hits += 1
                prefetch(nxt, self.how)
            else:
                self.miss += 1
            return out
        return launch

    def remove(self):
        for mod, name, fn in self.saved:
            setattr(mod, name, fn)


def main() -> None:
    from transformers import LlamaForCausalLM

    from twell import sparsify
    from twell.bench.inference import machine_info
    from twell.bench.model import _attention_backends, calibrate_sparsity, greedy_decode
    from twell.train.model import make_config

    out = dict(preset="2b", k=29, prompt_len=128, new_tokens=128, **machine_info())
    torch.manual_seed(0)
    config = make_config("2b", 49152)
    config.hidden_act = "relu"
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    out["land"] = land_test(model.model.layers[0].mlp.gate_proj.weight)
    gen = torch.Generator(device="cuda").manual_seed(1)
    calibrate_sparsity(model, 29, torch.randint(0, config.vocab_size, (4, 2048), device="cuda", generator=gen))
    batches = [1, 16]
    prompts = {b: torch.randint(0, config.vocab_size, (b, 128), device="cuda", generator=gen) for b in batches}
    lean_name, lean_backends = _attention_backends()
    from torch.nn.attention import sdpa_kernel

    torch._dynamo.config.cache_size_limit = 64
    rows, tokens = [], {}
    for variant in ("dense", "twell"):
        if variant == "twell":
            sparsify(model)
            model.eval()
        for path in ("hf", "lean"):
            ctx = (lambda: sdpa_kernel(lean_backends, set_priority=True)) if (path == "lean" and lean_backends) else contextlib.nullcontext
            step_model = None
            if path == "lean":
                torch._dynamo.reset()
                step_model = torch.compile(model, dynamic=False)
            hows = ["none"] if variant == "dense" else ["none", "bulk", "bulk_last", "lines_last", "none"]
            for rnd, how in enumerate(hows):
                patch = NextGate(model, how) if how != "none" else None
                try:
                    with torch.no_grad(), ctx():
                        for b, prompt in prompts.items():
                            t0 = time.time()
                            g = greedy_decode(model, prompt, 128, step_model=step_model)
                            tokens.setdefault((variant, path, b), g["tokens"])
                            same = bool(torch.equal(tokens[(variant, path, b)], g["tokens"]))
                            rows.append(dict(variant=variant, path=path, prefetch=how, round=rnd, batch=b,
                                             step_us=g["step_ms"] * 1e3, tok_s=b * 1e3 / g["step_ms"], tokens_equal=same,
                                             hits=patch.hits if patch else 0, miss=patch.miss if patch else 0))
                            print(f"{variant} {path} prefetch={how} b{b}: {g['step_ms'] * 1e3:.0f} us/step, "
                                  f"{rows[-1]['tok_s']:.0f} tok/s, tokens equal {same}, hits {rows[-1]['hits']} "
                                  f"miss {rows[-1]['miss']} ({time.time() - t0:.0f}s)", flush=True)
                finally:
                    if patch is not None:
                        patch.remove()
            del step_model
    out["rows"] = rows
    with open(os.path.join(OUT, "l2_next_gate_probe.json"), "w") as fh:
        json.dump(out, fh, indent=1)
    print("\npath batch | dense tok/s | twell none | bulk | bulk_last | lines_last  (speedup over dense)")
    for path in ("hf", "lean"):
        for b in batches:
            d = [r["tok_s"] for r in rows if r["variant"] == "dense" and r["path"] == path and r["batch"] == b][0]
            cells = []
            for how in ("none", "bulk", "bulk_last", "lines_last"):
                v = [r["tok_s"] for r in rows if r["variant"] == "twell" and r["path"] == path and r["batch"] == b and r["prefetch"] == how]
                cells.append("/".join(f"{t:.0f} ({t / d:.3f}x)" for t in v))
            print(f"{path} b{b} | {d:.0f} | " + " | ".join(cells))


if __name__ == "__main__":
    main()

"""Where a sparsified model's extra peak memory in greedy decoding comes from (issue 8, item 5:
the 2b decode records read 174.5 MB above dense at batch 1 and 16 alike).

    python benchmarks/decode_memory_probe.py OUTDIR [layers ...]

For a Llama model of the 2b preset's layer shape with each given number of layers (default 4
and 12), calibrated to about 29 active units per token as in ``twell bench model``: greedy
decoding (static cache, CUDA graph) of the dense model, then of the same model after
``twell.sparsify``, as the benchmark orders them. A forward hook records, per model call, the
peak allocated bytes since the previous call and the bytes allocated after it, so the extra
shows up as persistent (after) or transient (peak) and at the prompt, a warm-up step or the
capture. Then the live CUDA tensors reachable from the sparsified model's modules that are not
parameters or buffers. Writes OUTDIR/decode_memory_probe.json; prints a table.
"""

from __future__ import annotations

import gc
import json
import os
import sys

import torch


def _calls(model):
    rows = []

    def hook(_m, _args, _out):
        rows.append((int(torch.cuda.max_memory_allocated()), int(torch.cuda.memory_allocated())))
        torch.cuda.reset_peak_memory_stats()

    return rows, model.register_forward_hook(hook)


def probe(layers: int, batch: int = 1, prompt_len: int = 128, new_tokens: int = 16) -> dict:
    from transformers import LlamaForCausalLM

    from twell import sparsify
    from twell.bench.model import calibrate_sparsity, greedy_decode
    from twell.train.model import make_config

    torch.manual_seed(0)
    config = make_config("2b", 49152)
    config.num_hidden_layers = layers
    config.hidden_act = "relu"
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    gen = torch.Generator(device="cuda").manual_seed(1)
    calibrate_sparsity(model, 29, torch.randint(0, config.vocab_size, (2, 2048), device="cuda", generator=gen))
    prompt = torch.randint(0, config.vocab_size, (batch, prompt_len), device="cuda", generator=gen)
    out = {"layers": layers, "batch": batch}
    for variant in ("dense", "twell"):
        if variant == "twell":
            sparsify(model)
            model.eval()
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before = int(torch.cuda.memory_allocated())
        torch.cuda.reset_peak_memory_stats()
        rows, handle = _calls(model)
        with torch.no_grad():
            g = greedy_decode(model, prompt, new_tokens)
        handle.remove()
        torch.cuda.synchronize()
        out[variant] = {"before": before, "after": int(torch.cuda.memory_allocated()),
                        "peak": max(r[0] for r in rows), "calls": rows[:8], "tokens": g["tokens"][0, -4:].tolist()}
    extra = {}
    params = {p.data_ptr() for p in model.parameters()} | {b.data_ptr() for b in model.buffers()}
    for name, mod in model.named_modules():
        for attr, val in vars(mod).items():
            vals = [val] if torch.is_tensor(val) else []
            if hasattr(val, "__dict__") and not isinstance(val, torch.nn.Module):
                vals += [v for v in vars(val).values() if torch.is_tensor(v)]
            for t in vals:
                if t.is_cuda and t.data_ptr() not in params:
                    extra[f"{name}.{attr}"] = extra.get(f"{name}.{attr}", 0) + t.untyped_storage().nbytes()
    out["extra_tensors"] = dict(sorted(extra.items(), key=lambda kv: -kv[1])[:20])
    out["extra_total"] = sum(extra.values())
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main() -> None:
    outdir = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "/tmp")
    layer_counts = [int(a) for a in sys.argv[2:]] or [4, 12]
    results = [probe(n, b) for n in layer_counts for b in (1, 16)]
    with open(os.path.join(outdir, "decode_memory_probe.json"), "w") as fh:
        json.dump(results, fh, indent=1)
    mb = lambda n: n / 2**20  # noqa: E731
    for r in results:
        d, t = r["dense"], r["twell"]
        print(f"layers {r['layers']:3d} batch {r['batch']:2d}: before {mb(d['before']):8.1f} / {mb(t['before']):8.1f} MiB "
              f"peak {mb(d['peak']):8.1f} / {mb(t['peak']):8.1f} (+{mb(t['peak'] - d['peak']):.1f}) "
              f"after {mb(d['after']):8.1f} / {mb(t['after']):8.1f}; tokens equal {d['tokens'] == t['tokens']}")
        for i, (a, b) in enumerate(zip(d["calls"], t["calls"])):
            print(f"   call {i}: peak {mb(a[0]):8.1f} / {mb(b[0]):8.1f} (+{mb(b[0] - a[0]):6.1f})  "
                  f"live after {mb(a[1]):8.1f} / {mb(b[1]):8.1f} (+{mb(b[1] - a[1]):6.1f})")
        print(f"   tensors held by twell modules outside parameters: {mb(r['extra_total']):.2f} MiB "
              f"{ {k: round(mb(v), 2) for k, v in list(r['extra_tensors'].items())[:5]} }")


if __name__ == "__main__":
    main()

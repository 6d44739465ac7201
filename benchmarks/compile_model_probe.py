"""Does compiling a whole model keep twell's gain? (issue 8: "a compiled twell model beats the
compiled dense one by at least what the eager twell model gains over eager dense".)

    OUT=DIR python benchmarks/compile_model_probe.py [preset]

The four-layer MLP stack of ``twell bench batch`` misses that criterion by construction: Inductor
fuses dense's element-wise passes and has nothing to fuse in twell's op, which is all there is
in that stack. ``twell bench model``'s lean path compiles the layers *and* puts cuDNN attention
first, so it is not a compile-only comparison either. Here: the 2b shape (k 29 constructed, as
``twell bench model`` builds it), prefill of 16 x 2048 tokens, Hugging Face's default attention
on both paths, each decoder layer eager or ``layer.compile(dynamic=False)``; dense and twell on
the same weights. Writes OUT/compile_model_probe.json; prints the four times and both ratios.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from twell import sparsify
from twell.bench.inference import machine_info
from twell.bench.model import _prefill, _rel_err, calibrate_sparsity, random_model

OUT = os.environ.get("OUT", "/tmp")


def main() -> None:
    preset = sys.argv[1] if len(sys.argv) > 1 else "2b"
    model = random_model(preset)
    config = model.config
    gen = torch.Generator(device="cuda").manual_seed(1)
    calibrate_sparsity(model, 29, torch.randint(0, config.vocab_size, (4, 2048), device="cuda", generator=gen))
    ids = torch.randint(0, config.vocab_size, (16, 2048), device="cuda", generator=gen)
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 64))
    out = dict(preset=preset, tokens=ids.numel(), attention=getattr(model.config, "_attn_implementation", None), **machine_info())
    ref = {}
    for variant in ("dense", "twell"):
        torch._dynamo.reset()
        if variant == "twell":
            sparsify(model)
            model.eval()
        for path in ("eager", "compiled"):
            layers = list(model.model.layers)
            if path == "compiled":
                t0 = time.time()
                for layer in layers:
                    layer.compile(dynamic=False)
                with torch.no_grad():
                    model.model(input_ids=ids, use_cache=False)
                out[f"{variant}_compile_s"] = time.time() - t0
            p = _prefill(model, ids, None, 0.0)
            out[f"{variant}_{path}_ms"] = p["ms"]
            if variant == "dense":
                ref[path] = p["hidden"]
            else:
                out[f"twell_{path}_rel_err"] = _rel_err(p["hidden"], ref[path])
                out[f"twell_{path}_paths"] = sorted({m.last_path for m in model.modules() if getattr(m, "last_path", None)})
            print(f"{variant} {path}: {p['ms']:.1f} ms", flush=True)
            del p
            if path == "compiled":
                for layer in layers:
                    layer._compiled_call_impl = None
    out["eager_gain"] = out["dense_eager_ms"] / out["twell_eager_ms"]
    out["compiled_gain"] = out["dense_compiled_ms"] / out["twell_compiled_ms"]
    out["compile_dense"] = out["dense_eager_ms"] / out["dense_compiled_ms"]
    out["compile_twell"] = out["twell_eager_ms"] / out["twell_compiled_ms"]
    print(f"{preset}, 16 x 2048 prefill: eager twell/dense {out['eager_gain']:.3f}x, compiled {out['compiled_gain']:.3f}x "
          f"(compile gains dense {out['compile_dense']:.3f}x, twell {out['compile_twell']:.3f}x); twell paths "
          f"{out.get('twell_eager_paths')} / {out.get('twell_compiled_paths')}, rel err {out.get('twell_eager_rel_err', 0):.1e} / "
          f"{out.get('twell_compiled_rel_err', 0):.1e}", flush=True)
    with open(os.path.join(OUT, "compile_model_probe.json"), "w") as fh:
        json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()

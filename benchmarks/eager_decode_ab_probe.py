"""Every-step-eager greedy decoding (Hugging Face forward, StaticCache, no CUDA graph of the
step), dense and twell alternated in rounds in one process, so that both see the same host
phases. `twell bench model` timed the two variants one after the other until the eighteenth
session, and on this machine's host-bound eager steps that order alone moved the ratio by a third.

    python benchmarks/eager_decode_ab_probe.py [PRESET] [ROUNDS]

One untimed decode of each first (kernels compile, each layer captures its graphs: otherwise
inside the first timed window). Prints ms per step of each variant, batch and round, and the
median ratio; writes $OUT/eager_decode_ab_<preset>.json. The rounds are
`twell.bench.model.eager_decode_rounds`, as `twell bench model` now runs them; the committed
results (eighteenth session) came from this script's first form, the same rounds written out
here, with two untimed steps per decode where greedy_decode now takes five."""

import copy
import json
import os
import statistics
import sys

import torch

from twell import sparsify
from twell.bench.model import calibrate_sparsity, eager_decode_rounds, greedy_decode, random_model

preset = sys.argv[1] if len(sys.argv) > 1 else "0.5b"
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
dense = random_model(preset)
vocab = dense.config.vocab_size
gen = torch.Generator(device="cuda").manual_seed(1)
calibrate_sparsity(dense, 29, torch.randint(0, vocab, (4, 2048), device="cuda", generator=gen))
twell_model = sparsify(copy.deepcopy(dense)).eval()
prompts = {b: torch.randint(0, vocab, (b, 128), device="cuda", generator=gen) for b in (1, 16)}
with torch.no_grad():
    for model in (dense, twell_model):  # untimed: kernels compile, each layer captures its graphs
        for p in prompts.values():
            greedy_decode(model, p, 16, graph=False)
    runs = eager_decode_rounds(dense, twell_model, prompts, 128, print, rounds)  # (twell bench model's rounds)
res = {f"{name}_b{b}": g["round_step_ms"] for (name, b), g in runs.items()}
mods = [m for m in twell_model.modules() if hasattr(m, "eager_graphs")]
out = {"preset": preset, "step_ms": res, "replays": sum(m.eager_graphs.replays for m in mods),
       "captures": sum(m.eager_graphs.captures for m in mods), "gpu": torch.cuda.get_device_name()}
for b in prompts:
    ratios = [d / t for d, t in zip(res[f"dense_b{b}"], res[f"twell_b{b}"])]
    out[f"speedup_b{b}"] = statistics.median(ratios)
    print(f"batch {b}: twell / dense tokens/s per round {[round(x, 3) for x in ratios]}, median {out[f'speedup_b{b}']:.3f}")
print("replays", out["replays"], "captures", out["captures"])
with open(os.path.join(os.environ.get("OUT", "/tmp"), f"eager_decode_ab_{preset}.json"), "w") as fh:
    json.dump(out, fh, indent=1)

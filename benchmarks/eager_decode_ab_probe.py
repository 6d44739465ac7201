"""Every-step-eager greedy decoding (Hugging Face forward, StaticCache, no CUDA graph of the
step), dense and twell alternated in rounds in one process, so that both see the same host
phases. `twell bench model` times the two variants one after the other, and on this machine's
host-bound eager steps that order alone can move the ratio by a third.

    python benchmarks/eager_decode_ab_probe.py [PRESET] [ROUNDS]

One untimed decode of each first (kernels compile, each layer captures its graphs: otherwise
inside the first timed window). Prints ms per step of each variant, batch and round, and the
median ratio; writes
$OUT/eager_decode_ab_<preset>.json."""

import copy
import json
import os
import statistics
import sys

import torch
from transformers import LlamaForCausalLM

from twell import sparsify
from twell.bench.model import calibrate_sparsity, greedy_decode
from twell.train.model import make_config

preset = sys.argv[1] if len(sys.argv) > 1 else "0.5b"
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
torch.manual_seed(0)
config = make_config(preset, 49152)
config.hidden_act = "relu"
with torch.device("cuda"):
    dense = LlamaForCausalLM(config).to(torch.bfloat16).eval()
gen = torch.Generator(device="cuda").manual_seed(1)
calibrate_sparsity(dense, 29, torch.randint(0, config.vocab_size, (4, 2048), device="cuda", generator=gen))
twell_model = sparsify(copy.deepcopy(dense)).eval()
prompts = {b: torch.randint(0, config.vocab_size, (b, 128), device="cuda", generator=gen) for b in (1, 16)}
res = {}
with torch.no_grad():
    for model in (dense, twell_model):  # untimed: kernels compile, each layer captures its graphs
        for p in prompts.values():
            greedy_decode(model, p, 16, graph=False)
    for r in range(rounds):
        for name, model in (("dense", dense), ("twell", twell_model)):
            for b, p in prompts.items():
                g = greedy_decode(model, p, 128, graph=False)
                res.setdefault(f"{name}_b{b}", []).append(g["step_ms"])
                print(f"round {r} {name} batch {b}: {g['step_ms']:.2f} ms per step", flush=True)
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

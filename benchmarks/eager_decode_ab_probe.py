"""Every-step-eager greedy decoding (Hugging Face forward, StaticCache, no CUDA graph of the
step) of dense and twell in one process, so that both see the same host phases. `twell bench
model` timed the two variants one after the other until the eighteenth session, and on this
machine's host-bound eager steps that order alone moved the ratio by a third; alternated rounds
(the eighteenth session's form of this probe) still spread by 15% from round to round. Now the
two decode in lockstep, step by step (`twell.bench.model.eager_decode_interleaved`, as `twell
bench model` runs them).

    python benchmarks/eager_decode_ab_probe.py [PRESET] [NEW_TOKENS] [--hooks]

``--profile``: after the timed runs, 16 more eager steps of each model at each batch under
cProfile; the 25 functions with the most own time are printed and written beside the results
(where the host time of a step goes, twell's modules against Hugging Face's MLPs).

``--hooks``: forward pre- and post-hooks on every decoder layer's ``mlp`` and ``self_attn`` (both
models) add up the host's time inside each (eager: the time to issue its work), reported as us
per decode-step call (one token per sequence; the prompt's calls are left out) beside the step
times (the hooks' own cost falls on both models alike).

One untimed decode of each first (kernels compile, each layer captures its graphs). Prints the
median step of each variant and batch, their ratio and the quartiles of the pairs' ratios; writes
$OUT/eager_decode_ab_<preset>.json."""

import cProfile
import copy
import gc
import io
import json
import os
import pstats
import statistics
import sys
import time

import torch

from twell import sparsify
from twell.bench.model import _GreedyState, calibrate_sparsity, eager_decode_interleaved, greedy_decode, random_model

args = [a for a in sys.argv[1:] if not a.startswith("--")]
preset = args[0] if args else "0.5b"
new_tokens = int(args[1]) if len(args) > 1 else 128
HOOKS = "--hooks" in sys.argv
PROFILE = "--profile" in sys.argv
dense = random_model(preset)
vocab = dense.config.vocab_size
gen = torch.Generator(device="cuda").manual_seed(1)
calibrate_sparsity(dense, 29, torch.randint(0, vocab, (4, 2048), device="cuda", generator=gen))
twell_model = sparsify(copy.deepcopy(dense)).eval()
prompts = {b: torch.randint(0, vocab, (b, 128), device="cuda", generator=gen) for b in (1, 16)}
out = {"preset": preset, "new_tokens": new_tokens, "gpu": torch.cuda.get_device_name()}
host: dict = {}


def add_host_hooks(model, name: str) -> None:
    """Host seconds spent inside each decoder layer's mlp and self_attn calls, summed in host[(name, part)]."""
    for layer in model.model.layers:
        for part in ("mlp", "self_attn"):
            mod, key, t0 = getattr(layer, part), (name, part), [0.0]

            def pre(_mod, args, kwargs, t0=t0):
                hidden = args[0] if args else kwargs.get("hidden_states")
                t0[0] = time.perf_counter() if hidden.shape[-2] == 1 else None  # decode steps only

            def post(*_, t0=t0, key=key):
                if t0[0] is None:
                    return
                total, n = host.get(key, (0.0, 0))
                host[key] = (total + time.perf_counter() - t0[0], n + 1)

            mod.register_forward_pre_hook(pre, with_kwargs=True)
            mod.register_forward_hook(post)


def profile_steps(name: str, model, prompt, b: int, steps: int = 16) -> str:
    """cProfile of ``steps`` eager decode steps of ``model`` (after 8 untimed ones: past the
    captures): the 25 functions with the most own time, printed and returned; the garbage
    collections that ran, printed."""
    st = _GreedyState(model, prompt, steps + 16)
    for _ in range(8):
        st.step()
    torch.cuda.synchronize()
    gc0 = [g["collections"] for g in gc.get_stats()]
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        st.step()
    torch.cuda.synchronize()
    prof.disable()
    gcs = [g["collections"] - c for g, c in zip(gc.get_stats(), gc0)]
    print(f"{name} batch {b}: garbage collections by generation over {steps} steps {gcs}")
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
    print(f"== cProfile, {name}, batch {b}, {steps} eager steps\n" + "\n".join(buf.getvalue().splitlines()[:45]))
    return buf.getvalue()


with torch.no_grad():
    for model in (dense, twell_model):  # untimed: kernels compile, each layer captures its graphs
        for p in prompts.values():
            greedy_decode(model, p, 16, graph=False)
    if HOOKS:
        add_host_hooks(dense, "dense")
        add_host_hooks(twell_model, "twell")
    for b, p in prompts.items():
        host.clear()
        pair = eager_decode_interleaved(dense, twell_model, p, new_tokens)
        if HOOKS:  # us per call, over the decode steps' calls (the untimed ones included)
            out[f"host_us_b{b}"] = {f"{n}_{part}": 1e6 * t / c for (n, part), (t, c) in host.items()}
            print(f"batch {b}: host us per call {({k: round(v, 1) for k, v in out[f'host_us_b{b}'].items()})}")
        r = pair["twell"]["step_ratios"]
        out[f"b{b}"] = {"dense_steps_ms": pair["dense"]["steps_ms"], "twell_steps_ms": pair["twell"]["steps_ms"],
                        "speedup": pair["dense"]["step_ms"] / pair["twell"]["step_ms"],
                        "ratio_quartiles": statistics.quantiles(r, n=4) if len(r) > 1 else None,
                        "tokens_match": bool(torch.equal(pair["dense"]["tokens"], pair["twell"]["tokens"]))}
        print(f"batch {b}: median step dense {pair['dense']['step_ms']:.2f} ms, twell {pair['twell']['step_ms']:.2f} ms, "
              f"twell / dense tokens/s {out[f'b{b}']['speedup']:.3f} (pairs' quartiles "
              f"{out[f'b{b}']['ratio_quartiles']}), tokens match {out[f'b{b}']['tokens_match']}")
        if PROFILE:
            for name, model in (("dense", dense), ("twell", twell_model)):
                out[f"profile_{name}_b{b}"] = profile_steps(name, model, p, b)
mods = [m for m in twell_model.modules() if hasattr(m, "eager_graphs")]
out["held_outputs"] = sum(m.eager_graphs.held_outputs for m in mods)
print("held_outputs", out["held_outputs"])
out["replays"] = sum(m.eager_graphs.replays for m in mods)
out["captures"] = sum(m.eager_graphs.captures for m in mods)
print("replays", out["replays"], "captures", out["captures"])
with open(os.path.join(os.environ.get("OUT", "/tmp"), f"eager_decode_ab_{preset}.json"), "w") as fh:
    json.dump(out, fh, indent=1)

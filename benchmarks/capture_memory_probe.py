"""What eager graphs keep allocated after they capture a call (issue 8, item 5: the 2b model's
lean batch-1 decoding peaked 36.8 MiB above dense's once calls of up to 1024 tokens were
replayed from graphs).

    OUT=DIR python benchmarks/capture_memory_probe.py

One SparseGatedMLP of the 2b shape (d 2048, f 5632, k 29 even, bf16, eval, no_grad), in a fresh
process. For each M in turn (1, then 128, then 1024 tokens): the bytes allocated after each of
four calls (the third captures the layer's graph of that size), so the step at the capture is
what the graph keeps. With PyTorch's allocator history on, the blocks alive at the end of at
least 1 MiB are listed with the frames that allocated them (C++ frames included), which says
whether the large one is cuBLAS's workspace for twell's capture stream. Writes
OUT/capture_memory_probe.json; prints a table.
"""

from __future__ import annotations

import json
import os

import torch

from twell.bench.runtime import _pair
from twell.bench.synthetic import make_ffn

OUT = os.environ.get("OUT", "/tmp")


def main() -> None:
    torch.cuda.memory._record_memory_history(max_entries=200000, context="all", stacks="all")
    s = make_ffn(1024, 2048, 5632, 29, device="cuda")
    _dense, twell = _pair(s)
    x_all = s.x.to(torch.bfloat16)
    rows = []
    with torch.no_grad():
        for M in (1, 128, 1024):
            x = x_all[:M].contiguous()
            for call in range(4):
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated()
                y = twell(x)
                torch.cuda.synchronize()
                del y
                after = torch.cuda.memory_allocated()
                rows.append({"M": M, "call": call + 1, "allocated_MiB": after / 2**20,
                             "step_MiB": (after - before) / 2**20, "path": twell.last_path,
                             "captures": twell.eager_graphs.captures, "replays": twell.eager_graphs.replays})
                print(f"M {M:5d} call {call + 1}: allocated {after / 2**20:9.2f} MiB, step {(after - before) / 2**20:+8.2f} MiB, "
                      f"path {twell.last_path}, captures {twell.eager_graphs.captures}")
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    blocks = []
    for seg in snap["segments"]:
        for b in seg["blocks"]:
            if b["state"] != "active_allocated" or b["size"] < 2**20:
                continue
            frames = [f"{fr.get('name', '?')} ({os.path.basename(fr.get('filename', '?'))}:{fr.get('line', 0)})"
                      for fr in (b.get("frames") or [])]
            keep = [fr for fr in frames if any(w in fr.lower() for w in ("blas", "workspace", "twell", "graph"))]
            blocks.append({"MiB": b["size"] / 2**20, "pool": str(seg.get("segment_pool_id")),
                           "frames": (keep or frames)[:12]})
    blocks.sort(key=lambda b: -b["MiB"])
    print("\nlive blocks of at least 1 MiB (weights included), largest first:")
    for b in blocks[:20]:
        print(f"  {b['MiB']:8.2f} MiB, pool {b['pool']}: " + " <- ".join(b["frames"][:6]))
    with open(os.path.join(OUT, "capture_memory_probe.json"), "w") as fh:
        json.dump({"calls": rows, "blocks": blocks, "gpu": torch.cuda.get_device_name(),
                   "torch": torch.__version__}, fh, indent=1)


if __name__ == "__main__":
    main()

"""``twell convert SRC DST``: arguments are parsed before torch and transformers load (the
work is in :func:`twell.hf.convert`)."""

from __future__ import annotations

import argparse
import sys


def convert_main(argv=None) -> None:
    """``twell convert SRC DST``: the command-line form of :func:`twell.hf.convert`."""
    parser = argparse.ArgumentParser(
        prog="twell convert",
        description="Swap the gated MLPs of a Hugging Face causal LM for twell's ReLU-gated sparse "
        "MLPs and save it. ReLU for SiLU changes the function: train or fine-tune sparse afterwards.",
    )
    parser.add_argument("src", help="model folder (or hub name, where there is a network)")
    parser.add_argument("dst", help="output folder")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="load and save in this dtype")
    args = parser.parse_args(argv)
    import os

    args.src, args.dst = os.path.expanduser(args.src), os.path.expanduser(args.dst)

    # a path, not a hub name ("org/name"): say it is missing before transformers reads it as a repo id
    if args.src.startswith((".", "/")) and not os.path.isdir(args.src):
        raise SystemExit(f"twell convert: {args.src} is not a folder")
    if os.path.isdir(args.dst) and os.listdir(args.dst):
        raise SystemExit(f"twell convert: {args.dst} exists and is not an empty folder")
    from transformers import AutoConfig

    from .hf import SparseGatedMLP, activation_note, convert

    try:
        note = activation_note(getattr(AutoConfig.from_pretrained(args.src), "hidden_act", None))
        if note:
            print(f"note: {args.src}: {note}; {args.dst} is saved with hidden_act relu", file=sys.stderr)
        model = convert(args.src, args.dst, args.dtype)
    except (OSError, ValueError) as err:  # no such model, no network, no gated MLP: no traceback
        raise SystemExit(f"twell convert: {args.src}: {' '.join(str(err).split())}")
    n = sum(1 for m in model.modules() if isinstance(m, SparseGatedMLP))
    print(f"converted {n} MLPs of {type(model).__name__}; saved to {args.dst}")

"""The ``twell`` command.

Each subcommand lives in its own module and is imported only when it runs, so that
``twell --help`` stays fast and a missing optional dependency only affects its own command.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, function, one-line help). The function takes the remaining argv.
COMMANDS = {
    "train": ("twell.recipe.cli", "train_main", "train a sparse language model (ReLU gate + L1)"),
    "eval": ("twell.recipe.cli", "eval_main", "validation loss, perplexity and sparsity of a checkpoint"),
    "export": ("twell.recipe.cli", "export_main", "write a checkpoint (sharded or not) as a Hugging Face folder"),
    "data": ("twell.recipe.data_cli", "data_main", "prepare a corpus (tokenize once into token shards on disk) or "
             "learn a BPE tokenizer from one"),
    "bench": ("twell.bench.cli", "bench_main", "benchmark twell kernels against dense PyTorch"),
    "convert": ("twell.convert_cli", "convert_main", "sparsify a Hugging Face model folder and save it"),
}


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="twell",
        description="Sparse feed-forward blocks for transformer LMs. "
        "Run `twell COMMAND --help` for the options of a command.",
    )
    parser.add_argument("--version", action="version", version=f"twell {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, _, help_) in COMMANDS.items():
        sub.add_parser(name, help=help_, add_help=False)
    if not argv or argv[0] not in COMMANDS:
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help()
        return
    module, function, _ = COMMANDS[argv[0]]
    try:
        entry = getattr(importlib.import_module(module), function)
    except (ImportError, AttributeError) as err:
        raise SystemExit(f"twell {argv[0]}: not available in this installation ({err})")
    entry(argv[1:])


def _version() -> str:
    from . import __version__

    return __version__


if __name__ == "__main__":
    main()

"""Runs that start from a Hugging Face model folder: ``twell train --init-from FOLDER``.

FOLDER is a Llama-family causal LM saved with ``save_pretrained`` (Llama, Qwen2, Mistral, a
``twell export`` folder, a twell checkpoint): ``config.json``, its weights (safetensors, or
PyTorch files) and its tokenizer files. The run takes from it

- the architecture: hidden size, layers, heads, vocabulary and context are the folder's; size
  options that disagree with it are errors (:func:`check_sizes`);
- the weights, converted: the MLPs become twell's ReLU-gated modules whatever activation they
  had (:func:`load_converted`, through :func:`twell.hf.load_sparse`, what ``twell convert``
  does). ReLU for SiLU changes the function: the run's first steps start from the converted
  model's loss;
- the tokenizer, which tokenizes the data and is saved with every checkpoint and export.

A run resumed from one of its own checkpoints reads nothing from FOLDER: the weights, the
architecture (``config.json``, already ReLU) and the tokenizer are the checkpoint's.

The checks read JSON only (no torch), so that ``twell train`` reports them before torch loads.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

__all__ = ["SIZE_FIELDS", "folder_config", "check_sizes", "default_seq_len", "check_vocab", "check_same_tokenizer",
           "load_converted"]

# TrainConfig's size options -> the config.json keys they would set
SIZE_FIELDS = {"hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
               "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads"}
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "twell_tokenizer.json")
# The default sequence length: the folder's context, up to this (the paper's presets' context).
MAX_DEFAULT_SEQ_LEN = 2048


def folder_config(folder: str) -> dict:
    """FOLDER's ``config.json`` as a dict, after checking that FOLDER holds a causal LM's config
    with the sizes twell reads, its weights and a tokenizer. Raises ValueError saying what is
    missing."""
    path = Path(folder).expanduser()
    where = f"--init-from {folder}"
    if not path.is_dir():
        raise ValueError(f"{where}: no such folder")
    if (path / "dcp").is_dir():
        raise ValueError(f"{where} is a sharded checkpoint: write it as a Hugging Face folder first "
                         f"(twell export {folder} OUT) and start from OUT")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{where} holds no config.json: give a folder that save_pretrained wrote")
    try:
        config = json.loads(config_file.read_text())
    except ValueError as err:
        raise ValueError(f"{config_file} is not JSON: {err}") from err
    missing = [k for k in (*SIZE_FIELDS.values(), "vocab_size") if not isinstance(config.get(k), int)]
    if missing:
        raise ValueError(f"{config_file} has no {', '.join(missing)}: twell trains Llama-family causal LMs "
                         "(Llama, Qwen2, Mistral and others whose MLPs have gate_proj, up_proj, down_proj)")
    if not any((path / name).is_file() for name in WEIGHT_FILES):
        raise ValueError(f"{where} holds no weights (none of {', '.join(WEIGHT_FILES)})")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"{where} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}): the run tokenizes "
                         "its data with the model's own; save it beside the model (tokenizer.save_pretrained(FOLDER))")
    return config


def check_sizes(given: dict, config: dict, folder: str) -> None:
    """Size options given with ``--init-from`` (``given``: TrainConfig field -> value or None)
    must equal the folder's ``config``: the architecture is the folder's."""
    for option, key in SIZE_FIELDS.items():
        value = given.get(option)
        if value is not None and value != config[key]:
            raise ValueError(f"--{option.replace('_', '-')} {value} conflicts with --init-from {folder}, whose {key} "
                             f"is {config[key]}: the architecture comes from the folder; leave the size options out")


def default_seq_len(config: dict) -> int:
    """The run's sequence length when none is given: the folder's context, at most
    :data:`MAX_DEFAULT_SEQ_LEN`."""
    return min(config.get("max_position_embeddings") or MAX_DEFAULT_SEQ_LEN, MAX_DEFAULT_SEQ_LEN)


def check_vocab(tokenizer, vocab_size: int, folder: str) -> None:
    """The tokenizer's ids must all have a row in the model's embedding (``vocab_size`` rows)."""
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(f"the tokenizer {tokenizer.name!r} has {tokenizer.vocab_size} ids, more than the {vocab_size} "
                         f"rows of the embedding of --init-from {folder}: the data must be tokenized with the "
                         "model's own tokenizer (prepare a corpus with --tokenizer FOLDER)")


# Text whose ids two tokenizers must agree on to count as the same: words, code, digits,
# whitespace runs, accents and a character outside the BMP.
PROBE = "def main(x):\n    return x ** 2  # caf\u00e9, na\u00efve \u2013 \u00fcber 12345 \U0001f600\n\n\tThe End."


def check_same_tokenizer(corpus_tokenizer, model_tokenizer, corpus: str, folder: str) -> None:
    """A corpus prepared with ``twell data prepare`` must have been tokenized with the model's
    tokenizer, under whatever name it was given then: the same number of ids, end-of-text id
    and ids for :data:`PROBE`."""
    a, b = corpus_tokenizer, model_tokenizer
    if (a.vocab_size, a.eos_id) != (b.vocab_size, b.eos_id) or a.encode(PROBE).tolist() != b.encode(PROBE).tolist():
        raise ValueError(f"--data {corpus} was prepared with the tokenizer {a.name!r} ({a.vocab_size} ids), not the "
                         f"model's ({b.vocab_size} ids) of --init-from {folder}: prepare it with --tokenizer {folder}")


def load_converted(folder: str, seed: int = 0) -> "nn.Module":
    """FOLDER's causal LM in float32 on the CPU with its MLPs converted to twell's ReLU-gated
    ones and ``config.hidden_act`` set to ``"relu"`` (:func:`twell.hf.load_sparse`).

    The global RNG is seeded with ``seed`` first, as :func:`twell.recipe.model.build_model`
    does, so the run's random stream after the build does not depend on where the weights
    came from."""
    import torch
    from transformers.utils import logging as hf_logging

    from ..hf import load_sparse

    torch.manual_seed(seed)
    hf_logging.disable_progress_bar()  # its "Loading checkpoint shards" bar would break the run's output
    return load_sparse(str(Path(folder).expanduser()), dtype="float32")

"""Training sparse language models with the ReLU + L1 recipe (``twell train``).

- :mod:`twell.recipe.model`: presets (tiny, small, 0.5b, 1b, 1.5b, 2b) as Hugging Face Llama
  models with twell's sparse MLPs (or, for a dense baseline, Hugging Face's own SiLU MLPs).
- :mod:`twell.recipe.data`: corpora (stdlib sources, local files, HF datasets), tokenizers,
  packed sequences, prefetching.
- :mod:`twell.recipe.shards`: corpora prepared once into token shards (``twell data prepare``).
- :mod:`twell.recipe.bpe`: byte-level BPE tokenizers learnt from a corpus (``twell data tokenizer``).
- :mod:`twell.recipe.corpus`: what a run reads (prepared shards or raw corpora).
- :mod:`twell.recipe.config`: the run's settings (:class:`TrainConfig`), checked without torch.
- :mod:`twell.recipe.init_from`: runs that start from a Hugging Face model folder, its MLPs
  converted to ReLU (``twell train --init-from``).
- :mod:`twell.recipe.trainer`: the loop (:class:`Trainer`, :func:`train`).
- :mod:`twell.recipe.stats`: per-layer sparsity statistics and dead units (Eq. 6).
- :mod:`twell.recipe.checkpoint`, :mod:`twell.recipe.report`: checkpoints, logs, summary, plot.
- :mod:`twell.recipe.meta_init`: models built on the meta device, sharded with FSDP2.
- :mod:`twell.recipe.export`: a checkpoint written as a Hugging Face folder.
- :mod:`twell.recipe.cli`, :mod:`twell.recipe.data_cli`: ``twell train/eval/export`` and
  ``twell data``.

The names below load their module on first use (see ``twell/__init__.py``).
"""

import importlib

_EXPORTS = {
    "TrainConfig": "config",
    "Trainer": "trainer",
    "train": "trainer",
    "evaluate_lm": "trainer",
    "PRESETS": "model",
    "make_config": "model",
    "build_model": "model",
    "ByteTokenizer": "data",
    "HFTokenizer": "data",
    "PackedSequences": "data",
    "build_streams": "data",
    "load_tokenizer": "data",
    "train_bpe": "bpe",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'twell.recipe' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)

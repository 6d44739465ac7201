"""Training sparse language models with the ReLU + L1 recipe (``twell train``).

- :mod:`twell.train.model`: presets (tiny, small, 0.5b, 1b, 1.5b, 2b) as Hugging Face Llama
  models with twell's sparse MLPs.
- :mod:`twell.train.data`: corpora (stdlib sources, local files, HF datasets), tokenizers,
  packed sequences.
- :mod:`twell.train.config`: the run's settings (:class:`TrainConfig`), checked without torch.
- :mod:`twell.train.trainer`: the loop (:class:`Trainer`, :func:`train`).
- :mod:`twell.train.stats`: per-layer sparsity statistics and dead units (Eq. 6).
- :mod:`twell.train.checkpoint`, :mod:`twell.train.report`: checkpoints, logs, summary, plot.

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
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'twell.train' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)

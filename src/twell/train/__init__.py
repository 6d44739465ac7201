"""Training sparse language models with the ReLU + L1 recipe (``twell train``).

- :mod:`twell.train.model`: presets (tiny, small, 0.5b, 1b, 1.5b, 2b) as Hugging Face Llama
  models with twell's sparse MLPs.
- :mod:`twell.train.data`: corpora (stdlib sources, local files, HF datasets), tokenizers,
  packed sequences.
- :mod:`twell.train.trainer`: the loop (:class:`TrainConfig`, :class:`Trainer`, :func:`train`).
- :mod:`twell.train.stats`: per-layer sparsity statistics and dead units (Eq. 6).
- :mod:`twell.train.checkpoint`, :mod:`twell.train.report`: checkpoints, logs, summary, plot.
"""

from .data import ByteTokenizer, HFTokenizer, PackedSequences, build_streams, load_tokenizer
from .model import PRESETS, build_model, make_config
from .trainer import TrainConfig, Trainer, evaluate_lm, train

__all__ = ["TrainConfig", "Trainer", "train", "evaluate_lm", "PRESETS", "make_config", "build_model",
           "ByteTokenizer", "HFTokenizer", "PackedSequences", "build_streams", "load_tokenizer"]

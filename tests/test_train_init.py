"""twell train --init-from: a run that starts from a Hugging Face model folder (its weights,
architecture and tokenizer), converts its MLPs to ReLU, ramps lambda up, resumes from its own
checkpoints and exports like a run from scratch."""

import pytest
import torch
from transformers import LlamaConfig

from twell.recipe.model import build_model


def test_build_model_refuses_a_model_that_is_not_relu():
    """A SiLU model reaches training only through a conversion asked for, never swapped in passing."""
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=40, num_hidden_layers=1,
                         num_attention_heads=2, hidden_act="silu")
    with pytest.raises(ValueError, match=r"MLPs use silu, not ReLU.*--init-from"):
        build_model(config)
    config.hidden_act = "relu"
    assert build_model(config).config.hidden_act == "relu"

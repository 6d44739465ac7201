"""Model presets: Llama-style causal LMs whose MLPs are twell's ReLU-gated sparse modules.

Every preset is a Hugging Face ``LlamaConfig`` with ``hidden_act="relu"``, RoPE and tied input
and output embeddings; :func:`build_model` makes the ``LlamaForCausalLM`` and swaps its MLPs
for :class:`twell.SparseGatedMLP` (``twell.sparsify``), which computes the same function and
adds the L1 term and the sparsity statistics.

A dense baseline (``twell train --activation silu``) is the same preset with
``hidden_act="silu"`` and Hugging Face's own ``LlamaMLP``: ``build_model(config, dense=True)``
leaves the MLPs as they are.

| preset | d | f | layers | heads | context | vocab | params (tied) |
|---|---|---|---|---|---|---|---|
| tiny | 128 | 352 | 4 | 4 | 256 | tokenizer's | 0.8 M |
| small | 512 | 1408 | 8 | 8 | 1024 | tokenizer's | 25 M + embeddings |
| 0.5b / 1b / 1.5b / 2b | 2048 | 5632 | 8 / 18 / 28 / 38 | 32 | 2048 | 49152 | 0.5 / 1.0 / 1.5 / 2.0 B |

f / d = 2.75 everywhere, as in the paper. The paper's presets fix the vocabulary at 49152
(a tokenizer of that size, e.g. ``--tokenizer HuggingFaceTB/SmolLM-135M``); the small ones take
the tokenizer's size rounded up to a multiple of 64.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:  # torch and transformers load in the functions: the preset table is read before them
    import torch
    from transformers import LlamaConfig, PretrainedConfig, PreTrainedModel

__all__ = ["Preset", "PRESETS", "make_config", "build_model", "count_params"]


@dataclass(frozen=True)
class Preset:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    context: int
    vocab_size: Optional[int] = None  # None: the tokenizer's, rounded up to a multiple of 64


def _paper(layers: int) -> Preset:
    return Preset(2048, 5632, layers, 32, 2048, 49152)


PRESETS: dict[str, Preset] = {
    "tiny": Preset(128, 352, 4, 4, 256),
    "small": Preset(512, 1408, 8, 8, 1024),
    "0.5b": _paper(8),
    "1b": _paper(18),
    "1.5b": _paper(28),
    "2b": _paper(38),
}


def make_config(preset: str, tokenizer_vocab: int, eos_id: Optional[int] = None, hidden_act: str = "relu",
                **overrides) -> LlamaConfig:
    """The ``LlamaConfig`` of a preset for a tokenizer of ``tokenizer_vocab`` ids whose end of
    text is ``eos_id`` (None: Llama's defaults), its MLPs gated by ``hidden_act`` (``"relu"``
    for twell's sparse MLPs; ``"silu"`` for a dense baseline).

    ``overrides`` (``hidden_size``, ``intermediate_size``, ``num_layers``, ``num_heads``,
    ``context``; None means keep) change the preset's shape.
    """
    from transformers import LlamaConfig

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    p = PRESETS[preset]
    fields = {k: (v if v is not None else getattr(p, k)) for k, v in {**overrides}.items()}
    p = Preset(**{**p.__dict__, **fields})
    if p.hidden_size % p.num_heads:
        raise ValueError(f"hidden size {p.hidden_size} is not a multiple of the {p.num_heads} heads")
    vocab = p.vocab_size if p.vocab_size is not None else -(-tokenizer_vocab // 64) * 64
    if tokenizer_vocab > vocab:
        raise ValueError(f"preset {preset!r} has a vocabulary of {vocab}, the tokenizer needs {tokenizer_vocab}")
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=p.hidden_size,
        intermediate_size=p.intermediate_size,
        num_hidden_layers=p.num_layers,
        num_attention_heads=p.num_heads,
        num_key_value_heads=p.num_heads,
        max_position_embeddings=p.context,
        hidden_act=hidden_act,
        tie_word_embeddings=True,
        initializer_range=0.02,
        rms_norm_eps=1e-5,
        attention_bias=False,
        mlp_bias=False,
        # saved with every checkpoint and export: generate() reads it (False there would recompute
        # the whole sequence at every new token); training passes use_cache=False itself
        use_cache=True,
        # the separator the corpus puts after every document: generate() stops there (Llama's
        # defaults, 1 and 2, would stop at byte 2 of the byte tokenizer)
        **({} if eos_id is None else {"bos_token_id": eos_id, "eos_token_id": eos_id}),
    )


def build_model(config: PretrainedConfig, seed: int = 0, device=None, dense: bool = False) -> PreTrainedModel:
    """A freshly initialised sparse LM: the causal LM of ``config``'s family (``LlamaForCausalLM``
    for a preset's ``LlamaConfig``) with twell's MLPs; with ``dense``, with the family's own MLPs
    of ``config.hidden_act`` (a dense baseline, no twell module).

    The initialisation depends only on ``seed`` (the global RNG is seeded here), so every
    process of a distributed run starts from the same weights.

    Raises:
        ValueError: if ``config.hidden_act`` is not ``"relu"`` and ``dense`` is False. twell's
            MLPs compute ReLU; a model of another activation is converted only where that is
            asked for (``twell train --init-from``, ``twell.sparsify``), never here in passing.
    """
    import torch
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    from ..hf import sparsify

    act = getattr(config, "hidden_act", None)
    if act != "relu" and not dense:
        raise ValueError(f"the model's MLPs use {act}, not ReLU: twell trains ReLU-gated MLPs and does not swap the "
                         "activation in passing; start from such a model with twell train --init-from FOLDER "
                         "(which converts it) or twell.sparsify(model)")
    torch.manual_seed(seed)
    model = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)](config)
    if not dense:
        sparsify(model)
    return model.to(device) if device is not None else model


def count_params(model: torch.nn.Module) -> int:
    """Parameters, counting tied ones once."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())

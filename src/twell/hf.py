"""Hugging Face integration: swap the MLPs of a loaded model for twell's sparse ones.

This swaps module *instances* on a model you already loaded; no Hugging Face class is patched,
so it keeps working across transformers releases as long as the MLPs keep their
``gate_proj``/``up_proj``/``down_proj`` (or ``up_proj``/``down_proj``) layout.
"""

from __future__ import annotations

from typing import Callable, Optional

from torch import nn

from .nn import SparseGatedMLP
from .fp8_nn import Fp8SparseGatedMLP

__all__ = ["sparsify", "is_gated_mlp", "load_sparse", "convert", "activation_note"]


def activation_note(act: Optional[str]) -> Optional[str]:
    """A plain sentence for a model whose MLP activation (``config.hidden_act``) is ``act``,
    when that is not ReLU; None for ReLU (or unknown)."""
    if act is None or act == "relu":
        return None
    return (f"its MLPs use {act}, not ReLU; twell's sparse MLPs compute ReLU in its place, which is a "
            f"different function: the model needs sparse training or fine-tuning (twell train) before its outputs mean anything")


def is_gated_mlp(module: nn.Module) -> bool:
    """True for a Llama-family gated MLP: ``gate_proj``, ``up_proj`` and ``down_proj`` Linears."""
    return all(isinstance(getattr(module, n, None), nn.Linear) for n in ("gate_proj", "up_proj", "down_proj"))


def _sparse_from(module: nn.Module) -> SparseGatedMLP:
    gate, up, down = module.gate_proj, module.up_proj, module.down_proj
    if not (gate.weight.shape == up.weight.shape and down.weight.shape == gate.weight.shape[::-1]):
        raise ValueError(
            f"{type(module).__name__} has gate_proj {list(gate.weight.shape)}, up_proj "
            f"{list(up.weight.shape)}, down_proj {list(down.weight.shape)}; expected [f, d], [f, d], [d, f]"
        )
    f, d = gate.weight.shape
    has_bias = gate.bias is not None
    if (up.bias is not None) != has_bias or (down.bias is not None) != has_bias:
        raise ValueError(f"{type(module).__name__}: the three projections must all have biases or none")
    new = SparseGatedMLP(d, f, bias=has_bias, device="meta")
    # Share the Parameter objects: no copy, no extra memory, and optimizers or tied
    # references that already hold them keep working.
    new.gate_proj, new.up_proj, new.down_proj = gate, up, down
    new.fire_counts = new.fire_counts.new_zeros(f, device=gate.weight.device)
    new.tokens_seen = new.tokens_seen.new_zeros((), device=gate.weight.device)
    new.train(module.training)
    return new


def sparsify(
    model: nn.Module,
    *,
    filter: Optional[Callable[[str, nn.Module], bool]] = None,
    set_config_activation: bool = True,
    fp8: bool = False,
) -> nn.Module:
    """Replace, in place, every gated MLP of a Hugging Face model with :class:`SparseGatedMLP`.

    Works on Llama-family models whose MLPs have ``gate_proj``, ``up_proj`` and ``down_proj``
    Linears (Llama, Qwen2, Qwen3, Mistral, and others). The weights are kept: the new modules
    hold the very same Parameter objects.

    **This changes the function.** twell's gate is ReLU, so a model trained with SiLU (as
    released Llama, Qwen and Mistral checkpoints are) computes something else after the swap
    and must be trained or fine-tuned sparse (ReLU + L1, see ``twell train``) before its
    outputs mean anything. The swapped model equals the original model run with
    ``hidden_act="relu"``.

    Args:
        model: a loaded model (e.g. ``LlamaForCausalLM``).
        filter: optional ``filter(qualified_name, module) -> bool`` to swap only some MLPs.
        set_config_activation: also set ``model.config.hidden_act = "relu"`` so that a saved
            model reloads with the activation it now has.
        fp8: make each MLP a :class:`twell.fp8_nn.Fp8SparseGatedMLP` instead: inference only,
            its weights e4m3 with one scale per row (:mod:`twell.fp8`), the bf16 weights
            dropped. MLPs already sparse (:class:`SparseGatedMLP`) are converted too.

    Returns:
        The same model, for chaining.

    Raises:
        ValueError: if no gated MLP was found (nothing would be sparse).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    # every name an MLP is registered under: an instance shared by two layers must be swapped at
    # both, or the second keeps running the dense MLP (named_modules() lists it once)
    targets = [
        (name, mod)
        for name, mod in model.named_modules(remove_duplicate=False)
        if name and is_gated_mlp(mod) and (fp8 or not isinstance(mod, SparseGatedMLP)) and (filter is None or filter(name, mod))
    ]
    done = Fp8SparseGatedMLP if fp8 else SparseGatedMLP
    if not targets and not any(isinstance(m, done) for m in model.modules()):
        raise ValueError(
            f"found no gated MLP (a module with gate_proj, up_proj and down_proj nn.Linear) in {type(model).__name__}"
        )
    swapped: dict[int, nn.Module] = {}  # one sparse module per MLP instance, shared as it was
    for name, mod in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if id(mod) not in swapped:
            swapped[id(mod)] = Fp8SparseGatedMLP.from_mlp(mod) if fp8 else _sparse_from(mod)
        setattr(parent, child, swapped[id(mod)])
    config = getattr(model, "config", None)
    if set_config_activation and config is not None and hasattr(config, "hidden_act"):
        config.hidden_act = "relu"
    return model


def load_sparse(src: str, dtype: Optional[str] = None) -> nn.Module:
    """Load a Hugging Face causal LM from ``src`` (a local folder or a hub name where there is a
    network) with ``AutoModelForCausalLM`` and :func:`sparsify` it: its MLPs become
    :class:`SparseGatedMLP` and ``config.hidden_act`` becomes ``"relu"``.

    ``dtype``: ``"float32"``, ``"bfloat16"`` or ``"float16"`` (None: as saved). As
    :func:`sparsify` says, a model trained with another activation computes another function
    after the swap and must be trained or fine-tuned sparse (``twell train --init-from``).
    """
    import torch
    from transformers import AutoModelForCausalLM

    kwargs = {"dtype": getattr(torch, dtype)} if dtype else {}
    return sparsify(AutoModelForCausalLM.from_pretrained(src, **kwargs))


def convert(src: str, dst: str, dtype: Optional[str] = None) -> nn.Module:
    """:func:`load_sparse` ``src`` and save it to ``dst`` with ``hidden_act = "relu"``, with the
    source's tokenizer when it has one.

    The saved folder loads with plain ``transformers`` (as the ReLU model) and with twell
    (``twell.sparsify(AutoModelForCausalLM.from_pretrained(dst))``). As :func:`sparsify` says,
    the converted model must be trained or fine-tuned sparse before use.
    """
    from transformers import AutoTokenizer

    model = load_sparse(src, dtype)
    model.save_pretrained(dst)
    try:  # keep the tokenizer beside the weights when the source has one
        AutoTokenizer.from_pretrained(src).save_pretrained(dst)
    except (OSError, ValueError):
        pass
    return model

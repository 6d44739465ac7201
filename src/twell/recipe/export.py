"""``twell export``: a checkpoint (sharded DCP or safetensors) as a Hugging Face model folder.

    OUT/
      config.json, generation_config.json   the model's LlamaConfig (hidden_act relu; silu for a
                                             dense baseline, twell train --activation silu)
      model.safetensors (or shards + index)  the weights, whole, in float32
      tokenizer files, twell_tokenizer.json  the run's tokenizer, as checkpoints hold it
      train_config.json                      the run's settings: twell eval OUT reads the run's
                                             validation windows by default
      twell_export.json                      where it came from: checkpoint, step, world size

``AutoModelForCausalLM.from_pretrained(OUT)`` loads it (a plain Llama, or the family the run
started from, with ReLU MLPs: the same function; ``twell.sparsify`` brings back the sparse
modules; a dense baseline's export is a plain SiLU Llama) and so does ``twell eval OUT``.
No optimizer state and no process group: a sharded checkpoint's weights are assembled from its
shards in this one process (DCP reads the pieces of each tensor from every rank's file), so the
export needs the memory of the full weights once, not of the optimizer.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from . import checkpoint as ckpt

__all__ = ["export_checkpoint", "load_model"]

EXPORT_INFO = "twell_export.json"


def load_model(directory: Path, dtype=None):
    """The causal LM of the checkpoint or export in ``directory`` (sharded checkpoints included):
    the class of its config's family (``LlamaForCausalLM`` for twell's presets; Qwen2, Mistral
    and the like for runs started with ``--init-from``) with its weights, on the CPU, not
    sparsified."""
    import torch
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig, AutoModelForCausalLM

    directory = Path(directory)
    dtype = dtype or torch.float32
    if not ckpt.is_sharded(directory):
        return AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
    config = AutoConfig.from_pretrained(directory)
    weights = ckpt.load_model_weights(directory)
    # Built on the meta device and given the checkpoint's tensors (no random init of weights
    # that are replaced at once); the non-persistent buffers (RoPE) are then computed on the CPU.
    with torch.device("meta"):
        model = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)](config)
    if config.tie_word_embeddings:
        weights.setdefault("lm_head.weight", weights["model.embed_tokens.weight"])
    missing, unexpected = model.load_state_dict(weights, strict=False, assign=True)
    if missing or unexpected:
        raise ValueError(f"{directory}: the checkpoint's weights do not fit its config.json (missing: "
                         f"{', '.join(missing[:5]) or 'none'}; unexpected: {', '.join(unexpected[:5]) or 'none'})")
    model.tie_weights()
    _compute_buffers(model, config)
    return model.to(dtype).eval()


def _compute_buffers(model, config) -> None:
    """The buffers a meta build leaves empty (RoPE's inv_freq): from a CPU build of the module
    that owns them, which holds no weights."""
    import torch

    for name, module in model.named_modules():
        buffers = dict(module.named_buffers(recurse=False))
        if not any(b.is_meta for b in buffers.values()):
            continue
        if any(True for _ in module.parameters(recurse=False)):
            raise ValueError(f"{name}: buffers on the meta device in a module with weights")
        fresh = type(module)(config=config)
        for key, value in fresh.named_buffers(recurse=False):
            module.register_buffer(key, value.to(torch.float32) if value.is_floating_point() else value,
                                   persistent=key not in module._non_persistent_buffers_set)


def export_checkpoint(source: Path, out: Path) -> dict:
    """Write the Hugging Face folder of the checkpoint ``source`` to ``out`` (absent or empty),
    through a temporary folder renamed into place. Returns what ``twell_export.json`` holds."""
    from transformers.utils import logging as hf_logging

    from .data import load_tokenizer

    source, out = Path(source), Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not an empty folder")
    model = load_model(source)
    # an export is for inference: generate() with a KV cache (checkpoints of earlier versions
    # saved use_cache False, the training setting)
    model.config.use_cache = True
    model.generation_config.use_cache = True
    tmp = ckpt.temporary_folder(out)
    hf_logging.disable_progress_bar()
    model.save_pretrained(tmp)
    if (source / "twell_tokenizer.json").is_file():
        load_tokenizer(str(source)).save(tmp)
    if (source / "train_config.json").is_file():
        shutil.copyfile(source / "train_config.json", tmp / "train_config.json")
    meta = ckpt.read_meta(source / "trainer_state.safetensors") if (source / "trainer_state.safetensors").is_file() else {}
    info = {"checkpoint": str(source.resolve()), "step": meta.get("step"), "world_size": meta.get("world_size", 1),
            "format": "dcp" if ckpt.is_sharded(source) else "safetensors",
            "params": sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())}
    (tmp / EXPORT_INFO).write_text(json.dumps(info, indent=1))
    if out.exists():
        out.rmdir()  # empty: checked above
    ckpt.commit(tmp, out)
    return info

"""Checkpoints: one folder per step, readable by transformers, twell and ``--resume``.

    step_000300/
      config.json, model.safetensors   model.save_pretrained: LlamaForCausalLM.from_pretrained
                                       loads it (hidden_act relu); twell.sparsify after loading
                                       restores the sparse modules
      optimizer.safetensors            AdamW state, one tensor per (parameter name, slot);
                                       the param groups as JSON in the metadata
      trainer_state.safetensors        RNG states of every rank, dead-unit tracker and the sums
                                       since the last log row (both summed over ranks); metadata:
                                       step, samples consumed (the data position), scheduler
      train_config.json                the run's settings (eval and --resume read them)
      twell_tokenizer.json (+ HF tokenizer files)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

__all__ = ["save_optimizer", "load_optimizer", "save_tensors_with_meta", "load_tensors_with_meta",
           "load_model_weights", "latest_checkpoint"]


def save_tensors_with_meta(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(path), metadata={"json": json.dumps(meta)})


def load_tensors_with_meta(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as fh:
        meta = json.loads(fh.metadata()["json"])
    return load_file(str(path)), meta


def save_optimizer(path: Path, osd: dict) -> None:
    """Save a full optimizer state dict keyed by parameter names (``get_state_dict`` layout)."""
    tensors, scalars = {}, {}
    for name, slots in osd["state"].items():
        for slot, value in slots.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{name}/{slot}"] = value
            else:
                scalars[f"{name}/{slot}"] = value
    save_tensors_with_meta(path, tensors, {"param_groups": osd["param_groups"], "scalars": scalars})


def load_optimizer(path: Path) -> dict:
    tensors, meta = load_tensors_with_meta(path)
    state: dict[str, dict] = {}
    for key, value in list(tensors.items()) + list(meta["scalars"].items()):
        name, _, slot = key.rpartition("/")
        state.setdefault(name, {})[slot] = value
    groups = [{**g, "betas": tuple(g["betas"])} if "betas" in g else g for g in meta["param_groups"]]
    return {"state": state, "param_groups": groups}


def load_model_weights(directory: Path) -> dict[str, torch.Tensor]:
    """The state dict that save_pretrained wrote in ``directory`` (one file or shards)."""
    directory = Path(directory)
    single = directory / "model.safetensors"
    if single.is_file():
        return load_file(str(single))
    index = directory / "model.safetensors.index.json"
    if not index.is_file():
        raise FileNotFoundError(f"{directory} holds no model.safetensors (is it a twell checkpoint?)")
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
        out.update(load_file(str(directory / shard)))
    return out


def latest_checkpoint(path: Path) -> Path:
    """``path`` itself if it is a checkpoint, else its newest ``checkpoints/step_*`` (or ``step_*``)."""
    path = Path(path)
    if (path / "trainer_state.safetensors").is_file():
        return path
    steps = sorted(path.glob("checkpoints/step_*")) + sorted(path.glob("step_*"))
    steps = [p for p in steps if (p / "trainer_state.safetensors").is_file()]
    if not steps:
        raise FileNotFoundError(f"no checkpoint in {path} (expected trainer_state.safetensors or checkpoints/step_*)")
    return max(steps, key=lambda p: int(p.name.split("_")[-1]))

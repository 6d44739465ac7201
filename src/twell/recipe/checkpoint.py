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

Under FSDP the weights and the optimizer state are sharded: no rank holds them whole, so each
rank writes its own shards with ``torch.distributed.checkpoint`` (DCP) instead of the two
safetensors files above:

    step_000300/
      dcp/                             DCP folder: __0_0.distcp, __1_0.distcp ... (one file per
                                       rank: its shards of the weights and of the AdamW state,
                                       keys "model.*" and "optim.*") and .metadata (the global
                                       shape of every tensor and where its pieces are)
      twell_checkpoint.json            written last: every file of the checkpoint with its size
      config.json, trainer_state.safetensors, train_config.json, tokenizer   as above

DCP records global shapes, so such a checkpoint loads on any number of ranks, sharded or not
(``--resume`` on another world size; ``twell export`` with no process group). ``twell export``
turns either kind into a ``save_pretrained`` folder.

A checkpoint is written into a hidden temporary folder beside it (``.step_000300.tmp``), its
files flushed to disk, and then renamed into place: a kill or power loss during the write
leaves the previous checkpoints as they were and no ``step_*`` folder that is half written.
:func:`latest_checkpoint` still checks every file (older versions wrote in place; a sharded
checkpoint against its list of files) and falls back to the newest complete checkpoint.

The folder-level functions here import neither torch nor safetensors' torch bindings, so that
``twell train --resume`` can find a checkpoint and read its settings before torch loads.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["save_optimizer", "load_optimizer", "save_tensors_with_meta", "load_tensors_with_meta", "read_meta",
           "load_model_weights", "load_sharded_model_weights", "load_sharded", "is_sharded", "write_manifest", "latest_checkpoint",
           "step_checkpoints", "missing_files", "model_folder", "run_settings", "run_tokenizer", "temporary_folder", "temporary_path", "commit", "prune",
           "remove_partial_writes", "DCP_DIR", "MANIFEST"]

# Every file --resume needs, besides the model weights (model.safetensors, or shards and their index).
REQUIRED = ("config.json", "optimizer.safetensors", "trainer_state.safetensors", "train_config.json")
DCP_DIR = "dcp"  # a sharded checkpoint's DCP folder (weights and optimizer state)
MANIFEST = "twell_checkpoint.json"  # a sharded checkpoint's list of files, written last
# What a sharded checkpoint needs besides the files its manifest lists.
REQUIRED_SHARDED = ("config.json", "trainer_state.safetensors", "train_config.json", MANIFEST)
_STEP = re.compile(r"step_(\d+)")


def save_tensors_with_meta(path: Path, tensors: dict[str, "torch.Tensor"], meta: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(path), metadata={"json": json.dumps(meta)})


def load_tensors_with_meta(path: Path) -> tuple[dict[str, "torch.Tensor"], dict[str, Any]]:
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(path), framework="pt") as fh:
        meta = json.loads(fh.metadata()["json"])
    return load_file(str(path)), meta


def read_meta(path: Path) -> dict[str, Any]:
    """The metadata of a file :func:`save_tensors_with_meta` wrote, without loading its tensors
    (nor torch)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="np") as fh:
        return json.loads(fh.metadata()["json"])


def save_optimizer(path: Path, osd: dict) -> None:
    """Save a full optimizer state dict keyed by parameter names (``get_state_dict`` layout)."""
    import torch

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


def is_sharded(directory: Path) -> bool:
    """Whether ``directory`` is a sharded (DCP) checkpoint."""
    return (Path(directory) / DCP_DIR).is_dir() or (Path(directory) / MANIFEST).is_file()


def load_sharded_model_weights(directory: Path) -> dict[str, "torch.Tensor"]:
    """The full weights of a sharded checkpoint, read in this process alone (no process group):
    DCP assembles each tensor from every rank's shards. The optimizer state is not read."""
    import torch
    import torch.distributed.checkpoint as dcp

    path = Path(directory) / DCP_DIR
    try:
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
    except FileNotFoundError as err:
        raise FileNotFoundError(f"{directory} holds no DCP metadata ({path / '.metadata'})") from err
    weights = {}
    for key, md in metadata.state_dict_metadata.items():
        if key.startswith("model.") and hasattr(md, "size"):  # tensors; "optim.*" left on disk
            weights[key[len("model."):]] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
    if not weights:
        raise ValueError(f"{path} holds no model weights (keys model.*)")
    load_sharded({"model": weights}, directory)
    return weights


def load_sharded(state: dict, directory: Path, process_group=None) -> None:
    """Fill ``state`` (DCP's nested dict: ``{"model": ..., "optim": ...}`` or a part of it) in
    place from the sharded checkpoint ``directory``; each tensor gets the pieces it covers, in
    whatever shards the ranks that saved them wrote. Outside a process group: this process alone."""
    import warnings

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    alone = not (dist.is_available() and dist.is_initialized())
    with warnings.catch_warnings():  # DCP warns whenever it loads in one process, as meant here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(Path(directory) / DCP_DIR), process_group=process_group, no_dist=alone)


def load_model_weights(directory: Path) -> dict[str, "torch.Tensor"]:
    """The weights of a checkpoint: the state dict that save_pretrained wrote in ``directory``
    (one file or shards), or those of a sharded (DCP) checkpoint. Tied weights appear once
    (``lm_head.weight`` is left out when it is the embedding)."""
    from safetensors.torch import load_file

    directory = Path(directory)
    if is_sharded(directory):
        return load_sharded_model_weights(directory)
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


# --- finding checkpoints -----------------------------------------------------------------------


def _readable_safetensors(path: Path) -> bool:
    """Whether ``path`` is a whole safetensors file (its header parses and covers the file)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="np"):  # numpy: reads the header without importing torch
            return True
    except (SafetensorError, OSError):
        return False


def write_manifest(directory: Path) -> None:
    """List every file under ``directory`` with its size in :data:`MANIFEST` (written last: a
    sharded checkpoint is complete when every file it lists is there, whole)."""
    directory = Path(directory)
    files = {str(f.relative_to(directory)): f.stat().st_size for f in sorted(directory.rglob("*"))
             if f.is_file() and f.name != MANIFEST}
    (directory / MANIFEST).write_text(json.dumps({"format": "dcp", "files": files}, indent=1))


def _missing_sharded(directory: Path) -> list[str]:
    missing = [name for name in REQUIRED_SHARDED if not (directory / name).is_file()]
    if MANIFEST in missing:
        return missing
    try:
        files = json.loads((directory / MANIFEST).read_text())["files"]
    except (ValueError, KeyError):
        return [*missing, MANIFEST]
    if f"{DCP_DIR}/.metadata" not in files:
        missing.append(f"{DCP_DIR}/.metadata")
    for name, size in files.items():
        path = directory / name
        if not path.is_file() or path.stat().st_size != size:
            missing.append(name)
    if "trainer_state.safetensors" not in missing and not _readable_safetensors(directory / "trainer_state.safetensors"):
        missing.append("trainer_state.safetensors")
    return sorted(set(missing), key=missing.index)


def missing_files(directory: Path) -> list[str]:
    """What ``directory`` lacks to be a complete checkpoint: names of absent or truncated files
    (empty for a complete one)."""
    directory = Path(directory)
    if is_sharded(directory):
        return _missing_sharded(directory)
    weights = ["model.safetensors"]
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weights = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError):
            return [index.name]
    missing = []
    for name in [*REQUIRED, *weights]:
        path = directory / name
        if not path.is_file() or (name.endswith(".safetensors") and not _readable_safetensors(path)):
            missing.append(name)
    return missing


def _step(folder: Path) -> int:
    return int(_STEP.fullmatch(folder.name).group(1))


def _steps_in(folder: Path) -> list[Path]:
    return [p for p in Path(folder).glob("step_*") if p.is_dir() and _STEP.fullmatch(p.name)]


def step_checkpoints(run: Path) -> list[Path]:
    """The ``step_*`` folders of a run folder (under ``checkpoints/``, or directly in it), oldest first."""
    run = Path(run)
    return sorted(_steps_in(run / "checkpoints") + _steps_in(run), key=_step)


def latest_checkpoint(path: Path, skipped: list | None = None) -> Path:
    """``path`` itself if it is a checkpoint folder, else the newest complete checkpoint of the
    run folder ``path``. Newer incomplete ones (an older version's interrupted write) are passed
    over and appended to ``skipped`` as ``(folder, missing file names)``."""
    path = Path(path)
    if _STEP.fullmatch(path.name) or any((path / name).is_file() for name in (*REQUIRED[1:], MANIFEST)):
        missing = missing_files(path)
        if missing:
            raise FileNotFoundError(f"{path} is an incomplete checkpoint (missing or truncated: {', '.join(missing)})")
        return path
    for candidate in reversed(step_checkpoints(path)):
        missing = missing_files(candidate)
        if not missing:
            return candidate
        if skipped is not None:
            skipped.append((candidate, missing))
    if skipped:
        raise FileNotFoundError(f"no complete checkpoint in {path}: {len(skipped)} incomplete step_* folder(s)")
    raise FileNotFoundError(f"no checkpoint in {path} (expected trainer_state.safetensors or checkpoints/step_*)")


def model_folder(spec: str, command: str) -> Path:
    """The folder a command that reads a trained model (``twell eval``, ``twell bench model
    --model``) takes from ``spec``: a checkpoint, a run folder's newest checkpoint, or a
    ``save_pretrained`` / ``twell export`` folder. Exits with a message naming ``command`` if it
    is none of them."""
    path = Path(spec)
    try:
        return latest_checkpoint(path)
    except FileNotFoundError as err:
        if not (path / "config.json").is_file():
            raise SystemExit(f"{command}: {err}; nor is it a save_pretrained folder (no config.json)")
        return path


def run_settings(path: Path) -> dict:
    """The run's settings saved beside a checkpoint or export (train_config.json), or {}."""
    settings = Path(path) / "train_config.json"
    return json.loads(settings.read_text()) if settings.is_file() else {}


def run_tokenizer(path: Path, default: str) -> str:
    """The tokenizer spec of the model in ``path``: the folder itself when it holds the run's
    tokenizer (twell_tokenizer.json), else ``default``."""
    return str(path) if (Path(path) / "twell_tokenizer.json").is_file() else default


# --- writing checkpoints -----------------------------------------------------------------------


def temporary_path(final: Path) -> Path:
    """The hidden folder beside ``final`` that its checkpoint is written into."""
    final = Path(final)
    return final.parent / f".{final.name}.tmp"


def temporary_folder(final: Path) -> Path:
    """An empty hidden folder beside ``final`` to write the checkpoint into (see :func:`commit`)."""
    tmp = temporary_path(final)
    if tmp.exists():  # left by a write that was killed
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(tmp: Path, final: Path) -> Path:
    """Flush the checkpoint written in ``tmp`` to disk and rename it to ``final`` (one atomic
    rename, so ``final`` is either absent or whole; an existing ``final`` is replaced)."""
    tmp, final = Path(tmp), Path(final)
    for f in tmp.rglob("*"):
        if f.is_file():
            _fsync(f)
    _fsync(tmp)
    if final.exists():  # rename cannot replace a non-empty folder: move the old one aside first
        old = final.parent / f".{final.name}.old"
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)
    _fsync(final.parent)  # the rename itself survives a power loss
    return final


def remove_partial_writes(folder: Path) -> None:
    """Delete the temporary folders that killed writes left in ``folder``."""
    for p in Path(folder).glob(".step_*.tmp"):
        shutil.rmtree(p, ignore_errors=True)


def prune(folder: Path, keep: int, current_step: int) -> list[Path]:
    """Delete the step checkpoints in ``folder`` older than the newest ``keep`` up to
    ``current_step`` (the one just written counts); returns what was deleted.

    Checkpoints of later steps (left by another run resumed from an earlier step into the same
    folder) are not touched, nor is anything when ``keep`` is 0."""
    if keep < 1:
        return []
    ours = sorted((p for p in _steps_in(folder) if _step(p) <= current_step), key=_step)
    doomed = ours[:-keep]
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed

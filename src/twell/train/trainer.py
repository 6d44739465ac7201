"""The training loop: cross entropy + lambda * L1 on a Llama-style LM with ReLU-gated MLPs.

    loss = CE + lambda_t * l1_loss(model)
    l1_loss = mean over layers of (mean over tokens of SUM over the f hidden units of |h|)

The sum over units is the convention of the paper's published code (its equation writes a
mean); with it lambda = 2e-5 is the paper's setting. ``lambda_t`` ramps linearly from 0 to
lambda over ``l1_warmup`` steps (0: constant).

Batches: ``batch_size`` sequences per micro-batch per process; ``grad_accum`` micro-batches
per optimizer step; so a step sees ``batch_size x grad_accum x world_size`` sequences of
``seq_len`` tokens. Sample indices are laid out so that the step's set of sequences does not
depend on how it is split over processes and micro-batches: 2 processes with batch 4 see the
same 8 sequences as 1 process with batch 8.

Distributed: run under torchrun; DDP by default, FSDP2 (``fully_shard`` per decoder layer)
with ``fsdp=True``. Statistics and validation loss are reduced over all ranks.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..nn import l1_loss, sparse_modules
from . import checkpoint as ckpt
from .data import PackedSequences, Prefetcher, corpus_tokenizer, load_corpus
from .model import PRESETS, build_model, count_params, make_config
from .stats import DeadUnits, IntervalStats

__all__ = ["TrainConfig", "Trainer", "train", "evaluate_lm", "shutdown_distributed"]

# Learning rates that trained well here at each scale (the paper's 1.5B used 3e-4).
DEFAULT_LR = {"tiny": 3e-3, "small": 1.5e-3}


@dataclass
class TrainConfig:
    """Everything a run needs; the CLI fills it. None means "the preset's or a derived default"."""

    preset: str = "tiny"
    hidden_size: Optional[int] = None
    intermediate_size: Optional[int] = None
    num_layers: Optional[int] = None
    num_heads: Optional[int] = None
    data: list = field(default_factory=lambda: ["stdlib"])
    tokenizer: str = "bytes"
    text_field: str = "text"
    val_fraction: float = 0.02
    max_docs: Optional[int] = None
    seq_len: Optional[int] = None
    batch_size: int = 16
    grad_accum: int = 1
    steps: int = 1000
    lr: Optional[float] = None
    min_lr_ratio: float = 0.1
    warmup: Optional[int] = None
    weight_decay: float = 0.1  # on every matrix, the tied embedding/output matrix included; not on norms
    betas: tuple = (0.9, 0.95)
    grad_clip: float = 1.0
    l1: float = 2e-5
    l1_warmup: int = 0
    dead_window: int = 25
    reinit: bool = False
    reinit_keep: float = 0.9
    reinit_std: float = 0.02
    log_every: int = 10
    eval_every: Optional[int] = None
    val_batches: int = 8
    save_every: Optional[int] = None
    out: str = "runs/twell"
    seed: int = 0
    device: Optional[str] = None
    precision: Optional[str] = None
    grad_checkpointing: bool = False
    fsdp: bool = False
    progress: bool = True
    plot: bool = True

    def resolved(self) -> "TrainConfig":
        """A copy with every None default filled in, after checking the values."""
        c = TrainConfig(**asdict(self))
        if c.preset not in PRESETS:
            raise ValueError(f"unknown preset {c.preset!r}; choose one of {', '.join(PRESETS)}")
        # Counts and sizes first: the defaults below divide by some of them.
        for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "seq_len", "max_docs",
                     "steps", "batch_size", "grad_accum", "log_every", "eval_every", "val_batches", "save_every",
                     "dead_window"):
            value = getattr(c, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} (--{name.replace('_', '-')}) must be >= 1, got {value}")
        if c.warmup is not None and c.warmup < 0:
            raise ValueError(f"warmup must be >= 0 steps, got {c.warmup}")
        if c.device is not None and c.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {c.device!r} asked for, but torch sees no CUDA GPU; use --device cpu")
        c.seq_len = c.seq_len or PRESETS[c.preset].context
        c.lr = c.lr if c.lr is not None else DEFAULT_LR.get(c.preset, 3e-4)
        c.warmup = c.warmup if c.warmup is not None else min(100, max(1, c.steps // 10))
        # about 6 validation passes, on log steps
        c.eval_every = c.eval_every if c.eval_every is not None else max(1, c.steps // 6 // c.log_every) * c.log_every
        c.device = c.device or ("cuda" if torch.cuda.is_available() else "cpu")
        c.precision = c.precision or ("bf16" if c.device.startswith("cuda") else "fp32")
        c.betas = tuple(c.betas)
        checks = [
            (c.seq_len >= 2, f"seq_len must be >= 2, got {c.seq_len}"),
            (c.lr > 0, f"lr must be > 0, got {c.lr}"),
            (c.l1 >= 0, f"the L1 coefficient must be >= 0, got {c.l1}"),
            (c.l1_warmup >= 0, f"l1 warm-up must be >= 0 steps, got {c.l1_warmup}"),
            (0 <= c.min_lr_ratio <= 1, f"min_lr_ratio must be in [0, 1], got {c.min_lr_ratio}"),
            (c.grad_clip >= 0, f"grad clip must be >= 0 (0: off), got {c.grad_clip}"),
            (0 < c.reinit_keep <= 1, f"reinit keep must be in (0, 1], got {c.reinit_keep}"),
            (c.precision in ("bf16", "fp32"), f"precision must be bf16 or fp32, got {c.precision!r}"),
            (not (c.precision == "bf16" and c.device == "cpu"), "bf16 autocast is for GPUs; use fp32 on the CPU"),
            (not (c.fsdp and c.reinit), "--reinit with --fsdp is not supported (the gate rows are sharded)"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)
        return c


def _lr_lambda(warmup: int, total: int, min_ratio: float):
    """Linear warm-up to 1 over ``warmup`` steps, then cosine down to ``min_ratio`` at ``total``."""

    def f(i: int) -> float:  # i = optimizer steps taken so far
        if i < warmup:
            return (i + 1) / warmup
        progress = min(1.0, (i - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


class Trainer:
    """One training run. ``Trainer(cfg).fit()`` trains; the pieces are public for tests."""

    def __init__(self, cfg: TrainConfig, resume: Optional[str] = None, streams=None):
        """``streams``: optional ``(train, validation)`` token arrays already built from
        ``cfg.data`` (several runs over one corpus tokenize it once)."""
        self.cfg = cfg = cfg.resolved()
        self._setup_distributed()
        self.out = Path(cfg.out)
        # A folder from `twell data prepare` brings its own tokenizer and is read from disk.
        self.tokenizer = corpus_tokenizer(cfg.data, cfg.tokenizer)
        self.train_data, self.val_data = load_corpus(cfg.data, self.tokenizer, cfg.seq_len, cfg.seed, cfg.val_fraction,
                                                     cfg.text_field, cfg.max_docs, streams)
        # This rank's micro-batches, built ahead in a background thread (the data position
        # stays samples_seen: the prefetcher restarts wherever micro_batch asks first).
        self.loader = Prefetcher(self.train_data, cfg.batch_size, cfg.grad_accum, self.rank, self.world,
                                 pin=self.device.type == "cuda")

        shape = dict(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                     num_layers=cfg.num_layers, num_heads=cfg.num_heads, context=max(cfg.seq_len, PRESETS[cfg.preset].context))
        self.config = make_config(cfg.preset, self.tokenizer.vocab_size, **shape)
        self.model = build_model(self.config, seed=cfg.seed).to(self.device)
        if cfg.grad_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.modules = sparse_modules(self.model)
        self.n_params = count_params(self.model)
        self.wrapped = self._wrap(self.model)

        decay = [p for n, p in self.model.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in self.model.named_parameters() if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr, betas=cfg.betas, fused=self.device.type == "cuda",
        )
        self.lr_factor = _lr_lambda(cfg.warmup, cfg.steps, cfg.min_lr_ratio)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self.lr_factor)
        L, f = len(self.modules), self.config.intermediate_size
        self.interval = IntervalStats(L, self.device)
        self.dead = DeadUnits(L, f, cfg.dead_window, self.device, reinit=cfg.reinit,
                              keep=cfg.reinit_keep, std=cfg.reinit_std, seed=cfg.seed)
        self.step = 0
        self.samples_seen = 0  # the data position: training samples consumed by all ranks
        # Sums of this rank's step losses since the last log row (saved in checkpoints, so that a
        # run resumed between two log steps logs what an uninterrupted run logs).
        self.ce_acc = torch.zeros((), device=self.device)
        self.l1_acc = torch.zeros((), device=self.device)
        self.n_acc = 0
        self.history: list[dict] = []
        if resume:
            self.load_checkpoint(ckpt.latest_checkpoint(Path(resume)))

    # --- setup ---------------------------------------------------------------------------------

    def _setup_distributed(self) -> None:
        cfg = self.cfg
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if self.world > 1 and not dist.is_initialized():
            dist.init_process_group("nccl" if cfg.device.startswith("cuda") else "gloo")
        if cfg.device.startswith("cuda"):
            if not torch.cuda.is_available():
                raise ValueError(f"device {cfg.device!r} asked for, but torch sees no CUDA GPU; use --device cpu")
            self.device = torch.device("cuda", local if self.world > 1 else torch.device(cfg.device).index or 0)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device(cfg.device)
        if cfg.fsdp and self.world == 1:
            raise ValueError("--fsdp needs several processes: torchrun --nproc_per_node N -m twell train --fsdp ...")
        self.main = self.rank == 0

    def _wrap(self, model):
        if self.world == 1:
            return model
        if self.cfg.fsdp:
            from torch.distributed.fsdp import fully_shard

            for layer in model.model.layers:
                fully_shard(layer)
            fully_shard(model)
            return model
        from torch.nn.parallel import DistributedDataParallel as DDP

        # No buffer broadcast before every forward: the buffers are RoPE's inv_freq (the same on
        # every rank) and the sparse MLPs' fire_counts/tokens_seen, per-rank tallies the trainer
        # does not read (its statistics come from each forward's unit counts, summed over ranks
        # in stats.py). torch 2.13 renames broadcast_buffers to forward_sync_buffers.
        import inspect

        flag = ("forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters
                   else "broadcast_buffers")
        return DDP(model, device_ids=[self.device.index] if self.device.type == "cuda" else None, **{flag: False})

    def _autocast(self):
        if self.cfg.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # --- one step ------------------------------------------------------------------------------

    @property
    def global_batch(self) -> int:
        return self.cfg.batch_size * self.cfg.grad_accum * self.world

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.cfg.seq_len

    def l1_coef(self, step: int) -> float:
        """lambda at optimizer step ``step`` (counting from 1)."""
        w = self.cfg.l1_warmup
        return self.cfg.l1 * (min(1.0, step / w) if w else 1.0)

    def micro_batch(self, micro: int) -> torch.Tensor:
        """This rank's ``micro``-th micro-batch of the next step, ``[batch_size, seq_len + 1]``."""
        B = self.cfg.batch_size
        first = self.samples_seen + (micro * self.world + self.rank) * B
        return self.loader.batch(first)

    def forward_backward(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Accumulate the gradients of the next step (not applied). Returns the step's mean
        ``(ce, l1)`` on this rank as device tensors (no sync)."""
        cfg, lam = self.cfg, self.l1_coef(self.step + 1)
        self.wrapped.train()
        ce_sum = torch.zeros((), device=self.device)
        l1_sum = torch.zeros((), device=self.device)
        for micro in range(cfg.grad_accum):
            batch = self.micro_batch(micro)
            if self.device.type == "cuda":
                # From pageable memory the copy would wait for the GPU to drain: pin it.
                batch = batch.pin_memory()
            batch = batch.to(self.device, non_blocking=True)
            x, y = batch[:, :-1], batch[:, 1:]
            last = micro == cfg.grad_accum - 1
            # Gradients are reduced over ranks on the last micro-batch only: DDP's no_sync, FSDP2's
            # set_requires_gradient_sync (no reduce-scatter; unsharded gradients accumulate).
            sync = contextlib.nullcontext()
            if self.world > 1 and cfg.grad_accum > 1:
                if not cfg.fsdp:
                    sync = contextlib.nullcontext() if last else self.wrapped.no_sync()
                elif hasattr(self.wrapped, "set_requires_gradient_sync"):
                    self.wrapped.set_requires_gradient_sync(last)
            with sync:
                with self._autocast():
                    logits = self.wrapped(input_ids=x, use_cache=False).logits
                ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
                l1 = l1_loss(self.modules).to(ce.device)
                self.interval.observe(self.modules)
                self.dead.observe(self.modules)
                ((ce + lam * l1) / cfg.grad_accum).backward()
            ce_sum += ce.detach()
            l1_sum += l1.detach().float()
        return ce_sum / cfg.grad_accum, l1_sum / cfg.grad_accum

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step: gradients, clipping, AdamW, schedule, dead units (Eq. 6)."""
        ce, l1 = self.forward_backward()
        if self.cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.samples_seen += self.global_batch
        self.dead.end_step(self.modules, self.step)
        return ce, l1

    # --- validation ----------------------------------------------------------------------------

    def evaluate(self, batches: Optional[int] = None) -> dict:
        """Validation loss and sparsity of the current model: see :func:`evaluate_lm`."""
        out = evaluate_lm(self.wrapped, self.val_data, self.cfg.batch_size, batches or self.cfg.val_batches,
                          self.device, self.cfg.precision, self.world, self.rank)
        self.wrapped.train()
        return out

    # --- checkpoints ---------------------------------------------------------------------------

    def _full_state(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        opts = StateDictOptions(full_state_dict=True, cpu_offload=self.world > 1)
        return get_state_dict(self.model, self.optimizer, options=opts)

    def save_checkpoint(self, directory: Optional[Path] = None) -> Path:
        """Write a checkpoint (see :mod:`twell.train.checkpoint`); every rank must call it."""
        directory = Path(directory or self.out / "checkpoints" / f"step_{self.step:06d}")
        msd, osd = self._full_state()
        rng = {f"rng_cpu_rank{self.rank}": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng[f"rng_cuda_rank{self.rank}"] = torch.cuda.get_rng_state(self.device)
        rngs = [rng] if self.world == 1 else [None] * self.world
        if self.world > 1:
            dist.all_gather_object(rngs, rng)
        # What accumulates between log steps, summed over ranks (collectives: every rank).
        dead, interval = self.dead.state_dict(), self.interval.state_dict()
        acc = torch.stack([self.ce_acc, self.l1_acc])
        if self.world > 1:
            dist.all_reduce(acc)
        if self.main:
            directory.mkdir(parents=True, exist_ok=True)
            unwrapped = self.model.module if hasattr(self.model, "module") else self.model
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()  # its "Writing model shards" bar would break ours
            unwrapped.save_pretrained(directory, state_dict=msd)
            ckpt.save_optimizer(directory / "optimizer.safetensors", osd)
            tensors = {k: v for r in rngs for k, v in r.items()}
            tensors.update({f"dead/{k}": dead[k] for k in ("counts", "dead", "reinit_count")})
            tensors.update({f"interval/{k}": interval[k] for k in ("active_sum", "l1_sum", "active_max")})
            tensors["log/ce_l1_sum"] = acc
            meta = {"step": self.step, "samples_seen": self.samples_seen, "world_size": self.world,
                    "scheduler": self.scheduler.state_dict(),
                    "dead": {k: dead[k] for k in ("steps_in_window", "windows_done", "dead_frac")},
                    "interval_tokens": interval["tokens"], "log_steps": self.n_acc}
            ckpt.save_tensors_with_meta(directory / "trainer_state.safetensors", tensors, meta)
            (directory / "train_config.json").write_text(json.dumps(asdict(self.cfg), indent=1))
            self.tokenizer.save(directory)
        if self.world > 1:
            dist.barrier()
        return directory

    def load_checkpoint(self, directory: Path) -> None:
        """Restore weights, optimizer, scheduler, RNG, data position and dead-unit state."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        msd = ckpt.load_model_weights(directory)
        if self.config.tie_word_embeddings:
            msd.setdefault("lm_head.weight", msd["model.embed_tokens.weight"])
        osd = ckpt.load_optimizer(directory / "optimizer.safetensors")
        set_state_dict(self.model, self.optimizer, model_state_dict=msd, optim_state_dict=osd,
                       options=StateDictOptions(full_state_dict=True))
        tensors, meta = ckpt.load_tensors_with_meta(directory / "trainer_state.safetensors")
        self.step, self.samples_seen = int(meta["step"]), int(meta["samples_seen"])
        self.scheduler.load_state_dict(meta["scheduler"])
        self._apply_optimizer_settings()
        self.dead.load_state_dict({**{k: tensors[f"dead/{k}"] for k in ("counts", "dead", "reinit_count")}, **meta["dead"]},
                                  primary=self.main)
        # The sums since the last log step (summed over ranks when saved): on rank 0 only, so
        # that the next log step's reduction over ranks counts them once.
        if "log/ce_l1_sum" in tensors:  # absent from checkpoints of older versions
            self.interval.load_state_dict({**{k: tensors[f"interval/{k}"] for k in ("active_sum", "l1_sum", "active_max")},
                                           "tokens": meta["interval_tokens"]}, primary=self.main)
            acc = tensors["log/ce_l1_sum"].to(self.device) if self.main else torch.zeros(2, device=self.device)
            self.ce_acc.copy_(acc[0])
            self.l1_acc.copy_(acc[1])
            self.n_acc = int(meta["log_steps"])
        if f"rng_cpu_rank{self.rank}" in tensors:  # a run resumed on other ranks keeps its own RNG
            torch.set_rng_state(tensors[f"rng_cpu_rank{self.rank}"])
            if self.device.type == "cuda" and f"rng_cuda_rank{self.rank}" in tensors:
                torch.cuda.set_rng_state(tensors[f"rng_cuda_rank{self.rank}"], self.device)
        if self.step >= self.cfg.steps:
            raise ValueError(f"the checkpoint is at step {self.step}, not before --steps {self.cfg.steps}: nothing to do")

    def _apply_optimizer_settings(self) -> None:
        """After loading a checkpoint: the run's ``lr`` and ``weight_decay`` (the checkpoint's own
        unless given again, e.g. ``--resume ... --lr``) replace those in the loaded optimizer and
        scheduler state, which would otherwise keep the checkpoint's. The schedule's shape
        (warm-up, steps, floor) always comes from the run's settings."""
        cfg = self.cfg
        self.scheduler.base_lrs = [cfg.lr] * len(self.optimizer.param_groups)
        lr = cfg.lr * self.lr_factor(self.scheduler.last_epoch)
        for group, wd in zip(self.optimizer.param_groups, (cfg.weight_decay, 0.0)):
            group["initial_lr"], group["lr"], group["weight_decay"] = cfg.lr, lr, wd
        self.scheduler._last_lr = [lr] * len(self.optimizer.param_groups)

    # --- the run -------------------------------------------------------------------------------

    def fit(self) -> dict:
        """Train to ``cfg.steps``, logging, validating and checkpointing; returns the summary."""
        from .report import RunLogger

        cfg = self.cfg
        logger = RunLogger(self, enabled=self.main)
        logger.start()
        t_last, tokens_last = time.perf_counter(), 0
        final = None
        while self.step < cfg.steps:
            ce, l1 = self.train_step()
            self.ce_acc += ce
            self.l1_acc += l1
            self.n_acc += 1
            tokens_last += self.tokens_per_step
            logger.tick()
            last = self.step == cfg.steps
            evaluate = self.step % cfg.eval_every == 0 or last
            if self.step % cfg.log_every == 0 or evaluate:
                loss = torch.stack([self.ce_acc, self.l1_acc]) / self.n_acc
                if self.world > 1:
                    dist.all_reduce(loss)
                    loss /= self.world
                ce_v, l1_v = loss.tolist()  # the one sync of a log step, with stats.reduce
                now = time.perf_counter()
                row = {"step": self.step, "tokens": self.samples_seen * cfg.seq_len,
                       "lr": self.scheduler.get_last_lr()[0], "lambda": self.l1_coef(self.step),
                       "ce": ce_v, "l1": l1_v, "loss": ce_v + self.l1_coef(self.step) * l1_v,
                       "tokens_per_s": tokens_last / (now - t_last), **self._layer_row(self.interval.reduce())}
                self.ce_acc.zero_(), self.l1_acc.zero_()
                self.n_acc, t_last, tokens_last = 0, now, 0
                if evaluate:
                    ev = self.evaluate()
                    row["val_loss"] = ev["val_loss"]
                    final = ev if last else None
                    t_last = time.perf_counter()  # validation time is not training throughput
                self.history.append(row)
                logger.log(row)
            if (cfg.save_every and self.step % cfg.save_every == 0) or last:
                self.save_checkpoint()
                t_last = time.perf_counter()
        if final is None:  # only when resumed at cfg.steps, which __init__ refuses
            final = self.evaluate()
        return logger.finish(final)

    def _layer_row(self, s: dict) -> dict:
        L = len(s["active_mean"])
        row = {"active_mean": sum(s["active_mean"]) / L, "active_max": max(s["active_max"]),
               "dead_frac": (sum(self.dead.dead_frac) / L) if self.dead.dead_frac else float("nan")}
        for i in range(L):
            row[f"active_mean_L{i}"] = s["active_mean"][i]
            row[f"active_max_L{i}"] = s["active_max"][i]
            row[f"l1_L{i}"] = s["l1"][i]
            row[f"dead_frac_L{i}"] = self.dead.dead_frac[i] if self.dead.dead_frac else float("nan")
        return row


@torch.no_grad()
def evaluate_lm(model, val_data: PackedSequences, batch_size: int, batches: int, device, precision: str = "fp32",
                world: int = 1, rank: int = 0) -> dict:
    """Validation loss and sparsity of a sparse LM (in eval mode; left in eval mode).

    Reads the first ``batches x batch_size x world`` windows of the validation stream, always
    the same ones, rank r taking every world-th block of ``batch_size``. Returns ``val_loss``
    (mean cross entropy per token, nats), ``ppl``, ``tokens``, and per layer ``active_mean``,
    ``active_max`` and ``dead_frac`` (units that fired for none of these tokens), all reduced
    over ranks.
    """
    modules = sparse_modules(model)
    if not modules:
        raise ValueError("the model has no twell sparse MLPs: call twell.sparsify(model) first")
    model.eval()
    device = torch.device(device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    stats = IntervalStats(len(modules), device)
    fired = torch.zeros(len(modules), modules[0].intermediate_size, dtype=torch.int64, device=device)
    for i in range(batches):
        batch = val_data.eval_batch((i * world + rank) * batch_size, batch_size).to(device)
        with autocast:
            logits = model(input_ids=batch[:, :-1], use_cache=False).logits
        loss_sum += F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum").double()
        stats.observe(modules)
        fired += torch.stack([m.stats.unit_counts for m in modules])
    if world > 1:
        dist.all_reduce(loss_sum)
        dist.all_reduce(fired)
    s = stats.reduce()
    val_loss = float(loss_sum) / s["tokens"]
    return {"val_loss": val_loss, "ppl": math.exp(min(val_loss, 50.0)), "tokens": s["tokens"],
            "active_mean": s["active_mean"], "active_max": s["active_max"],
            "dead_frac": (fired == 0).float().mean(dim=1).tolist()}


def train(cfg: TrainConfig, resume: Optional[str] = None) -> dict:
    """Train a sparse LM with ``cfg``; returns the summary dict (see ``twell train --help``)."""
    trainer = Trainer(cfg, resume=resume)
    try:
        return trainer.fit()
    finally:
        if trainer.world > 1:
            del trainer
            shutdown_distributed()


def shutdown_distributed() -> None:
    """Leave the process group without the gloo shutdown deadlock seen here (torch 2.13).

    Gloo's worker thread frees a finished collective, which needs the GIL, a moment after the
    caller already saw it complete; if the process group is destroyed in that moment (from a
    Python destructor, GIL held), the destructor joins that thread and both wait forever.
    So: a barrier, so that every rank is done, then let the worker threads drain before
    destroying the group.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    dist.barrier()
    gc.collect()  # a DDP wrapper still alive would drop the group's last reference later
    time.sleep(0.2)  # releases the GIL: gloo's threads finish freeing their work
    dist.destroy_process_group()

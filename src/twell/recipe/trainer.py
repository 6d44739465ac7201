"""The training loop: cross entropy + lambda * L1 on a Llama-style LM with ReLU-gated MLPs.

    loss = CE + lambda_t * l1_loss(model)
    l1_loss = mean over layers of (mean over tokens of SUM over the f hidden units of |h|)

The sum over units is the convention of the paper's published code (its equation writes a
mean); with it lambda = 2e-5 is the paper's setting. ``lambda_t`` ramps linearly from 0 to
lambda over ``l1_warmup`` steps (0: constant).

The model is a preset built from seeded random weights, or with ``init_from`` a Hugging Face
model folder's, its MLPs converted to ReLU (:mod:`twell.recipe.init_from`). With
``activation="silu"`` it is a dense baseline: the preset with Hugging Face's own MLPs, trained
on cross entropy alone (lambda 0), with no sparsity statistics or dead-unit tracking (they
read twell's modules, and the model has none).

Batches: ``batch_size`` sequences per micro-batch per process; ``grad_accum`` micro-batches
per optimizer step; so a step sees ``batch_size x grad_accum x world_size`` sequences of
``seq_len`` tokens. Sample indices are laid out so that the step's set of sequences does not
depend on how it is split over processes and micro-batches: 2 processes with batch 4 see the
same 8 sequences as 1 process with batch 8.

Distributed: run under torchrun; DDP by default, FSDP2 (``fully_shard`` per decoder layer)
with ``fsdp=True``. Statistics and validation loss are reduced over all ranks. Under FSDP the
model is built on the meta device, sharded, and each rank materialises only its shards, with
the values of the seeded CPU build (:mod:`twell.recipe.meta_init`); checkpoints are sharded
(``torch.distributed.checkpoint``, written in the background where torch can) and load on any
number of ranks.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import shlex
import signal
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..nn import l1_loss, sparse_modules
from . import checkpoint as ckpt
from .config import TrainConfig
from .corpus import corpus_tokenizer, load_corpus
from .data import PackedSequences, Prefetcher, load_tokenizer
from .init_from import check_same_tokenizer, check_vocab, load_converted
from .model import PRESETS, build_model, count_params, make_config
from .shards import prepared_corpus
from .stats import DeadUnits, IntervalStats

__all__ = ["TrainConfig", "Trainer", "StepResult", "RunStopped", "train", "evaluate_lm", "shutdown_distributed"]


class RunStopped(RuntimeError):
    """The run stopped before its last step with its state saved (a signal, or too many
    non-finite steps in a row). ``str(err)`` is the one line to show the user: why, where the
    checkpoint is and the command that resumes it; ``exit_code`` is the process's exit status."""

    def __init__(self, message: str, exit_code: int, checkpoint: Path):
        super().__init__(message)
        self.exit_code, self.checkpoint = exit_code, checkpoint


@dataclass
class _PendingSave:
    """A sharded checkpoint written into ``tmp``, to be renamed ``final`` once ``future`` (None:
    written already) is done; ``managed``: in the run's checkpoints/ folder (prune after)."""

    future: object
    tmp: Path
    final: Path
    managed: bool
    step: int


@dataclass
class StepResult:
    """What :meth:`Trainer.train_step` did. ``ce``, ``l1``: the step's mean losses on this rank;
    ``grad_norm``: the total gradient norm before clipping (device tensors). The flags are host
    values, the same on every rank: ``applied`` (False: skipped, non-finite), ``stop`` (a signal
    asked the run to stop), ``save`` (the wall-time save interval has passed)."""

    ce: torch.Tensor
    l1: torch.Tensor
    grad_norm: torch.Tensor
    applied: bool
    stop: bool = False
    save: bool = False


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
        self.cfg = cfg = cfg.resolved(resuming=resume is not None)
        self._setup_distributed()
        self.out = Path(cfg.out)
        checkpoint = self._find_checkpoint(resume) if resume else None
        self.tokenizer = self._load_tokenizer(checkpoint)
        # the model's config before the corpus: a tokenizer that does not fit it is reported before any work
        self.config = self._model_config(checkpoint)
        self.train_data, self.val_data = load_corpus(cfg.data, self.tokenizer, cfg.seq_len, cfg.seed, cfg.val_fraction,
                                                     cfg.text_field, cfg.max_docs, streams)
        # This rank's micro-batches, built ahead in a background thread (the data position
        # stays samples_seen: the prefetcher restarts wherever micro_batch asks first).
        self.loader = Prefetcher(self.train_data, cfg.batch_size, cfg.grad_accum, self.rank, self.world,
                                 pin=self.device.type == "cuda")

        recipe = None
        # a dense baseline: Hugging Face's MLPs, no twell module (no L1 term, no statistics)
        self.dense = cfg.activation != "relu"
        self.converted_from = None  # with init_from: the folder's MLP activation, before the conversion to ReLU
        if self.sharded:
            # No rank builds the whole model: it is built on the meta device (no memory) and
            # _wrap shards it, then materialises each rank's shards with the values that
            # build_model gives on the CPU (the recipe: that build, recorded without data).
            from .meta_init import record_init

            recipe = record_init(lambda: build_model(self.config, seed=cfg.seed, dense=self.dense))
            with torch.device("meta"):
                self.model = build_model(self.config, seed=cfg.seed, dense=self.dense)
        elif cfg.init_from is not None and checkpoint is None:
            # the folder's weights, its MLPs converted to ReLU (a resumed run's come from its checkpoint)
            self.converted_from = getattr(self.config, "hidden_act", None)
            self.model = load_converted(cfg.init_from, seed=cfg.seed).to(self.device)
            self.config = self.model.config
        else:
            self.model = build_model(self.config, seed=cfg.seed, dense=self.dense).to(self.device)
        if cfg.grad_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.modules = sparse_modules(self.model)
        for m in self.modules:
            m.train_kernels = cfg.kernels
        self.n_params = count_params(self.model)
        self.wrapped = self._wrap(self.model, recipe)
        if cfg.compile:
            # Each decoder layer on its own (regional compilation, as torchtitan does): the layers
            # share their code and shapes, so one graph serves them all, compiled in seconds where
            # the whole model would take minutes. In place, after FSDP's wrapping (dynamo leaves
            # its hooks to run eagerly). Each MLP's choice of sparse or dense kernels stays per
            # layer and per call, made inside twell's custom op (twell.training.ops).
            if cfg.grad_checkpointing:
                # transformers takes the checkpoint inside each layer's forward, so dynamo traces
                # it, and would break the graph (running the whole layer eagerly) at the side
                # effects in it that a recomputation would replay: the MLPs' l1, statistics and
                # fire counts, and transformers' own kernel-context variable. Not replayed here;
                # eager checkpointing does not replay the MLPs' either (its recomputation stops
                # once their op has saved its tensors).
                import torch._dynamo as dynamo

                option = "skip_fwd_side_effects_in_bwd_under_checkpoint"
                if hasattr(dynamo.config, option):  # (an older torch has no such option: the layers break there)
                    setattr(dynamo.config, option, True)
            for layer in self.model.model.layers:
                layer.compile()

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
        # Per-layer multipliers of lambda, adapted toward cfg.l1_target (all 1 without a target).
        self.l1_scale = [1.0] * L
        self._l1_scale_t = torch.ones(L, device=self.device)
        self.dead_holds = [0] * L  # log rows at which each layer's lambda was held (cfg.dead_limit)
        self.dead = DeadUnits(L, f, cfg.dead_window, self.device, reinit=cfg.reinit,
                              keep=cfg.reinit_keep, std=cfg.reinit_std, seed=cfg.seed)
        self.step = 0
        self.samples_seen = 0  # the data position: training samples consumed by all ranks
        # Sums of this rank's step losses and gradient norms since the last log row (saved in
        # checkpoints, so that a run resumed between two log steps logs what an uninterrupted run logs).
        self.ce_acc = torch.zeros((), device=self.device)
        self.l1_acc = torch.zeros((), device=self.device)
        self.gn_acc = torch.zeros((), device=self.device)
        self.n_acc = 0
        self.skipped = 0  # steps skipped for a non-finite loss or gradient, over the whole run
        self.bad_streak = 0  # of them, the last ones in a row
        self.history: list[dict] = []
        # Throughput of this process's run: tokens of its steps over the time spent in them
        # (validation and checkpoints excluded); the progress bar and the summary show it.
        self.train_seconds, self.tokens_since_start = 0.0, 0
        self.stop_signal: Optional[int] = None  # set by SIGINT/SIGTERM during fit
        # (step, samples_seen, folder) of the last checkpoint written or loaded: skipped steps
        # leave the step where it was but move the data position, so both name a state.
        self._saved: Optional[tuple[int, int, Path]] = None
        self._pending: Optional[_PendingSave] = None  # a sharded checkpoint still being written in the background
        self._last_save_time = time.monotonic()
        if checkpoint is not None:
            self.load_checkpoint(checkpoint)

    # --- setup ---------------------------------------------------------------------------------

    def _find_checkpoint(self, resume: str) -> Path:
        """The checkpoint ``--resume`` names (a run folder: its newest complete one)."""
        passed_over: list = []
        path = ckpt.latest_checkpoint(Path(resume), passed_over)
        for folder, missing in passed_over if self.main else []:
            tqdm.write(f"note: {folder} is incomplete (missing or truncated: {', '.join(missing)}); "
                       f"resuming from {path.name}")
        return path

    def _load_tokenizer(self, checkpoint: Optional[Path]):
        """The run's tokenizer. From scratch: a prepared corpus's own, else ``cfg.tokenizer``.
        With ``init_from``: the model's own, from the folder or, resumed, from the checkpoint (the
        same one; the folder need not be there any more); a prepared corpus must have been
        tokenized with it."""
        cfg = self.cfg
        if cfg.init_from is None:
            # A folder from `twell data prepare` brings its own tokenizer and is read from disk.
            return corpus_tokenizer(cfg.data, cfg.tokenizer)
        model_tokenizer = load_tokenizer(str(checkpoint) if checkpoint is not None else cfg.init_from)
        corpus = prepared_corpus(cfg.data)
        if corpus is None:
            return model_tokenizer
        tokenizer = corpus.tokenizer()
        check_same_tokenizer(tokenizer, model_tokenizer, str(corpus.folder), cfg.init_from)
        return tokenizer

    def _model_config(self, checkpoint: Optional[Path]):
        """The model's config: the preset's, with the size options, the run's activation and the
        tokenizer's vocabulary; with ``init_from`` the folder's (its activation converted when the
        weights load), or on resume the checkpoint's own (already ReLU). A checkpoint resumed
        must have the run's activation: its weights were trained with it."""
        cfg = self.cfg
        if cfg.init_from is None:
            if checkpoint is not None:
                saved = json.loads((checkpoint / "config.json").read_text()).get("hidden_act")
                if saved != cfg.activation:
                    raise ValueError(f"{checkpoint}: its MLPs use {saved}, the run's settings say --activation "
                                     f"{cfg.activation}; resume it with --activation {saved}")
            shape = dict(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size, num_layers=cfg.num_layers,
                         num_heads=cfg.num_heads, context=max(cfg.seq_len, PRESETS[cfg.preset].context))
            return make_config(cfg.preset, self.tokenizer.vocab_size, eos_id=self.tokenizer.eos_id,
                               hidden_act=cfg.activation, **shape)
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(checkpoint if checkpoint is not None else cfg.init_from)
        check_vocab(self.tokenizer, config.vocab_size, cfg.init_from)
        return config

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
        self.sharded = cfg.fsdp  # parameters, optimizer state and checkpoints sharded over ranks
        # Sharded checkpoints are written in a background thread where torch has dcp.async_save.
        # Its collectives run on a gloo group of their own: on the training group they would
        # interleave with the training's own collectives (and async_save needs a CPU backend).
        self._async_save, self._save_group = False, None
        if self.sharded:
            import torch.distributed.checkpoint as dcp

            self._async_save = hasattr(dcp, "async_save")
            self._save_group = dist.new_group(backend="gloo") if self._async_save else None

    def _wrap(self, model, recipe=None):
        if self.world == 1:
            return model
        if self.cfg.fsdp:
            from torch.distributed.fsdp import fully_shard

            from .meta_init import materialize

            for layer in model.model.layers:
                fully_shard(layer)
            fully_shard(model)
            # Storage for this rank's shards only, then the seeded values, one tensor at a time.
            materialize(model, recipe, self.device)
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

    def l1_penalty(self, l1_mean: torch.Tensor) -> torch.Tensor:
        """The L1 term that lambda multiplies: ``l1_mean`` (the mean over layers) with one lambda,
        or, with ``cfg.l1_target``, the mean over layers of each layer's multiplier times its l1."""
        if self.cfg.l1_target is None:
            return l1_mean
        terms = torch.stack([m.l1 for m in self.modules]).float()
        return (terms * self._l1_scale_t).mean()

    # Bounds of each layer's multiplier of lambda under --l1-target: wide enough to reach any
    # sparsity (the 0.5b run used 0.55 at most, and 1e-12 on layers already below the target,
    # where 1e-6 acts the same), finite so that a run whose sparsity cannot follow (all units
    # dead, say) keeps a finite loss.
    L1_SCALE_RANGE = (1e-6, 1e6)

    def adapt_l1(self, row: dict) -> None:
        """``cfg.l1_target``: after a log row, scale each layer's lambda by the square root of its
        active share over the target, within [0.8, 1.25] per row and ``L1_SCALE_RANGE`` overall:
        an integral controller in log space, slow enough for the optimizer to follow. Layers
        above the target get more L1, layers below less. The controller waits during
        ``l1_warmup`` (lambda is still ramping: sparsity has not had the chance to respond).

        ``cfg.dead_limit``: a layer whose share of dead units over the last window
        (``dead_frac_L{i}``) exceeds the limit is held: its lambda does not rise before the next
        log row, neither by the controller nor by the ramp (during ``l1_warmup`` its multiplier
        shrinks as the ramp grows). A unit that never fires gets no gradient, so more L1 on a
        collapsing layer only kills more of it; held, the layer keeps what lambda it has until
        its dead share falls back under the limit (``--reinit`` revives dead units).
        ``dead_holds`` counts the log rows at which each layer was held.

        Uses the row's per-layer values (already reduced over ranks: every rank agrees)."""
        cfg = self.cfg
        if cfg.l1_target is None:
            return
        ramping = self.step < cfg.l1_warmup
        now = self.l1_coef(self.step)
        # how much the ramp raises lambda by the next log row (1 once it has ended)
        rise = self.l1_coef(self.step + cfg.log_every) / now if ramping and now > 0 else 1.0
        f = self.config.intermediate_size
        lo, hi = self.L1_SCALE_RANGE
        for i in range(len(self.l1_scale)):
            ratio = max(row[f"active_mean_L{i}"], 1e-3) / (cfg.l1_target * f)
            factor = 1.0 if ramping else min(1.25, max(0.8, ratio ** 0.5))
            if cfg.dead_limit is not None and row.get(f"dead_frac_L{i}", 0.0) > cfg.dead_limit:  # NaN: no window yet
                factor = min(factor, 1.0 / rise)
                self.dead_holds[i] += 1
            self.l1_scale[i] = min(hi, max(lo, self.l1_scale[i] * factor))
        self._l1_scale_t.copy_(torch.tensor(self.l1_scale))

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
                l1 = l1_loss(self.modules).to(ce.device)  # 0 without twell modules (a dense run)
                if self.modules:
                    self.interval.observe(self.modules)
                    self.dead.observe(self.modules)
                ((ce + lam * self.l1_penalty(l1)) / cfg.grad_accum).backward()
            ce_sum += ce.detach()
            l1_sum += l1.detach().float()
        return ce_sum / cfg.grad_accum, l1_sum / cfg.grad_accum

    def train_step(self) -> StepResult:
        """One optimizer step: gradients, clipping, AdamW, schedule, dead units (Eq. 6).

        A step whose loss or gradient is NaN or Inf (on any rank) is skipped: its gradients and
        statistics are dropped, the weights, optimizer and schedule stay as they were, ``step``
        does not advance, and its batch counts as consumed (the next step reads the next one).

        Whether to apply the update has to be known on the host, so every step ends with one
        host sync (as a loss scaler's does); the flags of :class:`StepResult` travel in it, reduced
        over ranks, so that every rank skips, stops or saves at the same step.
        """
        interval_before = self.interval.snapshot()
        ce, l1 = self.forward_backward()
        params = [p for p in self.model.parameters() if p.grad is not None]
        total_norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        # Under FSDP the norm is a DTensor: clipping takes it as it is, the rest its value.
        grad_norm = total_norm.full_tensor() if hasattr(total_norm, "full_tensor") else total_norm
        finite = torch.isfinite(torch.stack([ce, l1.to(ce.dtype), grad_norm.to(ce.dtype)])).all()
        save_due = self.cfg.save_minutes > 0 and time.monotonic() - self._last_save_time >= 60 * self.cfg.save_minutes
        flags = torch.stack([~finite, torch.tensor(self.stop_signal is not None, device=self.device),
                             torch.tensor(save_due, device=self.device)]).int()
        if self.world > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        bad, stop, save = (bool(v) for v in flags.tolist())  # the step's one host sync
        self.samples_seen += self.global_batch
        if bad:
            self.optimizer.zero_grad(set_to_none=True)
            self.interval.restore(interval_before)
            self.dead.discard_step()
            self.skipped += 1
            self.bad_streak += 1
            return StepResult(ce, l1, grad_norm, applied=False, stop=stop, save=save)
        if self.cfg.grad_clip > 0:
            torch.nn.utils.clip_grads_with_norm_(params, self.cfg.grad_clip, total_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.bad_streak = 0
        if self.modules:
            self.dead.end_step(self.modules, self.step)
        return StepResult(ce, l1, grad_norm, applied=True, stop=stop, save=save)

    # --- validation ----------------------------------------------------------------------------

    def evaluate(self, batches: Optional[int] = None) -> dict:
        """Validation loss and sparsity of the current model: see :func:`evaluate_lm`."""
        out = evaluate_lm(self.wrapped, self.val_data, self.cfg.batch_size, batches or self.cfg.val_batches,
                          self.device, self.cfg.precision, self.world, self.rank, sparsity=not self.dense)
        self.wrapped.train()
        return out

    # --- checkpoints ---------------------------------------------------------------------------

    def _full_state(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        opts = StateDictOptions(full_state_dict=True, cpu_offload=self.world > 1)
        return get_state_dict(self.model, self.optimizer, options=opts)

    def _sharded_state(self) -> dict:
        """``{"model": ..., "optim": ...}`` as DCP saves and loads it: each rank's shards
        (DTensors) under FSDP, whole tensors otherwise; keyed by parameter names. A tied
        output matrix is left out (it is the embedding, stored once)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.model, self.optimizer)
        if self.config.tie_word_embeddings:
            msd.pop("lm_head.weight", None)
        return {"model": msd, "optim": osd}

    def save_checkpoint(self, directory: Optional[Path] = None, blocking: bool = False) -> Path:
        """Write a checkpoint (see :mod:`twell.recipe.checkpoint`); every rank must call it.

        The files go to a temporary folder renamed into place once they are on disk. In the
        run's own ``checkpoints/`` folder, only the newest ``cfg.keep`` step checkpoints stay.

        Sharded (FSDP) checkpoints: every rank writes its shards; where torch can, in the
        background after a copy to host memory, so training goes on meanwhile and the folder
        gets its name later (:meth:`wait_for_checkpoint`, called before the next checkpoint, at
        the end of the run and with ``blocking=True``). Returns the final folder's path."""
        final = Path(directory or self.out / "checkpoints" / f"step_{self.step:06d}")
        self.wait_for_checkpoint()
        rng = {f"rng_cpu_rank{self.rank}": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng[f"rng_cuda_rank{self.rank}"] = torch.cuda.get_rng_state(self.device)
        rngs = [rng] if self.world == 1 else [None] * self.world
        if self.world > 1:
            dist.all_gather_object(rngs, rng)
        # What accumulates between log steps, summed over ranks (collectives: every rank).
        dead, interval = self.dead.state_dict(), self.interval.state_dict()
        acc = torch.stack([self.ce_acc, self.l1_acc, self.gn_acc])
        if self.world > 1:
            dist.all_reduce(acc)
        if self.sharded:
            tmp = ckpt.temporary_folder(final) if self.main else ckpt.temporary_path(final)
            dist.barrier()  # the folder is there, and empty, before any rank writes into it
            self._write_shards(tmp, final, managed=directory is None, blocking=blocking)
        else:
            msd, osd = self._full_state()
            tmp = ckpt.temporary_folder(final) if self.main else None
        if self.main:
            if not self.sharded:
                unwrapped = self.model.module if hasattr(self.model, "module") else self.model
                from transformers.utils import logging as hf_logging

                hf_logging.disable_progress_bar()  # its "Writing model shards" bar would break ours
                unwrapped.save_pretrained(tmp, state_dict=msd)
                ckpt.save_optimizer(tmp / "optimizer.safetensors", osd)
            else:
                self.config.save_pretrained(tmp)  # the weights are in dcp/: the model's config alone
            tensors = {k: v for r in rngs for k, v in r.items()}
            tensors.update({f"dead/{k}": dead[k] for k in ("counts", "dead", "reinit_count")})
            tensors.update({f"interval/{k}": interval[k] for k in ("active_sum", "l1_sum", "active_max")})
            tensors["log/ce_l1_gn_sum"] = acc
            meta = {"step": self.step, "samples_seen": self.samples_seen, "world_size": self.world,
                    "scheduler": self.scheduler.state_dict(),
                    "dead": {k: dead[k] for k in ("steps_in_window", "windows_done", "dead_frac")},
                    "interval_tokens": interval["tokens"], "log_steps": self.n_acc,
                    "skipped_steps": self.skipped, "bad_streak": self.bad_streak, "l1_scale": self.l1_scale,
                    "dead_holds": self.dead_holds}
            ckpt.save_tensors_with_meta(tmp / "trainer_state.safetensors", tensors, meta)
            (tmp / "train_config.json").write_text(json.dumps(asdict(self.cfg), indent=1))
            self.tokenizer.save(tmp)
            if not self.sharded:
                ckpt.commit(tmp, final)
                if directory is None:  # in the run's own checkpoints/ folder
                    ckpt.prune(final.parent, self.cfg.keep, self.step)
        if self._pending is not None and self._pending.future is None:  # written: name it now
            self.wait_for_checkpoint()
        if self._pending is None and self.world > 1:
            dist.barrier()  # the folder is in place when any rank returns
        self._saved, self._last_save_time = (self.step, self.samples_seen, final), time.monotonic()
        return final

    def _write_shards(self, tmp: Path, final: Path, managed: bool, blocking: bool) -> None:
        """Every rank: this rank's shards of the weights and optimizer state into ``tmp/dcp``;
        in the background (see :meth:`save_checkpoint`) unless ``blocking``."""
        import torch.distributed.checkpoint as dcp

        state = self._sharded_state()
        path = str(tmp / ckpt.DCP_DIR)
        if self._async_save and not blocking:
            # Returns once this rank's shards are copied to host memory; the files are written
            # by a thread, and rank 0 names the folder when its write (which waits for every
            # rank's) is done.
            future = dcp.async_save(state, checkpoint_id=path, process_group=self._save_group)
            self._pending = _PendingSave(future, tmp, final, managed, self.step)
        else:  # named at the end of save_checkpoint, after rank 0 wrote the small files
            dcp.save(state, checkpoint_id=path, process_group=self._save_group)
            self._pending = _PendingSave(None, tmp, final, managed, self.step)

    def poll_checkpoint(self) -> None:
        """Name the background checkpoint if its write has finished (no waiting, no collective)."""
        if self._pending is not None and (self._pending.future is None or self._pending.future.done()):
            self.wait_for_checkpoint()

    def wait_for_checkpoint(self) -> None:
        """Wait for the sharded checkpoint being written (if any) and give it its name: rank 0
        lists its files (the completeness marker), renames the folder into place and prunes."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if pending.future is not None:
            pending.future.result()  # raises what the write raised
        if self.main:
            # Rank 0's write finishes after every rank's (it gathers their results and writes
            # .metadata last), so all the shards are in place.
            ckpt.write_manifest(pending.tmp)
            ckpt.commit(pending.tmp, pending.final)
            if pending.managed:
                ckpt.prune(pending.final.parent, self.cfg.keep, pending.step)

    def load_checkpoint(self, directory: Path) -> None:
        """Restore weights, optimizer, scheduler, RNG, data position and dead-unit state."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        if ckpt.is_sharded(directory):
            # DCP reads the pieces each rank needs, whatever the number of ranks that wrote them.
            state = self._sharded_state()
            ckpt.load_sharded(state, directory, self._save_group)
            msd, osd = state["model"], state["optim"]
            if self.config.tie_word_embeddings:
                msd["lm_head.weight"] = msd["model.embed_tokens.weight"]
            set_state_dict(self.model, self.optimizer, model_state_dict=msd, optim_state_dict=osd)
        else:
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
        acc = tensors.get("log/ce_l1_gn_sum", tensors.get("log/ce_l1_sum"))  # older versions: no norm, or nothing
        if acc is not None:
            self.interval.load_state_dict({**{k: tensors[f"interval/{k}"] for k in ("active_sum", "l1_sum", "active_max")},
                                           "tokens": meta["interval_tokens"]}, primary=self.main)
            acc = acc.to(self.device) if self.main else torch.zeros_like(acc, device=self.device)
            for i, sums in enumerate((self.ce_acc, self.l1_acc, self.gn_acc)[:len(acc)]):
                sums.copy_(acc[i])
            self.n_acc = int(meta["log_steps"])
        self.skipped, self.bad_streak = int(meta.get("skipped_steps", 0)), int(meta.get("bad_streak", 0))
        if self.cfg.l1_target is not None and len(meta.get("l1_scale", [])) == len(self.l1_scale):
            self.l1_scale = [float(v) for v in meta["l1_scale"]]
            self._l1_scale_t.copy_(torch.tensor(self.l1_scale))
        if len(meta.get("dead_holds", [])) == len(self.dead_holds):
            self.dead_holds = [int(v) for v in meta["dead_holds"]]
        self._saved = (self.step, self.samples_seen, Path(directory))
        if f"rng_cpu_rank{self.rank}" in tensors:  # a run resumed on other ranks keeps its own RNG
            torch.set_rng_state(tensors[f"rng_cpu_rank{self.rank}"])
            if self.device.type == "cuda" and f"rng_cuda_rank{self.rank}" in tensors:
                torch.cuda.set_rng_state(tensors[f"rng_cuda_rank{self.rank}"], self.device)
        if self.step >= self.cfg.steps:
            raise ValueError(f"the checkpoint is at step {self.step}, not before --steps {self.cfg.steps}: nothing to do")

    def _apply_optimizer_settings(self) -> None:
        """After loading a checkpoint: the run's ``lr``, ``weight_decay`` and ``betas`` (the
        checkpoint's own unless given again, e.g. ``--resume ... --lr``) replace those in the
        loaded optimizer and scheduler state, which would otherwise keep the checkpoint's while
        train_config.json records the new ones. The schedule's shape
        (warm-up, steps, floor) always comes from the run's settings."""
        cfg = self.cfg
        self.scheduler.base_lrs = [cfg.lr] * len(self.optimizer.param_groups)
        lr = cfg.lr * self.lr_factor(self.scheduler.last_epoch)
        for group, wd in zip(self.optimizer.param_groups, (cfg.weight_decay, 0.0)):
            group["initial_lr"], group["lr"], group["weight_decay"] = cfg.lr, lr, wd
            group["betas"] = tuple(cfg.betas)
        self.scheduler._last_lr = [lr] * len(self.optimizer.param_groups)

    # --- the run -------------------------------------------------------------------------------

    def fit(self) -> dict:
        """Train to ``cfg.steps``, logging, validating and checkpointing; returns the summary.

        Raises :class:`RunStopped` after saving a checkpoint when SIGINT or SIGTERM arrives (at
        the end of the step under way) or when ``cfg.max_bad_steps`` steps in a row were skipped
        for a non-finite loss or gradient."""
        from .report import RunLogger

        cfg = self.cfg
        logger = RunLogger(self, enabled=self.main)
        logger.start()
        if self.main:
            ckpt.remove_partial_writes(self.out / "checkpoints")
        self._last_save_time = time.monotonic()
        interval_tokens, interval_seconds = 0, 0.0
        final = None
        try:
            with self._stop_on_signals():
                while self.step < cfg.steps:
                    t0 = time.perf_counter()
                    r = self.train_step()
                    seconds = time.perf_counter() - t0
                    self.train_seconds += seconds
                    self.tokens_since_start += self.tokens_per_step
                    interval_seconds += seconds
                    interval_tokens += self.tokens_per_step
                    if not r.applied:
                        self._report_skipped(r)
                        if self.bad_streak >= cfg.max_bad_steps:
                            raise self._stop(f"stopped: the loss or gradient was NaN or Inf {self.bad_streak} steps "
                                             "in a row", exit_code=1, state="the last good state",
                                             advice="resume with a lower learning rate", extra=" --lr LR")
                        if r.stop:
                            raise self._interrupted()
                        continue
                    self.ce_acc += r.ce
                    self.l1_acc += r.l1
                    self.gn_acc += r.grad_norm
                    self.n_acc += 1
                    logger.tick()
                    last = self.step == cfg.steps
                    evaluate = self.step % cfg.eval_every == 0 or last
                    if self.step % cfg.log_every == 0 or evaluate:
                        row = self._log_row(interval_tokens / max(interval_seconds, 1e-9))
                        interval_tokens, interval_seconds = 0, 0.0
                        if evaluate:
                            ev = self.evaluate()
                            row.update(self._validation_row(ev))
                            final = ev if last else None
                        self.history.append(row)
                        logger.log(row)
                        self.adapt_l1(row)
                    if (cfg.save_every and self.step % cfg.save_every == 0) or last or r.save:
                        self.save_checkpoint()
                    else:
                        self.poll_checkpoint()
                    if r.stop and not last:
                        raise self._interrupted()
            self.wait_for_checkpoint()  # the last one in place before the summary names it
        finally:
            logger.close()
            self.loader.close()  # the prefetch thread: no more batches are wanted
        if final is None:  # only when resumed at cfg.steps, which __init__ refuses
            final = self.evaluate()
        return logger.finish(final)

    @property
    def throughput(self) -> Optional[float]:
        """Tokens per second of this process's steps so far (validation and checkpoints excluded)."""
        return self.tokens_since_start / self.train_seconds if self.train_seconds > 0 else None

    def _log_row(self, tokens_per_s: float) -> dict:
        """The log row of this step: means since the last row (reduced over ranks), then reset."""
        cfg = self.cfg
        sums = torch.stack([self.ce_acc, self.l1_acc, self.gn_acc]) / self.n_acc
        if self.world > 1:
            dist.all_reduce(sums)
            sums /= self.world
        ce, l1, grad_norm = sums.tolist()  # the one sync of a log step, with stats.reduce
        lam = self.l1_coef(self.step)
        layers = self.interval.reduce() if self.modules else None
        # with per-layer lambdas: the loss of the interval's per-layer l1 means
        penalty = l1 if cfg.l1_target is None else sum(c * v for c, v in zip(self.l1_scale, layers["l1"])) / len(self.l1_scale)
        row = {"step": self.step, "tokens": self.samples_seen * cfg.seq_len, "lr": self.scheduler.get_last_lr()[0],
               "lambda": lam, "ce": ce, "l1": l1, "loss": ce + lam * penalty, "grad_norm": grad_norm,
               "skipped": self.skipped, "tokens_per_s": tokens_per_s, **(self._layer_row(layers) if layers else {}),
               # layers whose last training call ran the sparse kernels (twell.training.path: "auto" takes
               # them only on sparse enough layers and calls of at least MIN_SPARSE_TOKENS tokens)
               "sparse_layers": sum(m.last_train_path == "sparse" for m in self.modules)}
        if cfg.l1_target is not None:  # the lambdas this interval trained with
            row.update({f"lambda_L{i}": lam * c for i, c in enumerate(self.l1_scale)})
        self.ce_acc.zero_(), self.l1_acc.zero_(), self.gn_acc.zero_()
        self.n_acc = 0
        return row

    @staticmethod
    def _validation_row(ev: dict) -> dict:
        """The log row's columns of a validation pass: its loss, and each layer's dead share on
        the validation tokens (units that fired for none of them) with their mean (a dense run:
        the loss alone)."""
        dead = ev["dead_frac"]
        if dead is None:
            return {"val_loss": ev["val_loss"]}
        return {"val_loss": ev["val_loss"], "dead_frac_val": sum(dead) / len(dead),
                **{f"dead_frac_val_L{i}": v for i, v in enumerate(dead)}}

    def _report_skipped(self, r: StepResult) -> None:
        if self.main:
            ce, l1, gn = (float(v) for v in (r.ce, r.l1, r.grad_norm))
            tqdm.write(f"warning: step {self.step + 1} skipped: cross entropy {ce:.4g}, L1 {l1:.4g}, gradient norm "
                       f"{gn:.4g} (NaN or Inf; {self.skipped} skipped in all, {self.bad_streak} in a row, the run stops "
                       f"at {self.cfg.max_bad_steps})")

    def _stop(self, why: str, exit_code: int, state: str = "checkpoint", advice: str = "resume with",
              extra: str = "") -> RunStopped:
        """Save the current state (unless a checkpoint of exactly this state is already written)
        and say where it is and how to resume, in one line.

        A skipped step changes no weight but consumes its batches and counts as skipped, so a
        checkpoint of the same step written before skipped steps is not this state: it would
        resume at a stale data position with the skips forgotten."""
        if self._saved is not None and self._saved[:2] == (self.step, self.samples_seen):
            path = self._saved[2]
        else:
            path = self.save_checkpoint()
        self.wait_for_checkpoint()  # in place before the message names it
        resume = f"train --resume {shlex.quote(str(self.out))}{extra}"
        command = f"torchrun --nproc_per_node {self.world} -m twell {resume}" if self.world > 1 else f"twell {resume}"
        return RunStopped(f"{why} at step {self.step} of {self.cfg.steps}; {state} saved in {path}; {advice}: {command}",
                          exit_code, path)

    def _interrupted(self) -> RunStopped:
        # Another rank may have had the signal alone: the agreed flag is what counts.
        signum = self.stop_signal or signal.SIGTERM
        who = signal.Signals(signum).name if self.stop_signal else "a signal to another process"
        return self._stop(f"interrupted by {who}", exit_code=128 + signum)

    @contextlib.contextmanager
    def _stop_on_signals(self):
        """While training, SIGINT (Ctrl-C) and SIGTERM set ``stop_signal``: the loop saves a
        checkpoint at the end of the step under way and stops. A second signal acts as usual
        (KeyboardInterrupt, or termination), for a user who will not wait; except within two
        seconds of the first, because torchrun passes the terminal's Ctrl-C on to its workers,
        which then see it twice."""
        if threading.current_thread() is not threading.main_thread():  # handlers are the main thread's
            yield
            return
        first = {}

        def handler(signum, frame):
            if self.stop_signal is None:
                self.stop_signal, first["time"] = signum, time.monotonic()
                if self.main:
                    tqdm.write(f"{signal.Signals(signum).name}: saving a checkpoint at the end of step "
                               f"{self.step + 1}, then stopping (send it again to quit without saving)")
            elif time.monotonic() - first["time"] > 2.0:
                signal.signal(signum, previous[signum])
                signal.raise_signal(signum)

        previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, h in previous.items():
                signal.signal(s, h)

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
                world: int = 1, rank: int = 0, sparsity: bool = True) -> dict:
    """Validation loss and sparsity of a sparse LM (in eval mode; left in eval mode).

    Reads the first ``batches x batch_size x world`` windows of the validation stream, always
    the same ones, rank r taking every world-th block of ``batch_size``. Returns ``val_loss``
    (mean cross entropy per token, nats), ``ppl``, ``tokens``, ``windows`` (how many windows of
    the validation stream were read, from its first), and per layer ``active_mean``,
    ``active_max`` and ``dead_frac`` (units that fired for none of these tokens), all reduced
    over ranks. ``sparsity=False``: the loss of any causal LM (a dense baseline), the three
    per-layer entries None.
    """
    modules = sparse_modules(model) if sparsity else []
    if sparsity and not modules:
        raise ValueError("the model has no twell sparse MLPs: call twell.sparsify(model) first")
    model.eval()
    tracking = [m.track_stats for m in modules]
    for m in modules:  # eval mode keeps no statistics unless asked
        m.track_stats = True
    try:
        return _evaluate(model, modules, val_data, batch_size, batches, device, precision, world, rank)
    finally:
        for m, t in zip(modules, tracking):
            m.track_stats = t


def _evaluate(model, modules, val_data, batch_size, batches, device, precision, world, rank) -> dict:
    device = torch.device(device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    stats = IntervalStats(len(modules), device)
    fired = torch.zeros(len(modules), modules[0].intermediate_size if modules else 0, dtype=torch.int64, device=device)
    for i in range(batches):
        batch = val_data.eval_batch((i * world + rank) * batch_size, batch_size).to(device)
        with autocast:
            logits = model(input_ids=batch[:, :-1], use_cache=False).logits
        loss_sum += F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum").double()
        if modules:
            stats.observe(modules)
            fired += torch.stack([m.stats.unit_counts for m in modules])
    if world > 1:
        dist.all_reduce(loss_sum)
        dist.all_reduce(fired)
    tokens = batches * batch_size * world * val_data.seq_len
    val_loss = float(loss_sum) / tokens
    out = {"val_loss": val_loss, "ppl": math.exp(min(val_loss, 50.0)), "tokens": tokens,
           "windows": batches * batch_size * world, "active_mean": None, "active_max": None, "dead_frac": None}
    if modules:
        s = stats.reduce()
        out.update(active_mean=s["active_mean"], active_max=s["active_max"],
                   dead_frac=(fired == 0).float().mean(dim=1).tolist())
    return out


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

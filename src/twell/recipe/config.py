"""The settings of a training run (:class:`TrainConfig`), checked without importing torch.

This module imports nothing heavy, so that ``twell train`` parses and checks its arguments
(and prints an argument error or ``--help``) before torch and transformers load.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from . import init_from as init
from .model import PRESETS

__all__ = ["TrainConfig", "DEFAULT_LR", "INIT_FROM_LR", "DEFAULT_L1", "ACTIVATIONS"]

# Learning rates that trained well here at each scale (the paper's 1.5B used 3e-4).
DEFAULT_LR = {"tiny": 3e-3, "small": 1.5e-3}
# The default peak learning rate of a run that starts from a trained model (--init-from): a
# fine-tuning rate, below the from-scratch ones; not tuned.
INIT_FROM_LR = 1e-4
# lambda, the L1 coefficient, of a run of twell's ReLU MLPs: the paper's setting (sum over units).
DEFAULT_L1 = 2e-5
# The MLP activations a run from a preset trains: "relu", twell's sparse MLPs (the recipe);
# "silu", a dense baseline with Hugging Face's own MLPs, no L1 term and no sparsity statistics.
ACTIVATIONS = ("relu", "silu")


@dataclass
class TrainConfig:
    """Everything a run needs; the CLI fills it. None means "the preset's or a derived default"."""

    preset: Optional[str] = "tiny"  # None once resolved with init_from: the model is the folder's
    # The MLPs' activation (ACTIVATIONS): "relu", twell's sparse MLPs; "silu", a dense baseline
    # (Hugging Face's LlamaMLP, lambda 0), for comparison and for conversion with init_from.
    activation: str = "relu"
    # A Hugging Face model folder to start from (weights, architecture, tokenizer), its MLPs
    # converted to ReLU (see twell.recipe.init_from); None: a preset from random weights.
    init_from: Optional[str] = None
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
    max_bad_steps: int = 5  # non-finite loss or gradient: skip the step; stop after this many in a row
    l1: Optional[float] = None  # None: DEFAULT_L1 for ReLU MLPs, 0 for a dense (silu) run
    # Steps over which lambda ramps up linearly from 0 (None: 0 from scratch, a quarter of the
    # steps with init_from, where a trained model is converted and lambda must rise gradually).
    l1_warmup: Optional[int] = None
    # Target active units per token, as a share of f, for every layer (None: off). When set, each
    # layer's lambda starts at l1 and is adapted at every log step (see Trainer.adapt_l1).
    l1_target: Optional[float] = None
    dead_window: int = 25
    # With l1_target: a layer whose dead share over the window exceeds this keeps its lambda
    # from rising (see Trainer.adapt_l1); None: off.
    dead_limit: Optional[float] = 0.1
    # The paper's Eq. 6 after every step: a unit dead over the last window gets its gate row nudged
    # toward fresh noise until it fires again (twell.recipe.stats.DeadUnits). None: on for twell's
    # ReLU MLPs, off for a dense baseline. The dead-unit limit only holds lambda: a ReLU unit that
    # never fires gets no gradient, so without this nothing brings it back. (H200, 0.5b preset,
    # 17M tokens from scratch at --l1-target 0.01 without it: 10.4% to 55.0% of the units dead in
    # six of eight layers, benchmarks/results/conversion_h200.json. On the CPU, tiny preset, 800
    # steps at the same target: 25.6% dead at most in a layer without it, 7.1% with it, validation
    # loss 5.0275 and 5.0268.)
    reinit: Optional[bool] = None
    reinit_keep: float = 0.9
    reinit_std: float = 0.02
    log_every: int = 10
    eval_every: Optional[int] = None
    val_batches: int = 8
    save_every: Optional[int] = None
    save_minutes: float = 30.0  # also checkpoint after this much wall time since the last one (0: off)
    keep: int = 3  # step checkpoints kept, the newest (0: all)
    out: str = "runs/twell"
    seed: int = 0
    device: Optional[str] = None
    precision: Optional[str] = None
    kernels: str = "auto"  # the MLPs' training kernels on CUDA: auto, dense or sparse (twell.training.path)
    grad_checkpointing: bool = False
    fsdp: bool = False
    compile: bool = False  # torch.compile each decoder layer (see Trainer.__init__)
    progress: bool = True
    plot: bool = True

    def resolved(self, resuming: bool = False) -> "TrainConfig":
        """A copy with every None default filled in, after checking the values.

        Every check that needs no torch comes first, so that a wrong value is reported before
        torch is imported (which takes seconds). ``resuming``: the settings of a checkpoint
        being resumed, whose model comes from the checkpoint (an ``init_from`` folder is not
        read again: it may be gone)."""
        c = TrainConfig(**asdict(self))
        if c.init_from is None and c.preset not in PRESETS:
            raise ValueError(f"unknown preset {c.preset!r}; choose one of {', '.join(PRESETS)}")
        # Counts and sizes first: the defaults below divide by some of them.
        for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "seq_len", "max_docs",
                     "steps", "batch_size", "grad_accum", "log_every", "eval_every", "val_batches", "save_every",
                     "dead_window", "max_bad_steps"):
            value = getattr(c, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} (--{name.replace('_', '-')}) must be >= 1, got {value}")
        if c.warmup is not None and c.warmup < 0:
            raise ValueError(f"warmup must be >= 0 steps, got {c.warmup}")
        if c.activation not in ACTIVATIONS:
            raise ValueError(f"activation (--activation) must be one of {', '.join(ACTIVATIONS)}, got {c.activation!r}")
        if c.activation != "relu":
            c._resolve_dense()
        if c.init_from is not None:
            c._resolve_init_from(resuming)
        c.l1 = c.l1 if c.l1 is not None else DEFAULT_L1
        c.reinit = c.reinit if c.reinit is not None else True  # (a dense baseline has set False above)
        c.seq_len = c.seq_len or PRESETS[c.preset].context
        c.lr = c.lr if c.lr is not None else INIT_FROM_LR if c.init_from else DEFAULT_LR.get(c.preset, 3e-4)
        c.l1_warmup = c.l1_warmup if c.l1_warmup is not None else (c.steps // 4 if c.init_from else 0)
        c.warmup = c.warmup if c.warmup is not None else min(100, max(1, c.steps // 10))
        # about 6 validation passes, on log steps
        c.eval_every = c.eval_every if c.eval_every is not None else max(1, c.steps // 6 // c.log_every) * c.log_every
        c.betas = tuple(c.betas)
        checks = [
            (c.seq_len >= 2, f"seq_len must be >= 2, got {c.seq_len}"),
            (c.lr > 0, f"lr must be > 0, got {c.lr}"),
            (c.l1 >= 0, f"the L1 coefficient must be >= 0, got {c.l1}"),
            (c.l1_warmup >= 0, f"l1 warm-up must be >= 0 steps, got {c.l1_warmup}"),
            (c.l1_target is None or 0 < c.l1_target < 1,
             f"the L1 target (--l1-target) is a share of the hidden units in (0, 1), got {c.l1_target}"),
            (c.l1_target is None or c.l1 > 0, "--l1-target adapts lambda from --l1: give --l1 > 0"),
            (c.dead_limit is None or 0 < c.dead_limit < 1,
             f"the dead-unit limit (--dead-limit) is a share of the hidden units in (0, 1), got {c.dead_limit}"),
            (0 <= c.min_lr_ratio <= 1, f"min_lr_ratio must be in [0, 1], got {c.min_lr_ratio}"),
            (c.grad_clip >= 0, f"grad clip must be >= 0 (0: off), got {c.grad_clip}"),
            (0 < c.reinit_keep <= 1, f"reinit keep must be in (0, 1], got {c.reinit_keep}"),
            (c.save_minutes >= 0, f"save_minutes (--save-minutes) must be >= 0 (0: off), got {c.save_minutes}"),
            (c.keep >= 0, f"keep (--keep) must be >= 0 (0: keep every checkpoint), got {c.keep}"),
            (c.precision in (None, "bf16", "fp32"), f"precision must be bf16 or fp32, got {c.precision!r}"),
            (c.kernels in ("auto", "dense", "sparse"), f"kernels must be auto, dense or sparse, got {c.kernels!r}"),
            (c.compile in (True, False), f"compile must be true or false, got {c.compile!r}"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)
        # The device defaults need torch: last.
        import torch

        if c.device is not None and c.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {c.device!r} asked for, but torch sees no CUDA GPU; use --device cpu")
        c.device = c.device or ("cuda" if torch.cuda.is_available() else "cpu")
        c.precision = c.precision or ("bf16" if c.device.startswith("cuda") else "fp32")
        if c.precision == "bf16" and c.device == "cpu":
            raise ValueError("bf16 autocast is for GPUs; use fp32 on the CPU")
        return c

    def _resolve_dense(self) -> None:
        """In place, on the copy :meth:`resolved` makes: a dense baseline (``activation`` other
        than ReLU) trains Hugging Face's MLPs with cross entropy alone, lambda 0."""
        act = self.activation
        if self.init_from is not None:
            raise ValueError(f"--activation {act} and --init-from: a run from a folder converts its MLPs to ReLU; "
                             "train the dense model from a preset, then start a sparse run from its export")
        if self.l1 not in (None, 0):
            raise ValueError(f"--activation {act} trains a dense baseline with lambda 0: leave --l1 out "
                             f"(got --l1 {self.l1:g}); the L1 term is for twell's ReLU MLPs")
        for option, given in (("--l1-target", self.l1_target is not None), ("--l1-warmup", bool(self.l1_warmup)),
                              ("--reinit", self.reinit is True)):
            if given:
                raise ValueError(f"--activation {act} trains a dense baseline with lambda 0 and no dead-unit tracking: "
                                 f"leave {option} out")
        self.l1 = 0.0
        self.reinit = False

    def _resolve_init_from(self, resuming: bool) -> None:
        """In place, on the copy :meth:`resolved` makes: the settings a model folder decides."""
        if self.fsdp:
            raise ValueError("--init-from with --fsdp is not supported: FSDP runs build their model on the meta "
                             "device from a seeded initialisation, not from a folder's weights; train under DDP "
                             "(torchrun without --fsdp), or in one process")
        if self.preset not in (None, "tiny"):  # "tiny" is the default: the CLI refuses it given explicitly
            raise ValueError(f"--preset {self.preset} and --init-from: the model comes from the folder; leave --preset out")
        self.preset = None
        given = {name: getattr(self, name) for name in init.SIZE_FIELDS}
        if resuming:  # the checkpoint's architecture; the folder is not read
            if any(v is not None for v in given.values()):
                raise ValueError("a run started with --init-from takes its architecture from its checkpoint on "
                                 "--resume; leave the size options out")
            if self.seq_len is None:
                raise ValueError("the settings of a run started with --init-from name no seq_len: give --seq-len")
            return
        folder = init.folder_config(self.init_from)
        init.check_sizes(given, folder, self.init_from)
        for name in init.SIZE_FIELDS:  # the folder's: nothing to override
            setattr(self, name, None)
        if self.tokenizer not in ("bytes", self.init_from):  # "bytes" is the default: refused in the CLI if given
            raise ValueError(f"--tokenizer {self.tokenizer} and --init-from: the run uses the folder's own tokenizer; "
                             "leave --tokenizer out")
        # recorded whole in the run's settings: where the run started, whatever the working folder
        self.init_from = self.tokenizer = str(Path(self.init_from).expanduser().resolve())
        self.seq_len = self.seq_len or init.default_seq_len(folder)
        context = folder.get("max_position_embeddings")
        if context and self.seq_len > context:
            raise ValueError(f"--seq-len {self.seq_len} is longer than the context of --init-from {self.init_from} "
                             f"(max_position_embeddings {context})")

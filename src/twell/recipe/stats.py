"""Per-layer sparsity statistics of a training run, kept on the device and reduced across ranks.

What is reported per layer (the layers are the model's SparseGatedMLPs, in order):

- ``active_mean``: mean number of active (non-zero) hidden units per token.
- ``active_max``: the most active units of any single token.
- ``l1``: the layer's L1 term, mean over tokens of the sum over units of ``|h|``.
- ``dead_frac``: share of units that fired for no token over the last completed window of
  ``window_steps`` optimizer steps (a window of ``window_steps x global batch`` tokens).

Everything accumulates in device tensors; only :meth:`IntervalStats.reduce` and
:meth:`DeadUnits.end_step` at a window's end touch the host or other ranks.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ..nn import SparseGatedMLP

__all__ = ["IntervalStats", "DeadUnits"]


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class IntervalStats:
    """Sums of the per-layer statistics of the micro-batches since the last :meth:`reduce`."""

    def __init__(self, num_layers: int, device):
        self.L, self.device = num_layers, device
        self.reset()

    def reset(self) -> None:
        z = lambda dtype: torch.zeros(self.L, dtype=dtype, device=self.device)  # noqa: E731
        self.active_sum, self.l1_sum, self.active_max = z(torch.float64), z(torch.float64), z(torch.int64)
        self.tokens = 0  # host int: known from shapes, no sync

    @torch.no_grad()
    def observe(self, modules: Sequence[SparseGatedMLP]) -> None:
        """Add the statistics of the modules' last forward (one micro-batch)."""
        M = modules[0].stats.tokens
        self.active_sum += torch.stack([m.stats.active_mean for m in modules]).double() * M
        self.active_max = torch.maximum(self.active_max, torch.stack([m.stats.active_max for m in modules]))
        if modules[0].l1 is not None:
            self.l1_sum += torch.stack([m.l1.detach() for m in modules]).double() * M
        self.tokens += M

    def snapshot(self) -> tuple:
        """The sums as they are now, for :meth:`restore` (dropping a skipped step's statistics)."""
        return self.active_sum.clone(), self.l1_sum.clone(), self.active_max.clone(), self.tokens

    def restore(self, snapshot: tuple) -> None:
        active_sum, l1_sum, active_max, self.tokens = snapshot
        self.active_sum.copy_(active_sum)
        self.l1_sum.copy_(l1_sum)
        self.active_max.copy_(active_max)

    def reduce(self) -> dict[str, list[float]]:
        """Per-layer means over all tokens of all ranks since the last reset (one sync), then reset."""
        sums = torch.cat([self.active_sum, self.l1_sum, torch.tensor([float(self.tokens)], device=self.device, dtype=torch.float64)])
        maxes = self.active_max.clone()
        if _distributed():
            dist.all_reduce(sums)
            dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
        sums, maxes = sums.cpu(), maxes.cpu()
        tokens = max(float(sums[-1]), 1.0)
        out = {
            "active_mean": (sums[: self.L] / tokens).tolist(),
            "l1": (sums[self.L : 2 * self.L] / tokens).tolist(),
            "active_max": [int(v) for v in maxes],
            "tokens": int(sums[-1]),
        }
        self.reset()
        return out

    def state_dict(self) -> dict:
        """The sums since the last :meth:`reduce`, summed over ranks (``active_max``: max over
        ranks). Under torch.distributed every rank must call it (a collective)."""
        sums = torch.cat([self.active_sum, self.l1_sum, torch.tensor([float(self.tokens)], device=self.device, dtype=torch.float64)])
        maxes = self.active_max.clone()
        if _distributed():
            dist.all_reduce(sums)
            dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
        return {"active_sum": sums[: self.L], "l1_sum": sums[self.L : 2 * self.L], "active_max": maxes,
                "tokens": int(sums[-1])}

    def load_state_dict(self, state: dict, primary: bool = True) -> None:
        """Restore :meth:`state_dict`'s sums: all of them on the ``primary`` rank, zeros on the
        others, so that the next :meth:`reduce` (a sum over ranks) counts them once."""
        self.reset()
        if primary:
            self.active_sum.copy_(state["active_sum"])
            self.l1_sum.copy_(state["l1_sum"])
            self.tokens = int(state["tokens"])
        self.active_max.copy_(state["active_max"])  # a max over ranks: the same on every rank is fine


class DeadUnits:
    """Which units fired for no token over a window of optimizer steps, and the paper's Eq. 6.

    ``counts [L, f]``: firings per unit in the current window. At the end of each window the
    counts are summed over ranks, ``dead [L, f]`` becomes ``counts == 0`` and a new window starts.

    With re-initialisation on, after every step each unit that was dead at the end of the last
    window and has not fired since gets ``Wg[j] <- keep * Wg[j] + (1 - keep) * N(0, std^2)``
    (Eq. 6). "Not fired since" must agree on every rank (or the replicas' weights would
    drift apart), so then the counts are summed over ranks after every step: ``L x f`` integers,
    small next to the gradients.
    """

    def __init__(self, num_layers: int, width: int, window_steps: int, device, reinit: bool = False,
                 keep: float = 0.9, std: float = 0.02, seed: int = 0):
        if window_steps < 1:
            raise ValueError(f"the dead-unit window must be >= 1 step, got {window_steps}")
        self.window_steps, self.reinit, self.keep, self.std, self.seed = window_steps, reinit, keep, std, seed
        self.counts = torch.zeros(num_layers, width, dtype=torch.int64, device=device)
        self.pending = torch.zeros_like(self.counts)  # this step's local firings
        self.dead = torch.zeros(num_layers, width, dtype=torch.bool, device=device)
        self.steps_in_window = 0
        self.windows_done = 0
        self.dead_frac: Optional[list[float]] = None  # per layer, of the last completed window
        self.reinit_count = torch.zeros((), dtype=torch.int64, device=device)  # unit-steps nudged

    @torch.no_grad()
    def observe(self, modules: Sequence[SparseGatedMLP]) -> None:
        self.pending += torch.stack([m.stats.unit_counts for m in modules])

    def discard_step(self) -> None:
        """Forget this step's firings (the step was skipped)."""
        self.pending.zero_()

    @torch.no_grad()
    def end_step(self, modules: Sequence[SparseGatedMLP], step: int) -> None:
        """Call after each optimizer step (``step`` counts from 1)."""
        if self.reinit and _distributed():
            dist.all_reduce(self.pending)
        self.counts += self.pending
        self.pending.zero_()
        self.steps_in_window += 1
        if self.steps_in_window >= self.window_steps:
            if not self.reinit and _distributed():
                dist.all_reduce(self.counts)
            self.dead = self.counts == 0
            self.dead_frac = self.dead.float().mean(dim=1).tolist()  # one sync per window
            self.counts.zero_()
            self.steps_in_window = 0
            self.windows_done += 1
        if self.reinit and self.windows_done:
            self._reinit(modules, step)

    def _reinit(self, modules: Sequence[SparseGatedMLP], step: int) -> None:
        target = self.dead & (self.counts == 0)
        w = modules[0].gate_proj.weight
        # The same generator state on every rank, so every replica draws the same noise.
        gen = torch.Generator(device=w.device).manual_seed(self.seed * 1_000_003 + step)
        for layer, m in enumerate(modules):
            m.reinit_dead_units(keep=self.keep, std=self.std, generator=gen, mask=target[layer])
        self.reinit_count += target.sum()

    def state_dict(self) -> dict:
        """The tracker's state with ``counts`` summed over ranks (the window's firings on every
        rank). Under torch.distributed every rank must call it (a collective, unless ``reinit``
        already keeps the counts summed)."""
        counts = self.counts.clone()
        if not self.reinit and _distributed():
            dist.all_reduce(counts)
        return {"counts": counts, "dead": self.dead, "reinit_count": self.reinit_count,
                "steps_in_window": self.steps_in_window, "windows_done": self.windows_done, "dead_frac": self.dead_frac}

    def load_state_dict(self, state: dict, primary: bool = True) -> None:
        """Restore :meth:`state_dict`. ``counts`` are the sum over ranks: without re-init they go to
        the ``primary`` rank only (zeros elsewhere), so that the window's end, which sums the
        ranks' counts, sees each firing once; with re-init every rank keeps the summed counts,
        as it does while training."""
        if self.reinit or primary:
            self.counts.copy_(state["counts"])
        else:
            self.counts.zero_()
        self.pending.zero_()
        self.dead.copy_(state["dead"])
        self.reinit_count.copy_(state["reinit_count"])
        self.steps_in_window, self.windows_done = int(state["steps_in_window"]), int(state["windows_done"])
        self.dead_frac = state["dead_frac"]

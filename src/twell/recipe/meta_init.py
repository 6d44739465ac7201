"""Initialise a model built on the meta device to exactly the weights of its seeded CPU build.

Under FSDP every rank should hold only its shard: the model is built on the ``meta`` device
(no memory), sharded with ``fully_shard``, and only then given storage on the rank's device
(``to_empty``). What goes into that storage must be what the plain build gives, bit for bit:
``build_model(config, seed)`` on the CPU, whose values come from Hugging Face's initialisation
drawing from the seeded CPU generator in a fixed order (every module's constructor init, then
``post_init``'s normal/ones/zeros and the RoPE buffers, then ties). Re-running a per-parameter
init cannot give the same values: each value depends on every draw made before it, including
draws whose results the build overwrote. So the build itself is recorded and replayed:

1. **Record** (:func:`record_init`): run the build function under ``FakeTensorMode``: tensors
   that carry shapes and say they are on the CPU but hold no data, so the build takes exactly
   its CPU code path (a ``torch.device("meta")`` build would not: transformers skips its
   weight init there). A dispatch mode logs every aten op with its arguments; the CPU
   generator's state is logged wherever it changed between random ops (a re-seed).
2. **Plan**: one backward pass over the log finds which writes are *live* (read later, or the
   final value of a parameter or buffer) and which are overwritten whole before anyone reads
   them (the constructors' kaiming draws, which ``post_init`` replaces).
3. **Replay** (:meth:`InitRecipe.replay`): run the log again on real CPU tensors from the
   logged generator state. Random ops always run, so the generator advances exactly as in the
   build; a dead one runs on a scratch tensor that is freed at once. Other ops run only when
   their result is live. A parameter or buffer is handed to a callback (which copies this
   rank's shard to the device) after the last op that touches it, and freed.

Memory: at any moment the replay holds the tensors whose values are still needed, which for a
Hugging Face build is one parameter at a time (the largest: the embedding) plus the small
buffers; never the whole model. Time: the same random draws as the CPU build (the build each
rank made before).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

if TYPE_CHECKING:
    from torch import nn

__all__ = ["InitRecipe", "record_init", "materialize"]

# In-place ops that overwrite every element of their first argument without reading it (when
# the argument covers its whole storage): the write before them is dead unless read in between.
_OVERWRITES = {
    "aten::fill_", "aten::zero_", "aten::normal_", "aten::uniform_", "aten::copy_", "aten::random_",
    "aten::exponential_", "aten::log_normal_", "aten::cauchy_", "aten::geometric_",
}

# Ops that swap or resize a tensor's storage: the replay keeps one storage per tensor.
_UNSUPPORTED = {"aten::set_", "aten::resize_", "aten::resize_as_", "aten::_resize_output_"}


@dataclass(frozen=True)
class _Ref:
    """A tensor of the log: its storage (by id) and its view of it."""

    key: int
    dtype: torch.dtype
    device: torch.device
    size: tuple
    stride: tuple
    offset: int
    nbytes: int  # of the whole storage

    @property
    def whole(self) -> bool:
        """Whether this view covers every byte of its storage, each once."""
        numel = 1
        for s in self.size:
            numel *= s
        contiguous = all(n == 1 or st == want for n, st, want in zip(self.size, self.stride, _contiguous_strides(self.size)))
        return self.offset == 0 and contiguous and numel * self.dtype.itemsize == self.nbytes


def _contiguous_strides(size: tuple) -> tuple:
    strides, acc = [], 1
    for s in reversed(size):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


@dataclass
class _Op:
    func: Any  # an OpOverload, or None for a generator-state entry
    args: tuple
    kwargs: dict
    outs: list  # _Ref of each tensor output
    rng_state: Optional[torch.Tensor] = None  # for func None: the CPU generator state to set
    random: bool = False
    reads: set = field(default_factory=set)  # storage keys whose contents the op reads
    overwrites: set = field(default_factory=set)  # written whole, not read
    writes: set = field(default_factory=set)  # every storage written (created ones included)
    write_refs: list = field(default_factory=list)  # the _Ref of each written argument
    run: bool = False  # set by the plan: execute at all
    live: bool = False  # set by the plan: its written values are needed (else: scratch)


def _flat(x) -> list:
    if isinstance(x, (list, tuple)):
        return [y for v in x for y in _flat(v)]
    if isinstance(x, dict):
        return [y for v in x.values() for y in _flat(v)]
    return [x]


def _map(x, fn):
    if isinstance(x, (list, tuple)):
        return type(x)(_map(v, fn) for v in x)
    if isinstance(x, dict):
        return {k: _map(v, fn) for k, v in x.items()}
    return fn(x)


class _Recorder(TorchDispatchMode):
    """Logs every op that reaches it (under FakeTensorMode: fake tensors in and out)."""

    def __init__(self):
        super().__init__()
        self.ops: list[_Op] = []
        self.keep: list = []  # every fake tensor seen: alive, so that no storage id is reused
        self._rng: Optional[torch.Tensor] = None  # the CPU generator state at the last random op

    def ref(self, t) -> _Ref:
        from torch._subclasses.fake_tensor import FakeTensor

        if not isinstance(t, FakeTensor):
            raise TypeError("internal: a real tensor where a fake one was expected")
        self.keep.append(t)
        storage = t.untyped_storage()
        return _Ref(storage._cdata, t.dtype, t.device, tuple(t.shape), tuple(t.stride()), t.storage_offset(),
                    storage.nbytes())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._subclasses.fake_tensor import FakeTensor

        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace == "prim":  # prim.device and the like: queries, no tensors made
            return out
        if func._schema.name in _UNSUPPORTED:
            raise NotImplementedError(f"{func}: the build changes a tensor's storage, which the meta initialisation "
                                      "cannot replay")
        if any(isinstance(a, torch.Generator) for a in _flat((args, kwargs))):
            raise NotImplementedError(f"{func}: the build draws from an explicit torch.Generator, which the meta "
                                      "initialisation cannot replay (it replays the global CPU generator)")
        devices = {t.device.type for t in _flat((args, kwargs, out)) if isinstance(t, torch.Tensor)}
        # Random ops on the meta device (modules built there on purpose) draw nothing.
        random = torch.Tag.nondeterministic_seeded in func.tags and devices != {"meta"}
        if random:
            if devices - {"cpu", "meta"}:
                raise NotImplementedError(f"{func} on {', '.join(sorted(devices))}: random ops off the CPU cannot be replayed")
            # Fake random ops leave the generator alone: a change since the last one is a re-seed.
            with _disable_current_modes():  # tensor ops here would go to the fake mode beneath this one
                state = torch.get_rng_state()
                if self._rng is None or not torch.equal(state, self._rng):
                    self.ops.append(_Op(None, (), {}, [], rng_state=state))
                    self._rng = state
        enc = lambda a: self.ref(a) if isinstance(a, FakeTensor) else a  # noqa: E731 (real constants stay)
        op = _Op(func, _map(tuple(args), enc), _map(kwargs, enc),
                 [self.ref(o) for o in _flat(out) if isinstance(o, torch.Tensor)], random=random)
        self._classify(op)
        self.ops.append(op)
        return out

    def _classify(self, op: _Op) -> None:
        """Which storages the op reads, writes, and overwrites whole (see _OVERWRITES)."""
        schema = op.func._schema
        arg_keys = set()
        for i, a in enumerate(schema.arguments):
            value = op.args[i] if i < len(op.args) else op.kwargs.get(a.name)
            refs = [r for r in _flat(value) if isinstance(r, _Ref)]
            arg_keys.update(r.key for r in refs)
            written = a.alias_info is not None and a.alias_info.is_write
            for r in refs:
                if written:
                    op.writes.add(r.key)
                    op.write_refs.append(r)
                    if i == 0 and schema.name in _OVERWRITES and r.whole:
                        op.overwrites.add(r.key)
                        continue
                op.reads.add(r.key)
        # Outputs in storages no argument had: created by the op, written whole.
        for r in op.outs:
            if r.key not in arg_keys:
                op.writes.add(r.key)
                op.overwrites.add(r.key)


@dataclass
class InitRecipe:
    """What a build did to its tensors (see the module's docstring); :meth:`replay` runs it.

    ``finals``: name -> ``_Ref`` of every parameter and buffer of the built model (tied ones
    under each of their names)."""

    ops: list
    finals: dict

    def __post_init__(self):
        self._plan()

    def _plan(self) -> None:
        live = {r.key for r in self.finals.values()}
        for op in reversed(self.ops):
            if op.func is None:
                op.run = True
                continue
            op.live = bool(op.writes & live)
            op.run = op.live or op.random
            if op.live:
                live -= op.overwrites
                live |= op.reads
            elif op.random:  # on a scratch: reads its other inputs only
                live |= op.reads - op.writes
        # The last op that touches each storage, among those that run: after it, free (or emit).
        self._last: dict[int, int] = {}
        for i, op in enumerate(self.ops):
            if op.run and op.func is not None:
                for k in self._touches(op):
                    self._last[k] = i

    @staticmethod
    def _touches(op: _Op) -> set:
        """The storages an op that runs uses (a dead random op writes scratch tensors instead)."""
        return op.reads | op.writes if op.live else op.reads - op.writes

    def replay(self, emit: Callable[[str, torch.Tensor], None]) -> None:
        """Run the build again on the CPU (see the module's docstring), calling
        ``emit(name, tensor)`` once for every parameter and buffer name with its final value
        (a CPU tensor, valid during the call only). Leaves the CPU generator where the build
        left it."""
        storages: dict[int, torch.UntypedStorage] = {}
        by_key: dict[int, list[str]] = {}
        for name, r in self.finals.items():
            by_key.setdefault(r.key, []).append(name)

        def real(r: _Ref) -> torch.Tensor:
            if r.key not in storages:  # first use: an uninitialised storage, as the build's empty() gave
                storages[r.key] = torch.empty((r.nbytes,), dtype=torch.uint8, device=r.device).untyped_storage()
            return _view(storages[r.key], r)

        def scratch(r: _Ref) -> torch.Tensor:
            return _view(torch.empty((r.nbytes,), dtype=torch.uint8, device=r.device).untyped_storage(), r)

        def finish(key: int) -> None:
            for name in by_key.get(key, []):
                emit(name, real(self.finals[name]))
            storages.pop(key, None)

        with torch.no_grad():
            for i, op in enumerate(self.ops):
                if not op.run:
                    continue
                if op.func is None:
                    torch.set_rng_state(op.rng_state)
                    continue
                dead = set() if op.live else {r.key for r in op.write_refs}  # a dead random op: draws into scratch

                def fn(a):
                    if isinstance(a, _Ref):
                        return scratch(a) if a.key in dead else real(a)
                    # A real constant of the build: a copy, so that the log stays as recorded.
                    return a.clone() if isinstance(a, torch.Tensor) else a

                out = op.func(*_map(op.args, fn), **_map(op.kwargs, fn))
                if op.live:
                    outs = [o for o in _flat(out) if isinstance(o, torch.Tensor)]
                    for r, o in zip(op.outs, outs):
                        if r.key not in storages:  # a new storage: the op made it
                            storages[r.key] = o.untyped_storage()
                    del outs
                del out  # a scratch tensor dies here, not one op later
                for key in [k for k in self._touches(op) if self._last[k] == i]:
                    finish(key)
        for key in list(by_key):  # never written by the build (uninitialised there): zeros
            if key not in self._last:
                storages[key] = torch.zeros((self.finals[by_key[key][0]].nbytes,), dtype=torch.uint8).untyped_storage()
                finish(key)


def _view(storage: "torch.UntypedStorage", r: _Ref) -> torch.Tensor:
    t = torch.empty((0,), dtype=r.dtype, device=storage.device)
    return t.set_(storage, r.offset, r.size, r.stride)


def record_init(build: Callable[[], "nn.Module"]) -> InitRecipe:
    """Run ``build()`` (a function that returns a freshly initialised model on the CPU) without
    data, logging what it does; returns the recipe that replays it. The fake model is dropped."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    recorder = _Recorder()
    with FakeTensorMode(), recorder:
        model = build()
    finals = {name: recorder.ref(t) for name, t in
              [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]}
    for r in finals.values():
        if r.device.type != "cpu":
            raise ValueError(f"the build left a tensor on {r.device}: record_init replays CPU builds")
    return InitRecipe(recorder.ops, finals)


def materialize(model: "nn.Module", recipe: InitRecipe, device) -> None:
    """Give ``model`` (built on the meta device, possibly sharded with ``fully_shard``) storage
    on ``device`` and the values of the recorded build: each parameter's full value is made on
    the CPU, one at a time, and this rank's shard of it copied in (a DTensor's local shard, by
    its placements; plain tensors whole). Ties survive (checked)."""
    from torch.distributed.tensor import DTensor

    from ..nn import laid_out_like

    model.to_empty(device=device)
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers(remove_duplicate=False))
    missing = sorted(set(tensors) ^ set(recipe.finals))
    if missing:
        raise ValueError(f"the recorded build and the model differ in these tensors: {', '.join(missing[:5])}")
    done = set()

    def emit(name: str, full: torch.Tensor) -> None:
        target = tensors[name]
        if isinstance(target, DTensor):  # every rank holds the same full tensor: sliced locally
            target.to_local().copy_(laid_out_like(full.to(target.device), target).to_local())
        else:
            target.copy_(full)
        done.add(name)

    recipe.replay(emit)
    if done != set(tensors):
        raise RuntimeError(f"internal: not initialised: {sorted(set(tensors) - done)[:5]}")
    for module in model.modules():  # a tensor held outside parameters and buffers would still be meta
        for key, value in vars(module).items():
            if isinstance(value, torch.Tensor) and value.is_meta:
                raise ValueError(f"{type(module).__name__}.{key} is a tensor outside the module's parameters and buffers, "
                                 "left on the meta device")

"""Compile twell's kernels for the H200 (sm_90) on a machine without a GPU, *as the launchers
launch them*: the launchers run on CPU tensors of real shapes, and each kernel launch is caught
and compiled (Triton's own argument specialisation: dtypes, 16-byte alignment, integers
divisible by 16, constexprs, warps, stages) instead of run. For each launch it prints the
registers per thread, spilled bytes, shared memory and hashes of the PTX (line info stripped)
and of the SASS (nvdisasm; addresses and encodings stripped); with SM90_DUMP=DIR it also writes
both texts there, to diff two commits' kernels. Uses:

- a refactoring of kernel source that must not change what runs: same hashes on both commits;
- a kernel change: registers and spills before any device time is spent.

Needs the Triton the GPU machine has (3.6.0), e.g. in a side venv:

    python3 -m venv /tmp/t36 && /tmp/t36/bin/pip install triton==3.6.0 numpy
    /tmp/t36/bin/pip install torch --index-url https://download.pytorch.org/whl/cpu
    /tmp/t36/bin/python benchmarks/sm90_launched.py [group ...]   (groups: see GROUPS; default all)

Unlike kernels compiled from hand-written signatures (without the launchers' divisibility
facts), the PTX here is the one the launchers' calls compile to on the
H200 at these shapes. Times are not predicted: it says nothing of speed.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

import twell.checks  # noqa: E402
from sm90_ptx import instructions  # noqa: E402  (PTX without line info and labels)

TARGET = GPUTarget("cuda", 90, 32)
_BACKEND = make_backend(TARGET)


def _compile_instead_of_run(records: list, cache: dict):
    def run(self, *args, grid, warmup, **kwargs):
        binder = create_function_from_signature(self.signature, self.params, _BACKEND)
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = self._pack_args(_BACKEND, kwargs, bound, specialization, options)
        key = (self.__name__, repr(signature), repr(sorted(constexprs.items())), repr(sorted(attrs.items())),
               repr(sorted(options.__dict__.items())))
        if key not in cache:
            k = triton.compile(ASTSource(self, signature, constexprs, attrs), target=TARGET, options=options.__dict__)
            cache[key] = dict(
                kernel=self.__name__,
                constexprs={self.arg_names[p[0]]: v for p, v in constexprs.items() if len(p) == 1},
                num_warps=options.num_warps, num_stages=options.num_stages,
                ptx=hashlib.sha1(instructions(k.asm["ptx"]).encode()).hexdigest()[:12],
                shared=k.metadata.shared,
                sass=hashlib.sha1(_sass(k).encode()).hexdigest()[:12],
                **_ptxas_info(k),  # (Triton reads registers and spills when it loads the cubin on a GPU)
            )
            if os.environ.get("SM90_DUMP"):  # the instructions, to diff two commits' kernels
                os.makedirs(os.environ["SM90_DUMP"], exist_ok=True)
                stem = os.path.join(os.environ["SM90_DUMP"], f"{self.__name__}_{cache[key]['ptx']}")
                with open(stem + ".ptx", "w") as fh:
                    fh.write(instructions(k.asm["ptx"]))
                with open(stem + ".sass", "w") as fh:
                    fh.write(_sass(k))
        records.append(dict(cache[key], grid=grid if not callable(grid) else "fn"))
        return None

    return run


def _sass(k) -> str:
    """The cubin's machine instructions (nvdisasm), without addresses, encodings and comments:
    equal text means the same code runs."""
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    nvdisasm = os.path.join(os.path.dirname(get_ptxas(TARGET.arch).path), "nvdisasm")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as fh:
            fh.write(k.asm["cubin"])
        text = subprocess.run([nvdisasm, "-c", path], capture_output=True, text=True, check=True).stdout
    lines = []
    for line in text.splitlines():
        line = re.sub(r"/\*[0-9a-f]{4,}\*/", "", line).split(";")[0].strip()
        if line and not line.startswith(("//", ".")):
            lines.append(line)
    return "\n".join(lines)


def _ptxas_info(k) -> dict:
    """Registers, spill stores and loads of the cubin, from ptxas' verbose report."""
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(TARGET.arch).path
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as fh:
            fh.write(k.asm["ptx"])
        out = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", src, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True, check=True).stderr
    regs = re.search(r"Used (\d+) registers", out)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out)
    return dict(regs=int(regs.group(1)) if regs else None,
                spill_stores=int(spill.group(1)) if spill else None,
                spill_loads=int(spill.group(2)) if spill else None)


def _any_device_with_data(t: torch.Tensor, name: str) -> None:
    if t.is_meta:
        raise ValueError(f"{name} is on the meta device")


@contextlib.contextmanager
def compiling_launches(records: list):
    """Inside: every Triton launch compiles for sm_90 and appends a record instead of running;
    the launchers accept CPU tensors (their device check is lifted; nothing else changes, so a
    launcher picks the variants it would pick on the GPU)."""
    cache: dict = {}
    old_run, old_check = JITFunction.run, twell.checks.check_launchable
    JITFunction.run = _compile_instead_of_run(records, cache)
    patched = [twell.checks]
    for mod in list(sys.modules.values()):  # modules that imported the name directly
        if getattr(mod, "__name__", "").startswith("twell") and getattr(mod, "check_launchable", None) is old_check:
            patched.append(mod)
    for mod in patched:
        mod.check_launchable = _any_device_with_data
    try:
        yield
    finally:
        JITFunction.run = old_run
        for mod in patched:
            mod.check_launchable = old_check


# ---------------------------------------------------------------------------------------------
# The launches: the shipped defaults at the shapes the benchmarks measure (d 2048, f 5632, bf16)
# ---------------------------------------------------------------------------------------------

D, F = 2048, 5632
BF16 = torch.bfloat16


def training_rows(M: int = 16384, W: int = 64) -> None:
    from twell.kernels import train_ffn as T
    from twell.training.ops import ROWS_CONFIG

    g = torch.Generator().manual_seed(0)
    x = torch.randn(M, D, dtype=BF16)
    cols = torch.randint(0, F, (M, W), generator=g, dtype=torch.int16)
    vals = torch.randn(M, W, dtype=BF16)
    counts = torch.full((M,), 29, dtype=torch.int32)
    w = torch.randn(F, D, dtype=BF16)
    for d in (D, 8192):  # whole-row kernels, and the d-blocked ones past FULL_D_MAX
        xd, wd = (x, w) if d == D else (torch.randn(64, d, dtype=BF16), torch.randn(F, d, dtype=BF16))
        m = xd.shape[0]
        T.ffn_rows_forward(xd, cols[:m], vals[:m], counts[:m], wd, wd, **ROWS_CONFIG)
        T.ffn_rows_forward(xd, cols[:m], vals[:m], counts[:m], wd, None, **ROWS_CONFIG)
        c = torch.zeros(1, dtype=torch.float32)
        T.ffn_rows_backward(xd, cols[:m], vals[:m], vals[:m], counts[:m], wd, wd, wd, c, **ROWS_CONFIG)
        T.ffn_rows_backward(xd, cols[:m], vals[:m], None, counts[:m], wd, wd, None, c, **ROWS_CONFIG)
    T.pack_rows(torch.randn(M, F, dtype=BF16), W)
    from twell.kernels.train_index import unit_index
    from twell.training.ops import GRADS_CONFIG

    order, offsets = unit_index(cols, counts, F)
    du = torch.randn(M, W, dtype=torch.float32)
    T.ffn_weight_grads(order, offsets, x, x, vals, vals, du, du, **GRADS_CONFIG)
    T.ffn_weight_grads(order, offsets, x, x, vals, None, du, None, **GRADS_CONFIG)


def inference_updown(M: int = 131072) -> None:
    from twell.kernels import OverflowCounters, ffn_from_twell, pack_relu, updown

    x = torch.randn(M, D, dtype=BF16)
    w = torch.randn(F, D, dtype=BF16)
    pre = torch.randn(M, F, dtype=BF16)  # values do not matter: nothing runs
    tw = pack_relu(pre, 256)
    c = OverflowCounters.zeros(x.device)
    uc, nnz = torch.zeros(F, dtype=torch.int32), torch.zeros(M, dtype=torch.int32)
    for split in (False, True):
        for rms in (30.0, 100.0):  # rows about equally long, and spread out
            be, nw = updown.default_config(D, 29.0, split=split, rms_k=rms)
            for writable in (True, False):
                for stats in (False, True):
                    ffn_from_twell(x, tw, w, w_up=w, pre=pre, counters=c, block_e=be, num_warps=nw, pre_writable=writable,
                                   kernel="split" if split else "token",
                                   unit_counts=uc if stats else None, row_nnz=nnz if stats else None)
    small = 2048  # below TWO_PASS_MIN_M: one launch, the exact path inside it
    tw_s = pack_relu(pre[:small], 256)
    for first in (None, w):  # pre read, or the gate recomputed from w_first
        for gated in (True, False):
            ffn_from_twell(x[:small], tw_s, w, w_up=w if gated else None, pre=None if first is not None else pre[:small],
                           w_first=first, counters=c)


def decode(M_values=(1, 2, 4, 8, 16, 64)) -> None:
    """The decode kernels as the dispatcher's small calls launch them on the H200: programmatic
    dependent launch on, the split gate's stages as that GPU's shared memory allows."""
    from twell.kernels import decode_fused, decode_split
    from twell.kernels.decode import ffn_decode
    from twell.kernels.decode_fused import DecodeScratch, ffn_decode_fused
    from twell.kernels.decode_split import SplitScratch, ffn_decode_split

    h200_shared = 232448  # bytes of shared memory a block may use on the H200

    def gate_stages(x, rows, cfg, BK, desc=False):  # decode_split._gate_stages on the H200
        return max(1, min(cfg.num_stages, (h200_shared - 8 * 1024) // ((cfg.BU + rows) * BK * x.element_size())))

    saved = (decode_fused.pdl_ok, decode_split.pdl_ok, decode_split._gate_stages)
    decode_fused.pdl_ok = decode_split.pdl_ok = lambda t: True
    decode_split._gate_stages = gate_stages
    try:
        w = torch.randn(F, D, dtype=BF16)
        for M in M_values:
            x = torch.randn(M, D, dtype=BF16)
            for gated in (True, False):
                w_up = w if gated else None
                ffn_decode_fused(x, w, w, w_up=w_up, scratch=DecodeScratch(D, x.device, rows=max(16, M)))
                if M >= 3:
                    ffn_decode_split(x, w, w, w_up=w_up, scratch=SplitScratch(D, F, x.dtype, x.device))
        ffn_decode(torch.randn(256, D, dtype=BF16), w, w, w_up=w)  # the three-launch path (kernel_mode="decode")
    finally:
        decode_fused.pdl_ok, decode_split.pdl_ok, decode_split._gate_stages = saved


GROUPS = {"training_rows": training_rows, "inference_updown": inference_updown, "decode": decode}


def main(argv: list[str]) -> None:
    wanted = argv[1:] or list(GROUPS)
    for name in wanted:
        records: list = []
        with compiling_launches(records):
            GROUPS[name]()
        print(f"## {name}")
        seen = set()
        for r in records:
            key = (r["kernel"], r["ptx"])
            if key in seen:
                continue
            seen.add(key)
            consts = " ".join(f"{k}={v}" for k, v in r["constexprs"].items())
            print(f"{r['kernel']:28s} w{r['num_warps']} s{r['num_stages']} ptx {r['ptx']} sass {r['sass']} regs {r.get('regs')} "
                  f"spill {r.get('spill_stores')}/{r.get('spill_loads')} smem {r['shared']}  {consts}")


if __name__ == "__main__":
    main(sys.argv)

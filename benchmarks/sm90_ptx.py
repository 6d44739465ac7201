"""Compile the decode, matmul gate-pack and heavy-row training kernels for sm_90 on the CPU (no GPU needed) and print
a hash of each variant's PTX instructions (line info and debug sections stripped), so that a
refactoring of kernel source can be shown to leave the compiled kernels unchanged: run it on
both commits and compare. Needs the Triton the GPU machine has (3.6.0), e.g. in a side venv:

    python3 -m venv /tmp/t36 && /tmp/t36/bin/pip install triton==3.6.0 torch numpy
    /tmp/t36/bin/python benchmarks/sm90_ptx.py

The kernels are compiled without the divisibility facts Triton's launcher adds at run time
(pointers and integer arguments divisible by 16), so the PTX is not the one that runs: without
them `_fire_updown_kernel` loads its rows with scalar 16-bit loads and adds with scalar atomics,
with them (as launched, d 2048) with 16-byte loads and `atom.add.v4.f32` (H200). The
hashes compare two commits' kernels under the same settings; they do not describe the code
that runs.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from twell.kernels import decode, decode_fused, gate_pack  # noqa: E402

try:  # from 2026-12-01 s8
    from twell.kernels import heavy_rows  # noqa: E402
except ImportError:
    heavy_rows = None
try:  # from 2026-12-01 s9
    from twell.kernels import decode_split  # noqa: E402
except ImportError:
    decode_split = None

TARGET = GPUTarget("cuda", 90, 32)
BF = "*bf16"


def instructions(ptx: str) -> str:
    out = []
    for line in ptx.splitlines():
        if line.lstrip().startswith((".loc", ".file", "//", "$L__")):
            continue
        if ".debug_" in line:
            break
        out.append(re.sub(r"\$L__\w+", "L", line))
    return "\n".join(out)


def compiled(fn, types: dict, consts: dict, num_warps: int, num_stages: int) -> tuple[str, int]:
    sig = {a: ("constexpr" if a in consts else types.get(a, "i32")) for a in fn.arg_names}
    k = triton.compile(ASTSource(fn, sig, constexprs=consts), target=TARGET, options=dict(num_warps=num_warps, num_stages=num_stages))
    return hashlib.sha1(instructions(k.asm["ptx"]).encode()).hexdigest()[:12], k.metadata.shared


def main() -> None:
    variants = []
    for gated in (True, False):
        for track in (True, False):
            variants.append((f"decode_up g{gated:d} t{track:d}", decode._decode_up_kernel,
                             dict(pre_ptr=BF, x_ptr=BF, wu_ptr=BF, h_ptr=BF, unit_ptr="*i32", cnt_ptr="*i32", uc_ptr="*i32", nnz_ptr="*i32"),
                             dict(BM=16, BU=32, BK=256, GATED=gated, TRACK=track, PREC="tf32"), 4, 3))
            for cfg in decode_fused.FUSED_CONFIGS.values():
                BU, BK, BD, nw, ns = cfg[:5]
                args = decode_fused._decode_fused_kernel.arg_names
                extra = {"ALL_ROWS": False} if "ALL_ROWS" in args else {}  # before 2026-12-01 s4
                extra.update({"GDC": False} if "GDC" in args else {})  # from 2026-12-01 s6
                variants.append((f"decode_fused g{gated:d} t{track:d} bu{BU}", decode_fused._decode_fused_kernel,
                                 dict(x_ptr=BF, wf_ptr=BF, wu_ptr=BF, wd_ptr=BF, acc_ptr="*fp32", counts_ptr="*i32", uc_ptr="*i32", nnz_ptr="*i32"),
                                 dict(BM=16, BU=BU, BK=BK, BD=BD, GATED=gated, TRACK=track, PREC="tf32", **extra), nw, ns))
            if hasattr(decode_fused, "_decode_gemv_kernel"):  # from 2026-12-01 s6
                for m, cfg in decode_fused.GEMV_CONFIGS.items():  # each shape at the largest M it serves
                    BM = triton.next_power_of_2(m)
                    variants.append((f"decode_gemv g{gated:d} t{track:d} bm{BM}", decode_fused._decode_gemv_kernel,
                                     dict(x_ptr=BF, wf_ptr=BF, wu_ptr=BF, wd_ptr=BF, acc_ptr="*fp32", counts_ptr="*i32", uc_ptr="*i32", nnz_ptr="*i32"),
                                     dict(BM=BM, BU=cfg.BU, BK=cfg.BK, GATED=gated, TRACK=track, GDC=True), cfg.num_warps, cfg.num_stages))
    for tile in (128, 256):
        variants.append((f"gate_pack_fused tile{tile}", gate_pack._gate_pack_kernel,
                         dict(x_ptr=BF, w_ptr=BF, val_ptr=BF, col_ptr="*i16", cnt_ptr="*i32"),
                         dict(BM=128, TILE=tile, BK=64, GROUP_M=8, PREC="tf32"), 8, 3))
        for pack in (True, False):
            variants.append((f"gate_pack_persistent tile{tile} pack{pack:d}", gate_pack._gate_pack_persistent_kernel,
                             dict(x_desc="tensordesc<bf16[128,64]>", w_desc=f"tensordesc<bf16[{tile},64]>", val_ptr=BF,
                                  col_ptr="*i16", cnt_ptr="*i32", out_ptr=BF),
                             dict(BM=128, TILE=tile, BK=64, GROUP_M=8, PACK=pack, PREC="tf32"), 8, 3))
    if heavy_rows is not None:
        for dtype, ieee in ((BF, False), ("*fp32", True)):
            # where the precision is a PREC string (twell.kernels._dot)
            prec = {"PREC": "ieee" if ieee else "tf32"} if "PREC" in heavy_rows._heavy_up_kernel.arg_names else {"IEEE": ieee}
            for gated in (True, False):
                variants.append((f"heavy_up {dtype[1:]} g{gated:d}", heavy_rows._heavy_up_kernel,
                                 dict(x_ptr=dtype, a_ptr=dtype, wu_ptr=dtype, idx_ptr="*i64", n_ptr="*i64", l1_ptr="*fp32", cnt_ptr="*i32"),
                                 dict(GATED=gated, BM=64, BN=128, BK=64, **prec), 4, 3))
            variants.append((f"heavy_down {dtype[1:]}", heavy_rows._heavy_down_kernel,
                             dict(h_ptr=dtype, wd_ptr=dtype, y_ptr=dtype, idx_ptr="*i64", n_ptr="*i64"),
                             dict(BM=64, BD=128, BK=64, **prec), 4, 3))
    if decode_split is not None and hasattr(decode_split, "_fire_gate_kernel"):  # the shipped shape, PDL
        c = decode_split.SPLIT_CONFIG
        T = decode_split.SPLIT_MAX_M

        def stages(rows: int, size: int) -> int:  # as the launcher takes them on the H200 (232448 bytes of shared memory)
            return max(1, min(c.num_stages, (232448 - 8192) // ((c.BU + rows) * c.BK * size)))

        for dtype, prec, size in ((BF, "tf32", 2), ("*fp16", "tf32", 2), ("*fp32", "ieee", 4)):
            for rows in (16, 64):
                for track, gated in ((True, True), (False, True), (False, False)):
                    ns = stages(rows, size)
                    descs = (False,)
                    types = dict(x_ptr=dtype, wf_ptr=dtype, wu_ptr=dtype, wd_ptr=dtype, entry_ptr="*i32", gate_ptr=dtype,
                                 count_ptr="*i32", acc_ptr="*fp32", counts_ptr="*i32", uc_ptr="*i32", nnz_ptr="*i32")
                    if "DESC" in decode_split._fire_gate_kernel.arg_names:  # gate loads through tensor descriptors
                        descs = (False, True)
                    for desc in descs:
                        extra, tys = ({"DESC": desc}, dict(types)) if len(descs) == 2 else ({}, types)
                        if extra:
                            el = dtype[1:]
                            tys.update(x_desc=f"tensordesc<{el}[{rows},{c.BK}]>", w_desc=f"tensordesc<{el}[{c.BU},{c.BK}]>")
                            if not desc:
                                tys.update(x_desc=dtype, w_desc=dtype)
                        variants.append((f"fire_gate {dtype[1:]} r{rows} t{track:d} g{gated:d}" + (f" desc{desc:d}" if extra else ""),
                                         decode_split._fire_gate_kernel, tys,
                                         dict(ROWS=rows, BU=c.BU, BK=c.BK, TOK=T, GATED=gated, TRACK=track, PREC=prec, GDC=True,
                                              **extra),
                                         c.num_warps, ns))
            for gated in (True, False):
                for one in (True, False):
                    variants.append((f"fire_updown {dtype[1:]} g{gated:d} one{one:d}", decode_split._fire_updown_kernel,
                                     dict(x_ptr=dtype, wu_ptr=dtype, wd_ptr=dtype, entry_ptr="*i32", gate_ptr=dtype,
                                          count_ptr="*i32", acc_ptr="*fp32"),
                                     dict(BD=2048, ONE_STEP=one, TOK=T, GATED=gated, GDC=True), c.updown_warps, 3))
    if decode_split is not None:
        args = decode_fused._write_out_reset_kernel.arg_names
        extra = {"TOK": 64, "PER_TOKEN": False} if "PER_TOKEN" in args else {}  # with the per-token lists
        variants.append(("write_out_reset bf16", decode_fused._write_out_reset_kernel,
                         dict(acc_ptr="*fp32", y_ptr=BF, count_ptr="*i32"), dict(BLOCK=1024, GDC=True, **extra), 4, 3))
    for name, fn, types, consts, nw, ns in variants:
        digest, shared = compiled(fn, types, consts, nw, ns)
        print(f"{name:40s} {digest}  shared {shared} B")


if __name__ == "__main__":
    main()

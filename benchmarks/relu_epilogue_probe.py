"""Gate with the ReLU in cuBLASLt's epilogue (torch._addmm_activation) against mm + relu_, bf16,
d 2048, f 5632, M 1 to 64: GPU time in CUDA graphs (L2 flushed), host time, and equality.
Usage (GPU): python benchmarks/relu_epilogue_probe.py"""

import torch

from twell.bench.timing import graph_ms, host_us

d, f = 2048, 5632
w = torch.randn(f, d, device="cuda", dtype=torch.bfloat16) * 0.02
zero = torch.zeros(f, device="cuda", dtype=torch.bfloat16)
print("M   mm+relu_ us  fused us   host mm+relu_  host fused  max |diff|")
for M in (1, 4, 16, 64):
    x = torch.randn(M, d, device="cuda", dtype=torch.bfloat16)
    plain = lambda: torch.nn.functional.linear(x, w).relu_()  # noqa: E731
    fused = lambda: torch._addmm_activation(zero, x, w.t(), beta=0)  # noqa: E731
    diff = float((plain().float() - fused().float()).abs().max())
    print(f"{M:<4d}{graph_ms(plain) * 1e3:11.1f}{graph_ms(fused) * 1e3:10.1f}{host_us(plain):15.1f}{host_us(fused):12.1f}  {diff:.3g}")

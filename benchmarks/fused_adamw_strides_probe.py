"""Does fused AdamW pair elements correctly when a state tensor's strides differ from its
parameter's? (twell.optim_layout re-lays out such state before each step because on the CPU,
torch 2.13, it silently does not.) Here on CUDA, with no twell module built, so no hook runs.

    python benchmarks/fused_adamw_strides_probe.py

Prints, for fused and foreach AdamW, the largest difference after two steps between a parameter
whose state was made contiguous and one whose state has the parameter's (transposed) strides."""

import torch


def run(impl: str, mismatched: bool, device: str) -> torch.Tensor:
    torch.manual_seed(0)
    d, f = 8, 24
    w = torch.nn.Parameter(torch.randn(f, d, device=device).t())  # [d, f], strides (1, d)
    opt = torch.optim.AdamW([w], lr=0.1, **{impl: True})
    grads = [torch.randn(d, f, device=device) for _ in range(2)]
    w.grad = torch.empty_like(w).copy_(grads[0])
    opt.step()
    if mismatched:
        for k, v in opt.state[w].items():
            if v.dim() == 2:
                opt.state[w][k] = v.contiguous()  # same values, the nn.Linear layout
    w.grad = torch.empty_like(w).copy_(grads[1])
    opt.step()
    return w.detach().cpu()


for device in ["cuda"] if torch.cuda.is_available() else ["cpu"]:
    for impl in ("fused", "foreach"):
        ref = run("foreach", False, device)
        same = run(impl, False, device)
        mixed = run(impl, True, device)
        print(f"{device} {impl}: matched strides max|diff| {float((same - ref).abs().max()):.3g}, "
              f"state contiguous, parameter transposed max|diff| {float((mixed - ref).abs().max()):.3g}")

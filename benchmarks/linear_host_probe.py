"""Host and GPU time of the single products the small-batch dense path issues (M = 1, bf16, d 2048,
f 5632): down with its weight contiguous or stored transposed (eval layout), gate alone, gate and up
stacked. python benchmarks/linear_host_probe.py"""
import torch, torch.nn.functional as F
from twell.bench.timing import host_us, graph_ms, alternating
d,f=2048,5632
h=torch.randn(1,f,device="cuda",dtype=torch.bfloat16); x=torch.randn(1,d,device="cuda",dtype=torch.bfloat16)
wd=torch.randn(d,f,device="cuda",dtype=torch.bfloat16); wdt=wd.t().contiguous().t()
wg=torch.randn(f,d,device="cuda",dtype=torch.bfloat16); wgu=torch.randn(2*f,d,device="cuda",dtype=torch.bfloat16)
with torch.no_grad():
    fns={"linear_down_contig":lambda: F.linear(h,wd),"linear_down_transposed":lambda: F.linear(h,wdt),"linear_gate":lambda: F.linear(x,wg),"linear_gate_up_stacked":lambda: F.linear(x,wgu)}
    hs=alternating(host_us, list(fns.values()), rounds=5)
    gs=alternating(graph_ms, list(fns.values()), rounds=3)
    for (n,_),a,b in zip(fns.items(),hs,gs): print(f"{n:26s} host {a:6.1f} us  graph {b*1e3:6.1f} us")

"""The fused ``relu(g) * u`` of the dense inference branch against PyTorch's two passes."""

from __future__ import annotations

import pytest
import torch

from twell.kernels.elementwise import relu_mul_


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(1, 1), (7, 300), (3, 4097)])  # not a multiple of the block
def test_relu_mul_matches_torch(dtype, shape):
    g = torch.randn(shape).to(dtype)
    u = torch.randn(shape).to(dtype)
    g.view(-1)[0] = float("nan")  # relu keeps NaN
    g.view(-1)[-1] = 0.0
    want = torch.relu(g) * u
    got = relu_mul_(u.clone(), g)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(want))


def test_relu_mul_in_place_and_validation():
    g, u = torch.randn(4, 8), torch.randn(4, 8)
    assert relu_mul_(u, g) is u
    with pytest.raises(ValueError, match="must match"):
        relu_mul_(torch.randn(4, 8), torch.randn(4, 9))
    with pytest.raises(ValueError, match="contiguous"):
        relu_mul_(torch.randn(8, 4).T, torch.randn(4, 8))
    with pytest.raises(TypeError, match="dtype"):
        relu_mul_(torch.zeros(4, dtype=torch.int32), torch.zeros(4, dtype=torch.int32))


@pytest.mark.gpu
def test_relu_mul_gpu_bf16_bit_identical():
    g = torch.randn(4099, 5632, device="cuda", dtype=torch.bfloat16)
    u = torch.randn(4099, 5632, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(relu_mul_(u.clone(), g), torch.relu(g) * u)

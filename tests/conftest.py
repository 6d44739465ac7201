"""Test setup shared by every test.

- Without a GPU, Triton kernels run under the interpreter: TRITON_INTERPRET must be set before
  Triton compiles anything, so it is set here, before any test module imports twell.
- Memory that twell allocates with torch.empty/empty_like/new_empty comes back filled with NaN
  (floats) or a large sentinel (integers), so that a kernel which leaves an element unwritten,
  or reads a slot nobody wrote, fails the test instead of passing on lucky zeros.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _poison(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point() or t.is_complex():
        return t.fill_(float("nan"))
    if t.dtype == torch.bool:
        return t.fill_(True)
    return t.fill_(torch.iinfo(t.dtype).max // 3)


@pytest.fixture(autouse=True)
def nan_filled_empty(monkeypatch):
    real_empty, real_empty_like, real_new_empty = torch.empty, torch.empty_like, torch.Tensor.new_empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: _poison(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: _poison(real_empty_like(*a, **k)))
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda self, *a, **k: _poison(real_new_empty(self, *a, **k)))
    yield


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

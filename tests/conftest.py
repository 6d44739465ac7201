"""Test setup shared by every test.

- Without a GPU, Triton kernels run under the interpreter: TRITON_INTERPRET must be set before
  Triton compiles anything, so it is set here, before any test module imports twell.
- Without a GPU, torch runs on one intra-op thread (unless OMP_NUM_THREADS says otherwise): the
  tests' tensors are tiny, and on a 2-core machine shared with another busy process two OpenMP
  threads wait for each other at every op (measured: the training tests took 55 to 67 s instead
  of 15 s; alone on the machine, the same with one thread or two).
- The tests named in ``slow_tests.txt`` are marked ``slow``; ``python -m pytest -q`` skips them
  and ``python -m pytest -q -m "slow or not slow"`` (the full suite, as CI runs it) does not.
- Memory that twell allocates with torch.empty/empty_like/new_empty comes back filled with NaN
  (floats) or a large sentinel (integers), so that a kernel which leaves an element unwritten,
  or reads a slot nobody wrote, fails the test instead of passing on lucky zeros.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)


def _poison(t: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():  # torch.empty(..., requires_grad=True) (torch.utils.checkpoint makes one) too
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


SLOW = {line.strip() for line in open(os.path.join(os.path.dirname(__file__), "slow_tests.txt"))
        if line.strip() and not line.startswith("#")}


@pytest.hookimpl(tryfirst=True)  # before -m selects on the marks
def pytest_collection_modifyitems(config, items):
    # the tests listed in slow_tests.txt are marked slow: the default run (pyproject's addopts,
    # -m "not slow") skips them; -m "slow or not slow" runs everything
    for item in items:
        if item.nodeid in SLOW:
            item.add_marker(pytest.mark.slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

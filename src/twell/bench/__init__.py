"""Benchmarks of the twell kernels against dense PyTorch (run with ``twell bench``)."""

"""twell: sparse feed-forward blocks for transformer language models.

ReLU-gated FFNs trained with an L1 penalty keep a few dozen of thousands of hidden units
active per token; twell stores those activations in sparse formats (TwELL for inference, a
hybrid ELL + dense backup for training) and runs the FFN from them.
"""

from .format import Hybrid, TwELL, pack_hybrid, pack_twell, unpack_hybrid, unpack_twell
from .hf import sparsify
from .nn import SparseGatedMLP, SparseMLP, SparsityStats, l1_loss, sparse_modules

__version__ = "0.1.0"

__all__ = [
    "TwELL",
    "Hybrid",
    "pack_twell",
    "unpack_twell",
    "pack_hybrid",
    "unpack_hybrid",
    "SparseGatedMLP",
    "SparseMLP",
    "SparsityStats",
    "l1_loss",
    "sparse_modules",
    "sparsify",
]

"""Sparse formats for FFN hidden activations, in plain PyTorch.

Two formats, both lossless for every input:

TwELL (tile-wise ELLPACK), for inference
    The hidden matrix ``h [M, f]`` is cut into tiles of ``tile`` consecutive columns (the
    N-width of the gate matmul's output tile). Every (row, tile) keeps its true non-zero
    count and up to ``slots = tile // compression - 1`` entries (value, column within the
    tile), in ascending column order. This is the layout a gate matmul can write in its
    epilogue, tile by tile, with no pass over a dense ``[M, f]`` matrix.

    A (row, tile) with more non-zeros than slots *overflows*. Nothing is lost: its count is
    still the true count (so ``counts > slots`` marks it), and either ``overflow_values``
    holds the whole dense tile (the pure PyTorch pack keeps it) or, when the format was written
    by the gate kernel, the tile is recomputed exactly from ``x`` and ``w_gate`` by whoever
    consumes it (see :func:`twell.reference.gate_tile`).

Hybrid (ELL rows + dense backup), for training
    Rows with at most ``width`` non-zeros are stored as ELL rows (values and global column
    indices); every heavier row is stored densely in a backup block whose size is the actual
    number of heavy rows: there is no capacity to overflow and nothing is ever dropped.
    :meth:`Hybrid.transpose` gives the same matrix as ``[f, M]``, which the backward pass needs
    (per-unit access for the weight gradients).

Shapes use ``M`` for tokens (rows) and ``f`` for hidden units (columns).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

__all__ = [
    "TwELL",
    "Hybrid",
    "pack_twell",
    "unpack_twell",
    "pack_hybrid",
    "unpack_hybrid",
    "twell_slots",
]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def twell_slots(tile: int, compression: int) -> int:
    """Entries kept per (row, tile): ``tile // compression - 1`` (one word holds the count)."""
    _check_tile(tile, compression)
    return tile // compression - 1


def _check_tile(tile: int, compression: int) -> None:
    # ints only: 8.0 == 8 would pass a membership test and break the shapes made from it
    if isinstance(compression, bool) or not isinstance(compression, int) or compression not in (2, 4, 8):
        raise ValueError(f"compression must be 2, 4 or 8, got {compression!r}")
    if isinstance(tile, bool) or not isinstance(tile, int) or tile < 2 * compression or tile & (tile - 1):
        raise ValueError(
            f"tile must be a power of two of at least 2 * compression = {2 * compression} "
            f"(so that a tile keeps at least one slot), got {tile}"
        )
    if tile > 32768:
        raise ValueError(f"tile must be at most 32768 (columns are int16 inside a tile), got {tile}")


def _check_hidden(h: torch.Tensor, name: str = "h") -> None:
    if not isinstance(h, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(h).__name__}")
    if h.dim() != 2:
        raise ValueError(f"{name} must be 2-D [M, f], got shape {tuple(h.shape)}")
    if h.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {h.dtype}")
    if h.is_meta:
        raise ValueError(f"{name} is on the meta device (shapes only, no data): packing needs its values")


# ---------------------------------------------------------------------------------------------
# TwELL
# ---------------------------------------------------------------------------------------------


@dataclass
class TwELL:
    """A hidden matrix ``[M, f]`` in tile-wise ELLPACK form.

    Attributes:
        values: ``[M, n_tiles, slots]`` the non-zero values of each (row, tile), in ascending
            column order; slots at or past ``counts`` are unspecified (never read them).
        cols: ``[M, n_tiles, slots]`` int16, the column of each value *within its tile*
            (global column = ``tile_index * tile + cols``).
        counts: ``[M, n_tiles]`` int32, the true number of non-zeros of each (row, tile);
            ``counts > slots`` marks an overflowed tile.
        f: number of columns of the dense matrix (the last tile may be partial).
        tile: tile width ``T`` (columns per tile).
        compression: ``C``; ``slots = T // C - 1``.
        overflow_index: ``[n_over]`` int64 flat indices ``row * n_tiles + tile`` of overflowed
            tiles, ascending, or None.
        overflow_values: ``[n_over, T]`` the dense content of those tiles, or None when they
            are to be recomputed from the gate (kernel-written TwELL).
    """

    values: torch.Tensor
    cols: torch.Tensor
    counts: torch.Tensor
    f: int
    tile: int
    compression: int
    overflow_index: Optional[torch.Tensor] = None
    overflow_values: Optional[torch.Tensor] = None

    @property
    def shape(self) -> tuple[int, int]:
        return (self.values.shape[0], self.f)

    @property
    def n_tiles(self) -> int:
        return self.counts.shape[1]

    @property
    def slots(self) -> int:
        return self.values.shape[2]

    def overflowed(self) -> torch.Tensor:
        """``[M, n_tiles]`` bool: the (row, tile) pairs whose non-zeros did not fit the slots."""
        return self.counts > self.slots

    def nnz_per_row(self) -> torch.Tensor:
        """``[M]`` int64: true number of non-zeros of each row (overflowed tiles included)."""
        return self.counts.sum(dim=1, dtype=torch.int64)

    def validate(self) -> None:
        """Raise ValueError if the fields are inconsistent with each other."""
        M, n_tiles, slots = self.values.shape
        if self.cols.shape != self.values.shape or self.cols.dtype != torch.int16:
            raise ValueError(f"cols must be int16 {tuple(self.values.shape)}, got {self.cols.dtype} {tuple(self.cols.shape)}")
        if self.counts.shape != (M, n_tiles) or self.counts.dtype != torch.int32:
            raise ValueError(f"counts must be int32 [{M}, {n_tiles}], got {self.counts.dtype} {tuple(self.counts.shape)}")
        if slots != twell_slots(self.tile, self.compression):
            raise ValueError(f"values has {slots} slots, expected tile // compression - 1 = {twell_slots(self.tile, self.compression)}")
        if n_tiles != math.ceil(self.f / self.tile):
            raise ValueError(f"{n_tiles} tiles cannot hold f = {self.f} columns with tile = {self.tile}")
        if (self.overflow_values is None) != (self.overflow_index is None):
            raise ValueError("overflow_index and overflow_values must both be set or both be None")
        if self.overflow_values is not None:
            expected = torch.nonzero(self.overflowed().flatten()).flatten()
            if not torch.equal(self.overflow_index.cpu(), expected.cpu()):
                raise ValueError("overflow_index does not list exactly the overflowed tiles")
            if self.overflow_values.shape != (expected.numel(), self.tile):
                raise ValueError(f"overflow_values must be [{expected.numel()}, {self.tile}], got {tuple(self.overflow_values.shape)}")


def pack_twell(h: torch.Tensor, tile: int = 256, compression: int = 8) -> TwELL:
    """Pack a dense hidden matrix into TwELL, losslessly.

    Args:
        h: ``[M, f]`` float tensor (zeros are dropped). Any M and f; f need not be a multiple
            of ``tile`` (the last tile is padded with zeros).
        tile: tile width T, a power of two (256 matches the gate kernel's output tile).
        compression: C in {2, 4, 8}; each (row, tile) keeps ``T // C - 1`` entries.

    Returns:
        :class:`TwELL` with ``values [M, n_tiles, slots]``, ``cols``, ``counts [M, n_tiles]``
        and the dense copies of overflowed tiles in ``overflow_index``/``overflow_values``.

    Example:
        >>> h = torch.relu(torch.randn(5, 40))
        >>> t = pack_twell(h, tile=16, compression=4)
        >>> torch.equal(unpack_twell(t), h)
        True
    """
    _check_hidden(h)
    _check_tile(tile, compression)
    M, f = h.shape
    slots = twell_slots(tile, compression)
    n_tiles = math.ceil(f / tile)
    padded = h.new_zeros(M, n_tiles * tile)
    padded[:, :f] = h
    tiles = padded.view(M, n_tiles, tile)
    nonzero = tiles != 0
    counts = nonzero.sum(dim=2, dtype=torch.int32)
    # Rank of each non-zero within its tile (0, 1, ...); a stable sort of "is zero" brings the
    # non-zeros to the front in ascending column order.
    order = torch.sort((~nonzero).to(torch.int8), dim=2, stable=True).indices
    first = order[:, :, :slots]
    keep = torch.arange(slots, device=h.device) < counts.unsqueeze(-1)
    values = torch.where(keep, torch.gather(tiles, 2, first), torch.zeros((), dtype=h.dtype, device=h.device))
    cols = torch.where(keep, first, torch.zeros((), dtype=first.dtype, device=h.device)).to(torch.int16)
    over = (counts > slots).flatten()
    overflow_index = torch.nonzero(over).flatten()
    overflow_values = tiles.reshape(M * n_tiles, tile)[overflow_index].clone()
    return TwELL(values, cols, counts, f, tile, compression, overflow_index, overflow_values)


def unpack_twell(t: TwELL) -> torch.Tensor:
    """Dense ``[M, f]`` matrix of a TwELL. Needs the overflow tiles' values when any overflowed
    (kernel-written TwELL: rebuild them with :func:`twell.reference.fill_overflow` first)."""
    if not isinstance(t, TwELL):
        raise TypeError(f"t must be a twell.TwELL, got {type(t).__name__}")
    M, n_tiles, slots = t.values.shape
    over = t.overflowed()
    if t.overflow_values is None and bool(over.any()):
        raise ValueError(
            "this TwELL has overflowed tiles but no overflow_values; recompute them from the "
            "gate with twell.reference.fill_overflow(t, x, w_gate) before unpacking"
        )
    tiles = t.values.new_zeros(M, n_tiles, t.tile)
    keep = torch.arange(slots, device=t.values.device) < t.counts.clamp(max=slots).unsqueeze(-1)
    # Overflowed tiles come whole from overflow_values below; their slots are never read (a
    # kernel-written TwELL leaves them unwritten: a column read there could be out of the tile).
    keep &= ~over.unsqueeze(-1)
    src = torch.where(keep, t.values, torch.zeros((), dtype=t.values.dtype, device=t.values.device))
    # Unused slots (whatever they hold) become a zero added to column 0: adding, not
    # assigning, so that they can never overwrite a real entry of that column.
    tiles.scatter_add_(2, torch.where(keep, t.cols.long(), 0), src)
    if t.overflow_values is not None and t.overflow_index.numel():
        tiles.view(M * n_tiles, t.tile)[t.overflow_index] = t.overflow_values
    return tiles.view(M, n_tiles * t.tile)[:, : t.f].contiguous()


# ---------------------------------------------------------------------------------------------
# Hybrid ELL + dense backup
# ---------------------------------------------------------------------------------------------


@dataclass
class Hybrid:
    """A sparse matrix ``[n_rows, n_cols]`` as ELL rows plus a dense backup for heavy rows.

    Attributes:
        values: ``[n_rows, width]`` non-zero values of light rows (ascending column order);
            slots at or past ``counts`` and all slots of heavy rows are zero.
        cols: ``[n_rows, width]`` int32 global column indices (0 in unused slots).
        counts: ``[n_rows]`` int32 true non-zeros per row; ``counts > width`` marks heavy rows.
        heavy_rows: ``[n_heavy]`` int64 ascending indices of the heavy rows.
        heavy_values: ``[n_heavy, n_cols]`` their dense content. ``n_heavy`` is whatever the
            input needs: there is no fixed capacity.
        n_cols: number of columns.
    """

    values: torch.Tensor
    cols: torch.Tensor
    counts: torch.Tensor
    heavy_rows: torch.Tensor
    heavy_values: torch.Tensor
    n_cols: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.values.shape[0], self.n_cols)

    @property
    def width(self) -> int:
        return self.values.shape[1]

    def heavy(self) -> torch.Tensor:
        """``[n_rows]`` bool: rows stored in the dense backup."""
        return self.counts > self.width

    def to_coo(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(rows, cols, values)`` of every stored non-zero, rows ascending then columns."""
        n_rows, width = self.values.shape
        light = torch.arange(width, device=self.values.device) < self.counts.unsqueeze(1)
        light &= ~self.heavy().unsqueeze(1)
        r_l, s_l = torch.nonzero(light, as_tuple=True)
        rows, cols, vals = r_l, self.cols[r_l, s_l].long(), self.values[r_l, s_l]
        if self.heavy_rows.numel():
            hr, hc = torch.nonzero(self.heavy_values, as_tuple=True)
            rows = torch.cat([rows, self.heavy_rows[hr]])
            cols = torch.cat([cols, hc])
            vals = torch.cat([vals, self.heavy_values[hr, hc]])
            key = torch.sort(rows * self.n_cols + cols).indices
            rows, cols, vals = rows[key], cols[key], vals[key]
        return rows, cols, vals

    def transpose(self, width: Optional[int] = None) -> "Hybrid":
        """The same matrix as ``[n_cols, n_rows]`` in hybrid form (ELL width ``width``,
        default the same). Built from the non-zeros alone: nothing dense of size
        ``[n_rows, n_cols]`` is formed unless the matrix is dense."""
        rows, cols, vals = self.to_coo()
        return hybrid_from_coo(cols, rows, vals, (self.n_cols, self.values.shape[0]), self.width if width is None else width)

    def validate(self) -> None:
        """Raise ValueError if the fields are inconsistent with each other."""
        n_rows, width = self.values.shape
        if self.cols.shape != (n_rows, width) or self.cols.dtype != torch.int32:
            raise ValueError(f"cols must be int32 [{n_rows}, {width}], got {self.cols.dtype} {tuple(self.cols.shape)}")
        if self.counts.shape != (n_rows,) or self.counts.dtype != torch.int32:
            raise ValueError(f"counts must be int32 [{n_rows}], got {self.counts.dtype} {tuple(self.counts.shape)}")
        expected = torch.nonzero(self.heavy()).flatten()
        if not torch.equal(self.heavy_rows.cpu(), expected.cpu()):
            raise ValueError("heavy_rows does not list exactly the rows with counts > width")
        if self.heavy_values.shape != (expected.numel(), self.n_cols):
            raise ValueError(f"heavy_values must be [{expected.numel()}, {self.n_cols}], got {tuple(self.heavy_values.shape)}")


def hybrid_from_coo(
    rows: torch.Tensor, cols: torch.Tensor, values: torch.Tensor, shape: tuple[int, int], width: int
) -> Hybrid:
    """Build a :class:`Hybrid` from coordinates of distinct non-zeros (any order).

    Args:
        rows, cols: ``[nnz]`` integer coordinates; values: ``[nnz]``.
        shape: ``(n_rows, n_cols)``; width: ELL width W (rows with more non-zeros go dense).
    """
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise ValueError(f"width must be an int >= 1, got {width!r}")
    n_rows, n_cols = shape
    for name, t in (("rows", rows), ("cols", cols), ("values", values)):
        if t.dim() != 1 or t.numel() != values.numel() or t.device != values.device:
            raise ValueError(f"rows, cols and values must be 1-D of one length on one device, got {name} "
                             f"{tuple(t.shape)} on {t.device} (values {tuple(values.shape)} on {values.device})")
    for name, t in (("rows", rows), ("cols", cols)):
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise ValueError(f"{name} must be integer coordinates, got {t.dtype}")
    # An index past the shape would land in another row's slots or the wrong backup column.
    # (A check on the data: one sync, as the bincount below needs anyway.)
    if rows.numel() and bool(((rows < 0) | (rows >= n_rows) | (cols < 0) | (cols >= n_cols)).any()):
        name, t, n = ("rows", rows, n_rows) if bool(((rows < 0) | (rows >= n_rows)).any()) else ("cols", cols, n_cols)
        raise ValueError(f"{name} must lie in [0, {n}) for shape {tuple(shape)}, got [{int(t.min())}, {int(t.max())}]")
    device, dtype = values.device, values.dtype
    rows, cols = rows.long(), cols.long()
    order = torch.sort(rows * n_cols + cols).indices
    rows, cols, values = rows[order], cols[order], values[order]
    counts = torch.bincount(rows, minlength=n_rows).to(torch.int32)
    starts = torch.cumsum(counts, 0, dtype=torch.int64) - counts
    rank = torch.arange(rows.numel(), device=device) - starts[rows]
    heavy = counts > width
    light_nz = ~heavy[rows]
    ell_values = torch.zeros(n_rows, width, dtype=dtype, device=device)
    ell_cols = torch.zeros(n_rows, width, dtype=torch.int32, device=device)
    ell_values[rows[light_nz], rank[light_nz]] = values[light_nz]
    ell_cols[rows[light_nz], rank[light_nz]] = cols[light_nz].to(torch.int32)
    heavy_rows = torch.nonzero(heavy).flatten()
    # Position of each heavy row inside the backup block.
    slot_of_row = torch.cumsum(heavy.long(), 0) - 1
    heavy_values = torch.zeros(heavy_rows.numel(), n_cols, dtype=dtype, device=device)
    heavy_nz = ~light_nz
    heavy_values[slot_of_row[rows[heavy_nz]], cols[heavy_nz]] = values[heavy_nz]
    return Hybrid(ell_values, ell_cols, counts, heavy_rows, heavy_values, n_cols)


def pack_hybrid(h: torch.Tensor, width: int = 128) -> Hybrid:
    """Pack a dense matrix ``h [M, f]`` into hybrid form, losslessly.

    Rows with at most ``width`` non-zeros become ELL rows; heavier rows go to the dense backup,
    however many there are.

    Example:
        >>> h = torch.relu(torch.randn(6, 50))
        >>> torch.equal(unpack_hybrid(pack_hybrid(h, width=8)), h)
        True
    """
    _check_hidden(h)
    rows, cols = torch.nonzero(h, as_tuple=True)
    return hybrid_from_coo(rows, cols, h[rows, cols], tuple(h.shape), width)


def unpack_hybrid(hy: Hybrid) -> torch.Tensor:
    """Dense ``[n_rows, n_cols]`` matrix of a :class:`Hybrid`."""
    if not isinstance(hy, Hybrid):
        raise TypeError(f"hy must be a twell.Hybrid, got {type(hy).__name__}")
    rows, cols, vals = hy.to_coo()
    out = hy.values.new_zeros(hy.values.shape[0], hy.n_cols)
    out[rows, cols] = vals
    return out

"""The hybrid format's bookkeeping kernels (twell.kernels.train_index) against plain PyTorch:
light slots per unit, slot keys, the per-unit index, the heavy-row list and the hot units. CPU:
the Triton interpreter, with small blocks so that every grid and loop has more than one step;
GPU: the shipped blocks at a real shape. Outputs come from torch.empty, which the tests fill
with sentinels (conftest), so an element a kernel leaves unwritten fails."""

from __future__ import annotations

import pytest
import torch

import twell.kernels.train_index as TI

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(params=["small", "shipped"])
def blocks(request, monkeypatch):
    if request.param == "small":
        monkeypatch.setattr(TI, "_BLOCK", 16)
        monkeypatch.setattr(TI, "_STEP", 16)


def ell(M, W, f, seed, heavy_share=0.3, col_dtype=torch.int16):
    """Random ELL rows: each row's first slots hold distinct units, ``counts`` up to W + 3 (a
    share of the rows heavier than W), slots past the count hold junk units (the pack writes
    zeros there; junk shows a kernel that reads them)."""
    g = torch.Generator().manual_seed(seed)
    cols = torch.stack([torch.randperm(f, generator=g)[:W] for _ in range(M)]).to(col_dtype)
    counts = torch.randint(0, W + 1, (M,), generator=g, dtype=torch.int32)
    heavy = torch.rand(M, generator=g) < heavy_share
    counts[heavy] = W + 1 + torch.randint(0, 3, (int(heavy.sum()),), generator=g, dtype=torch.int32)
    return cols, counts


def used_slots(cols, counts):
    W = cols.shape[1]
    return (torch.arange(W) < counts.unsqueeze(1)) & (counts <= W).unsqueeze(1)


CASES = [(23, 6, 19, 0.3), (1, 4, 7, 0.0), (40, 5, 33, 1.0), (37, 16, 50, 0.0), (64, 3, 5, 0.5)]


@pytest.mark.parametrize("M,W,f,share", CASES)
def test_unit_counts_and_keys(blocks, M, W, f, share):
    cols, counts = ell(M, W, f, seed=M + W, heavy_share=share)
    used = used_slots(cols, counts)
    want = torch.bincount(cols[used].long(), minlength=f)
    got = TI.light_unit_counts(cols.to(DEV), counts.to(DEV), f).cpu()
    assert got.dtype == torch.int64 and torch.equal(got, want)
    exclude = torch.zeros(f, dtype=torch.bool)
    exclude[[0, f // 2]] = True
    p = torch.arange(M * W, dtype=torch.int32)
    for ex in (None, exclude):
        keep = used.flatten() & (True if ex is None else ~ex[cols.flatten().long()])
        want_key = torch.where(keep, cols.flatten().to(torch.int32), f + p % TI.TRASH_KEYS)
        key = TI.slot_keys(cols.to(DEV), counts.to(DEV), f, None if ex is None else ex.to(DEV)).cpu()
        assert key.dtype == TI.key_dtype(f) == torch.int16 and torch.equal(key.to(torch.int32), want_key)


@pytest.mark.parametrize("f", [32768 - TI.TRASH_KEYS, 32768 - TI.TRASH_KEYS + 1])
def test_keys_switch_to_int32_where_int16_cannot_hold_them(f):
    """At the largest f for 16-bit keys the last trash key is 32767; one unit more and they are
    int32. Units near f and trash keys near the top: a wrapped key would sort before the units."""
    M, W = 5, 3
    cols = torch.tensor([[f - 1, f - 2, 0]] * M, dtype=torch.int32)
    counts = torch.tensor([3, 1, 0, 4, 2], dtype=torch.int32)  # row 3 is heavy
    key = TI.slot_keys(cols.to(DEV), counts.to(DEV), f).cpu()
    assert key.dtype == (torch.int16 if f == 32768 - TI.TRASH_KEYS else torch.int32)
    p = torch.arange(M * W, dtype=torch.int32)
    want = torch.where(used_slots(cols, counts).flatten(), cols.flatten(), f + p % TI.TRASH_KEYS)
    assert torch.equal(key.to(torch.int32), want)
    order, offsets = TI.unit_index(cols.to(DEV), counts.to(DEV), f)
    order, offsets = order.cpu(), offsets.cpu()
    # unit 0: slot 2; unit f - 2: slots 1, 13; unit f - 1: slots 0, 3, 12 (row 3 heavy, row 2 empty)
    assert offsets[[0, 1, f - 2, f - 1, f]].tolist() == [0, 1, 1, 3, 6]
    assert order[:6].tolist() == [2, 1, 13, 0, 3, 12]


def test_unit_index_groups_slots_by_unit(blocks):
    """unit_index against a plain Python grouping, with heavy rows, padding and excluded units."""
    M, W, f = 29, 6, 19
    cols, counts = ell(M, W, f, seed=3)
    exclude = torch.zeros(f, dtype=torch.bool)
    exclude[[2, 7]] = True
    for ex in (None, exclude):
        order, offsets = TI.unit_index(cols.to(DEV), counts.to(DEV), f, None if ex is None else ex.to(DEV))
        order, offsets = order.cpu(), offsets.cpu()
        assert offsets.dtype == torch.int64 and offsets.shape == (f + 1,) and int(offsets[0]) == 0
        for j in range(f):
            want = [m * W + s for m in range(M) if counts[m] <= W for s in range(int(counts[m]))
                    if int(cols[m, s]) == j and (ex is None or not ex[j])]
            assert order[offsets[j]:offsets[j + 1]].tolist() == want, j
    per = TI.light_unit_counts(cols.to(DEV), counts.to(DEV), f).cpu()
    order, offsets = TI.unit_index(cols.to(DEV), counts.to(DEV), f)
    assert torch.equal(per, offsets.cpu().diff())


def reference_heavy_and_hot(counts, W, per_unit, hot_min, hot_factor):
    """The PyTorch ops the kernel replaced."""
    heavy_mask = counts > W
    heavy = torch.nonzero_static(heavy_mask, size=counts.shape[0], fill_value=0).flatten()
    limit = torch.clamp(per_unit.sum() * (hot_factor / max(per_unit.numel(), 1)), min=hot_min)
    hot = per_unit > limit
    info = torch.stack([heavy_mask.sum(dtype=torch.int64), hot.sum(dtype=torch.int64), torch.where(hot, per_unit, 0).sum()])
    return heavy, hot, info


@pytest.mark.parametrize("M,W,f,share", CASES + [(50, 4, 1, 0.5)])
def test_heavy_and_hot(blocks, M, W, f, share):
    cols, counts = ell(M, W, f, seed=M * W, heavy_share=share)
    g = torch.Generator().manual_seed(f)
    per_unit = torch.randint(0, 40, (f,), generator=g, dtype=torch.int64)
    per_unit[f // 3] = 400  # hot at factor 3 and min 16, unless f is tiny
    for hot_min, hot_factor in ((16.0, 3.0), (0.0, 1.0), (1e9, 8.0)):
        heavy, n_heavy, hot, info, _ = TI.heavy_and_hot(counts.to(DEV), W, per_unit.to(DEV), hot_min, hot_factor)
        want_heavy, want_hot, want_info = reference_heavy_and_hot(counts, W, per_unit, hot_min, hot_factor)
        assert torch.equal(heavy.cpu(), want_heavy) and torch.equal(hot.cpu(), want_hot)
        assert torch.equal(info.cpu(), want_info) and int(n_heavy) == int(want_info[0]) and n_heavy.dim() == 0


def reference_schedule_bins(per_unit, hot, M):
    """Each unit's class in the weight gradients' schedule: half octaves of its light slots s
    (s as fp32: s in [2^e, 2^(e+1)), the upper half from s^2 >= 2^(2e+1)), the most first;
    units with none next; hot units last. Classes above what M tokens allow (2 bit_length(M)
    half octaves) are merged into the top one."""
    s = per_unit.clamp(max=2**31 - 1)
    _, e = torch.frexp(s.float())  # s = m 2^e with m in [0.5, 1)
    e = (e.long() - 1).clamp(min=0, max=30)
    upper = s * s >= (torch.full_like(e, 2) << (2 * e))
    half = torch.where(per_unit > 0, 2 * e + 1 + upper.long(), 0)
    return torch.where(hot, 64, 63 - half.clamp(max=63)).clamp(min=63 - min(2 * max(M, 1).bit_length(), 63))


@pytest.mark.parametrize("f", [1, 7, 75, 300])
def test_schedule_is_a_permutation_longest_first(blocks, request, f):
    """The schedule lists every unit once, by class (the most light slots first by half octaves,
    then units with no slot, then hot units), in unit order within a class: PyTorch's stable sort
    of the classes. One program per class that M tokens allow: at M 2^20 (shipped blocks; counts
    cover 0, exact powers of two and their neighbours, and a unit with every token) 42 classes
    apart; at M 3 (small blocks, 16 units per step: f 75 and 300 take several) the counts above
    what 3 tokens allow, as no pack would give, are merged into the top class."""
    M = 3 if request.node.callspec.params["blocks"] == "small" else 1 << 20
    g = torch.Generator().manual_seed(f)
    per_unit = torch.randint(0, 300, (f,), generator=g, dtype=torch.int64)
    per_unit[torch.randperm(f, generator=g)[: f // 5]] = 0
    special = torch.tensor([1, 2, 3, 4, 7, 8, 63, 64, 65, 90, 91, 1 << 19, 1 << 20], dtype=torch.int64)
    per_unit[: min(f, special.numel())] = special[: min(f, special.numel())]
    for hot_min, hot_factor in ((1e12, 0.0), (200.0, 0.0), (16.0, 3.0)):
        counts = torch.zeros(M, dtype=torch.int32, device=DEV)
        _, _, hot, _, schedule = TI.heavy_and_hot(counts, 4, per_unit.to(DEV), hot_min, hot_factor)
        schedule = schedule.cpu()
        assert schedule.dtype == torch.int64 and schedule.shape == (f,)
        want = torch.sort(reference_schedule_bins(per_unit, hot.cpu(), M), stable=True).indices
        assert torch.equal(schedule, want)
        if hot_min == 200.0 and f > 13:  # (the hot units last)
            assert bool((per_unit[schedule[-int(hot.sum()):]] > 200).all())


def test_hot_limit_is_strict():
    """At exactly the limit a unit is not hot (here the limit is hot_min)."""
    per_unit = torch.zeros(4, dtype=torch.int64)
    per_unit[0], per_unit[1] = 256, 257
    _, _, hot, info, _ = TI.heavy_and_hot(torch.zeros(3, dtype=torch.int32, device=DEV), 16, per_unit.to(DEV), 256.0, 0.0)
    assert hot.cpu().tolist() == [False, True, False, False] and info.cpu().tolist() == [0, 1, 257]


def test_empty_and_bad_input():
    cols = torch.zeros(0, 4, dtype=torch.int16, device=DEV)
    counts = torch.zeros(0, dtype=torch.int32, device=DEV)
    assert torch.equal(TI.light_unit_counts(cols, counts, 5).cpu(), torch.zeros(5, dtype=torch.int64))
    heavy, n, hot, info, _ = TI.heavy_and_hot(counts, 4, torch.zeros(5, dtype=torch.int64, device=DEV), 1.0, 1.0)
    assert heavy.numel() == 0 and int(n) == 0 and not bool(hot.any()) and info.cpu().tolist() == [0, 0, 0]
    per_unit = torch.tensor([1000, 0, 3, 0, 0], dtype=torch.int64)  # no row, yet a hot unit: as PyTorch says
    heavy, n, hot, info, _ = TI.heavy_and_hot(counts, 4, per_unit.to(DEV), 16.0, 2.0)
    want = reference_heavy_and_hot(counts.cpu(), 4, per_unit, 16.0, 2.0)
    assert heavy.numel() == 0 and torch.equal(hot.cpu(), want[1]) and torch.equal(info.cpu(), want[2]) and bool(want[1][0])
    with pytest.raises(ValueError, match="counts must be"):
        TI.light_unit_counts(torch.zeros(3, 4, dtype=torch.int16, device=DEV), torch.zeros(3, dtype=torch.int64, device=DEV), 5)
    with pytest.raises(ValueError, match="cols must be"):
        TI.slot_keys(torch.zeros(3, 4, dtype=torch.float32, device=DEV), torch.zeros(3, dtype=torch.int32, device=DEV), 5)
    with pytest.raises(ValueError, match="exclude must be"):
        TI.slot_keys(torch.zeros(3, 4, dtype=torch.int16, device=DEV), torch.zeros(3, dtype=torch.int32, device=DEV), 5,
                     torch.zeros(4, dtype=torch.bool, device=DEV))
    with pytest.raises(ValueError, match="per_unit"):
        TI.heavy_and_hot(torch.zeros(3, dtype=torch.int32, device=DEV), 4, torch.zeros(5, dtype=torch.int32, device=DEV), 1.0, 1.0)


def test_heavy_row_in_the_last_step(blocks):
    """The heavy-row list's loop reaches its last step: M one past a step (and M 1), the only
    heavy row the last (a mutation round: a loop bound of M - 1 survived every other test)."""
    for M in (1, 17, 4097):
        counts = torch.zeros(M, dtype=torch.int32)
        counts[-1] = 5
        heavy, n, hot, info, _ = TI.heavy_and_hot(counts.to(DEV), 4, torch.zeros(3, dtype=torch.int64, device=DEV), 16.0, 3.0)
        assert int(n) == 1 and heavy.cpu().tolist() == [M - 1] + [0] * (M - 1) and info.cpu().tolist() == [1, 0, 0]


def test_no_units():
    """f = 0 (no unit): no row is heavy, no unit hot, and no division by f."""
    heavy, n, hot, info, _ = TI.heavy_and_hot(torch.zeros(5, dtype=torch.int32, device=DEV), 16,
                                           torch.zeros(0, dtype=torch.int64, device=DEV), 16.0, 3.0)
    assert heavy.cpu().tolist() == [0] * 5 and int(n) == 0 and hot.numel() == 0 and info.cpu().tolist() == [0, 0, 0]


@pytest.mark.gpu
def test_bookkeeping_at_a_real_shape():
    """M 16384, W 64, f 5632 with a tenth of the rows heavy: every output equals PyTorch's."""
    cols, counts = ell(16384, 64, 5632, seed=1, heavy_share=0.1)
    cols, counts = cols.cuda(), counts.cuda()
    used = used_slots(cols.cpu(), counts.cpu())
    per = TI.light_unit_counts(cols, counts, 5632)
    assert torch.equal(per.cpu(), torch.bincount(cols.cpu()[used].long(), minlength=5632))
    heavy, n, hot, info, schedule = TI.heavy_and_hot(counts, 64, per, 256.0, 8.0)
    want = reference_heavy_and_hot(counts, 64, per, 256.0, 8.0)
    assert torch.equal(heavy, want[0]) and torch.equal(hot, want[1]) and torch.equal(info, want[2])
    assert torch.equal(schedule, torch.sort(reference_schedule_bins(per, hot, 16384), stable=True).indices)


def test_slot_keys_refuse_an_exclude_mask_that_is_not_bool():
    """exclude is read as one byte per unit: an int8 or int64 mask is refused, not read as bytes
    (kills dropping the dtype from the check)."""
    cols = torch.zeros(3, 4, dtype=torch.int16, device=DEV)
    counts = torch.zeros(3, dtype=torch.int32, device=DEV)
    for dtype in (torch.int8, torch.int64):
        with pytest.raises(ValueError, match="exclude must be"):
            TI.slot_keys(cols, counts, 5, torch.zeros(5, dtype=dtype, device=DEV))

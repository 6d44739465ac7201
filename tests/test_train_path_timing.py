"""A layer's own timing of its two training paths (twell.training.path_timing): trials in turn,
the verdict, when it is dropped, and how twell.training.path.TrainPath uses it. CUDA events are
replaced by fakes whose clock advances by a set cost per path; the backward's events come from
hooks on a real autograd node."""

import pytest
import torch

from twell.training import path as train_path
from twell.training import path_timing
from twell.training.path import MIN_SPARSE_TOKENS, TrainPath
from twell.training.path_timing import DRIFT, MAX_TRIALS, SAMPLES, STALE_CALLS, TIMED_TOKENS, TrainTimer


class Clock:
    """Fake CUDA events: each record reads the clock and then advances it by the cost of the
    path being run (so a call's forward and backward each take that cost)."""

    def __init__(self, cost):
        self.now, self.cost, self.path = 0.0, cost, None

    def event(self):
        clock = self

        class Event:
            def record(self):
                self.t = clock.now
                clock.now += clock.cost[clock.path]

            def query(self):
                return True

            def elapsed_time(self, other):
                return other.t - self.t

        return Event()


def _call(timer, clock, tokens=4096, k=29.0, static="dense", backward=True):
    path, trial = timer.choose(tokens, k, static)
    clock.path = path
    x = torch.ones(3, requires_grad=True)
    if trial is not None:
        trial.forward_started()
    y = x * 2
    if trial is not None:
        trial.forward_done(y)
    if backward:
        y.sum().backward()
    return path, trial


@pytest.mark.parametrize("faster", ["sparse", "dense"])
def test_trials_alternate_then_the_faster_path_holds(faster):
    clock = Clock({"sparse": 1.0 if faster == "sparse" else 2.0, "dense": 1.0 if faster == "dense" else 2.0})
    timer = TrainTimer(event=clock.event)
    seen = [_call(timer, clock) for _ in range(2 + 2 * SAMPLES)]
    # a warm-up call of each path, untimed, then SAMPLES timed calls of each in turn
    assert [p for p, _ in seen] == ["sparse", "dense"] * (1 + SAMPLES)
    assert [t is None for _, t in seen] == [True, True] + [False] * (2 * SAMPLES)
    assert all(len(t.events) == 4 for _, t in seen[2:])  # forward and backward timed
    assert seen[2][1].ms_per_token() == pytest.approx(2 * clock.cost["sparse"] / 4096)
    for _ in range(5):
        path, trial = _call(timer, clock)
        assert (path, trial) == (faster, None)
    assert timer.verdict(4096) == faster and timer.verdict(5000) == faster  # one size class
    assert timer.verdict(2048) is None


def test_a_verdict_is_timed_again_when_the_sparsity_drifts_or_grows_old(monkeypatch):
    clock = Clock({"sparse": 1.0, "dense": 2.0})
    timer = TrainTimer(event=clock.event)
    for _ in range(2 + 2 * SAMPLES):
        _call(timer, clock)
    assert _call(timer, clock) == ("sparse", None)  # the verdict, made at this call's mean
    assert _call(timer, clock, k=29.0 * (1 + DRIFT) * 0.999) == ("sparse", None)  # within the drift
    clock.cost = {"sparse": 3.0, "dense": 2.0}  # the layer changed: sparse is now slower
    seen = [_call(timer, clock, k=29.0 * (1 + 2 * DRIFT)) for _ in range(3 + 2 * SAMPLES)]
    assert [t is None for _, t in seen[:2]] == [True, True]  # timed again from a fresh warm-up
    assert seen[-1] == ("dense", None) and timer.verdict(4096) == "dense"
    monkeypatch.setattr(path_timing, "RETIME_CALLS", 3)
    for _ in range(3):
        assert _call(timer, clock, k=29.0 * (1 + 2 * DRIFT)) == ("dense", None)
    assert _call(timer, clock, k=29.0 * (1 + 2 * DRIFT))[0] == "sparse"  # the 4th call after the verdict: a new trial


def test_without_trials_a_call_takes_the_verdict_or_the_static_rule():
    clock = Clock({"sparse": 1.0, "dense": 2.0})
    timer = TrainTimer(event=clock.event)
    assert timer.choose(4096, 29.0, "dense", trials=False) == ("dense", None)
    assert timer.choose(4096, 29.0, "sparse", trials=False) == ("sparse", None)
    for _ in range(2 + 2 * SAMPLES):
        _call(timer, clock)
    assert timer.choose(4096, 29.0, "dense", trials=False) == ("sparse", None)
    assert timer.choose(4096, 290.0, "dense", trials=False) == ("sparse", None)  # kept: only trials time again


def test_a_trial_whose_backward_never_runs_is_forgotten():
    clock = Clock({"sparse": 1.0, "dense": 2.0})
    timer = TrainTimer(event=clock.event)
    _call(timer, clock), _call(timer, clock)  # warm-ups
    path, trial = _call(timer, clock, backward=False)
    assert path == "sparse" and len(trial.events) == 2 and trial.ms_per_token() is None
    cls = trial.cls
    for _ in range(STALE_CALLS + 1):
        _call(timer, clock)
    assert trial not in cls.pending
    # a call whose output has no autograd node cannot be timed: not a trial
    timer = TrainTimer(event=clock.event)
    _call(timer, clock), _call(timer, clock)  # warm-ups
    path, trial = timer.choose(4096, 29.0, "dense")
    trial.forward_started()
    trial.forward_done(torch.ones(2))
    assert trial not in trial.cls.pending


def test_a_class_whose_timings_never_complete_stops_timing():
    clock = Clock({"sparse": 1.0, "dense": 2.0})
    timer = TrainTimer(event=clock.event)
    seen = [_call(timer, clock, static="dense", backward=False) for _ in range(200)]  # no backward ever runs
    timed = [i for i, (_, trial) in enumerate(seen) if trial is not None]
    assert 0 < len(timed) < MAX_TRIALS and {p for p, _ in seen[:2]} == {"sparse", "dense"}
    assert timer.verdict(4096) == "dense"  # the static rule's path, untimed, from then on
    assert all(s == ("dense", None) for s in seen[timed[-1] + 1:]) and timed[-1] < 100


def _measured(mean=29.0):
    class Landed:
        def query(self):
            return True

    tp = TrainPath()
    tp._host, tp._event = torch.tensor([mean, 2 * mean, 0.0]), Landed()
    return tp


def test_timed_choice_is_opt_in():
    assert path_timing.TIMED_CHOICE is False
    tp = _measured()
    assert tp.choose("auto", 5632, tokens=4096, timed=True) == ("dense", 64) and tp.timer is None


def test_train_path_times_calls_around_the_floor(monkeypatch):
    monkeypatch.setattr(path_timing, "TIMED_CHOICE", True)
    clock = Clock({"sparse": 1.0, "dense": 2.0})
    monkeypatch.setattr(path_timing, "TrainTimer", TrainTimer)
    monkeypatch.setattr(train_path, "TrainTimer", lambda: TrainTimer(event=clock.event))
    tp = _measured()
    tokens = TIMED_TOKENS[0]
    assert tokens < MIN_SPARSE_TOKENS
    # not timed (the default of choose: what a compiled module's op asks): the static floor
    assert tp.choose("auto", 5632, tokens=tokens) == ("dense", 64) and tp.trial is None
    paths = []
    for _ in range(2 + 2 * SAMPLES):
        path, width = tp.choose("auto", 5632, tokens=tokens, timed=True)
        paths.append((path, tp.trial is not None))
        clock.path = path
        if tp.trial is not None:
            x = torch.ones(2, requires_grad=True)
            tp.trial.forward_started()
            y = x * 2
            tp.trial.forward_done(y)
            y.sum().backward()
    assert paths == [("sparse", False), ("dense", False)] + [("sparse", True), ("dense", True)] * SAMPLES
    assert tp.choose("auto", 5632, tokens=tokens, timed=True) == ("sparse", 64) and tp.trial is None
    assert tp.choose("auto", 5632, tokens=tokens) == ("sparse", 64)  # the verdict, untimed callers too
    # a recomputation inside the backward takes the last forward's path
    monkeypatch.setattr(train_path, "_in_backward", lambda: True)
    assert tp.choose("auto", 5632, tokens=tokens, timed=True) == ("sparse", 64) and tp.trial is None


def test_train_path_times_nothing_outside_the_band_or_when_off(monkeypatch):
    monkeypatch.setattr(path_timing, "TIMED_CHOICE", True)
    tp = _measured()
    assert tp.choose("auto", 5632, tokens=TIMED_TOKENS[0] - 1, timed=True) == ("dense", 64)
    assert tp.choose("auto", 5632, tokens=TIMED_TOKENS[1], timed=True) == ("sparse", 64)
    assert tp.timer is None and tp.trial is None
    assert tp.choose("auto", 5632, tokens=4096, timed=True, capturing=True)[0] == "dense"
    assert tp.timer is None
    monkeypatch.setattr(path_timing, "TIMED_CHOICE", False)
    assert tp.choose("auto", 5632, tokens=4096, timed=True) == ("dense", 64) and tp.timer is None
    monkeypatch.setattr(path_timing, "TIMED_CHOICE", True)
    dense_layer = _measured(mean=300.0)  # the static rule trains it dense whatever the size: nothing to time
    assert dense_layer.choose("auto", 5632, tokens=4096, timed=True)[0] == "dense" and dense_layer.timer is None
    for mode in ("sparse", "dense"):
        assert tp.choose(mode, 5632, tokens=4096, timed=True)[0] == mode and tp.trial is None


@pytest.mark.gpu
def test_gpu_layer_times_its_paths_and_keeps_the_faster(monkeypatch):
    """A sparse-enough layer called with 4096 tokens (below the static floor) on CUDA times both
    paths over its first calls, then trains every call on the path its timing chose; the
    gradients are the dense math's on either."""
    from twell import SparseGatedMLP

    monkeypatch.setattr(path_timing, "TIMED_CHOICE", True)
    torch.manual_seed(0)
    m = SparseGatedMLP(64, 96).cuda()
    m.train()
    m.train_max_density = 1.0
    x = torch.randn(4096, 64, device="cuda", requires_grad=True)
    paths = []
    for _ in range(40):
        m(x).sum().backward()
        paths.append(m.last_train_path)
    torch.cuda.synchronize()
    state = m._twell_train
    assert state.path == "sparse" and {"sparse", "dense"} <= set(paths)
    verdict = state.timer.verdict(4096)
    assert verdict in ("sparse", "dense") and paths[-5:] == [verdict] * 5


def test_a_recomputation_takes_the_path_of_its_own_size(monkeypatch):
    """A layer called at two sizes before its backward (shared weights, say) recomputes each
    checkpointed forward on that forward's path: by the static rule for untimed sizes, by the
    timed choice where one was made."""
    monkeypatch.setattr(path_timing, "TIMED_CHOICE", True)
    tp = _measured()
    assert tp.choose("auto", 5632, tokens=MIN_SPARSE_TOKENS * 2, timed=True)[0] == "sparse"
    assert tp.choose("auto", 5632, tokens=1024, timed=True)[0] == "dense"
    assert tp.choose("auto", 5632, tokens=4096, timed=True)[0] == "sparse"  # the first timed call: a warm-up of sparse
    monkeypatch.setattr(train_path, "_in_backward", lambda: True)
    assert tp.choose("auto", 5632, tokens=MIN_SPARSE_TOKENS * 2)[0] == "sparse"
    assert tp.choose("auto", 5632, tokens=1024)[0] == "dense"
    assert tp.choose("auto", 5632, tokens=4096)[0] == "sparse"  # (the static rule would say dense)


class HostClock:
    """A fake host clock (seconds) that advances by a set cost (ms) per path at each reading."""

    def __init__(self, gpu_clock, cost):
        self.gpu, self.cost, self.now = gpu_clock, cost, 0.0

    def __call__(self):
        t = self.now
        self.now += self.cost[self.gpu.path] / 1e3
        return t


def _timed_forward(timer, clock):
    """``(path, trial, y)``: the first timed call's forward (after the two warm-ups), its
    backward left to the caller."""
    for _ in range(2):  # the warm-ups
        _call(timer, clock)
    path, trial = timer.choose(4096, 29.0, "dense")
    clock.path = path
    x = torch.ones(3, requires_grad=True)
    trial.forward_started()
    y = x * 2
    trial.forward_done(y)
    return path, trial, y


def test_the_hosts_time_counts_where_it_exceeds_the_gpus():
    """A path whose kernels are quicker but whose host work is longer than the other's whole
    call loses: the events alone (GPU behind the host) would have picked it."""
    clock = Clock({"sparse": 1.0, "dense": 2.0})
    host = HostClock(clock, {"sparse": 5.0, "dense": 0.5})
    timer = TrainTimer(event=clock.event, clock=host)
    seen = [_call(timer, clock) for _ in range(2 + 2 * SAMPLES)]
    assert seen[2][1].path == "sparse" and seen[2][1].ms_per_token() == pytest.approx(2 * 5.0 / 4096)
    assert seen[3][1].path == "dense" and seen[3][1].ms_per_token() == pytest.approx(2 * 2.0 / 4096)
    assert _call(timer, clock) == ("dense", None) and timer.verdict(4096) == "dense"


def test_only_the_first_backward_through_the_op_is_timed():
    clock = Clock({"sparse": 1.0, "dense": 2.0})
    timer = TrainTimer(event=clock.event, clock=lambda: 0.0)
    path, trial, y = _timed_forward(timer, clock)
    y.sum().backward(retain_graph=True)
    y.sum().backward()  # a second backward through the same node (retain_graph): not timed
    assert len(trial.events) == 4 and trial.ms_per_token() == pytest.approx(2 * clock.cost[path] / 4096)


def test_a_recomputation_follows_the_layers_path_when_it_changes_after_a_timed_call(monkeypatch):
    """Once a layer has timed calls, every forward in the timed range (timed or not) records the
    path its recomputation takes: a path changed by a later measurement is the one replayed."""
    monkeypatch.setattr(path_timing, "TIMED_CHOICE", True)
    tp = _measured()
    assert tp.choose("auto", 5632, tokens=4096, timed=True)[0] == "sparse"  # a timed warm-up of sparse
    tp.path = "dense"  # a later measurement trains the layer dense (no timing then)
    assert tp.choose("auto", 5632, tokens=4096, timed=True)[0] == "dense"
    monkeypatch.setattr(train_path, "_in_backward", lambda: True)
    assert tp.choose("auto", 5632, tokens=4096)[0] == "dense"


def test_the_hosts_waits_for_the_gpu_inside_the_op_are_not_its_work():
    """Time the host spent waiting for the GPU inside the op (the sparse backward waiting for
    its forward's counts) is left out of the trial's host time: with the GPU behind, that wait
    is the GPU's earlier work, not this op's."""
    clock = Clock({"sparse": 1.0, "dense": 1.0})
    host = HostClock(clock, {"sparse": 0.0, "dense": 0.0})
    timer = TrainTimer(event=clock.event, clock=host)
    _, trial, y = _timed_forward(timer, clock)

    def wait(grad_outputs):  # 50 ms waiting inside the op's backward, as the sparse op's wait counts it
        host.now += 0.05
        path_timing.add_host_wait(0.05)

    y.grad_fn.register_prehook(wait)  # runs after the trial's own prehook
    y.sum().backward()
    assert trial.ms_per_token() == pytest.approx(2 * 1.0 / 4096)  # the GPU's time; the wait left out

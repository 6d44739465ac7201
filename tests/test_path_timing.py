"""The layers' own timing of prefill against dense near the break-even (twell.inference.path_timing,
``twell.inference.dispatch.TIMED_CHOICE``), on the CPU with fake CUDA events: which calls are trials,
which are timed, when a verdict forms and when it is measured again."""

import pytest
import torch

from twell import SparseGatedMLP, dispatch
from twell.inference.path_timing import BAND, COST_TOLERANCE, SAMPLES, PathTimer


class FakeClock:
    """Events whose elapsed time is ``ms[path]`` per token times the call's tokens, for the path
    and tokens being timed; ``done`` False keeps them in flight (``query`` False)."""

    def __init__(self, ms):
        self.ms, self.done, self.path, self.M, self.made = dict(ms), True, None, 1, 0

    def event(self):
        clock = self

        class Event:
            def __init__(self):
                clock.made += 1
                self.path = self.M = None

            def record(self, stream=None):
                assert stream is None  # CPU tensors here: the current stream (None)
                self.path, self.M = clock.path, clock.M

            def query(self):
                return clock.done

            def elapsed_time(self, end):
                assert clock.done, "read before completion"
                return clock.ms[self.path] * self.M

        return Event()


def call(timer, clock, M, cost, limit=62.0, ran=None, base=None):
    """One eager call as LayerState.run makes it: choose, start, (the path), stop. Returns the
    path chosen (None: the static rule) and whether the call was timed."""
    path, trial = timer.choose(M, cost, cost if base is None else base, limit)
    assert trial is None or trial.path == path
    clock.path, clock.M = ran or path, M
    token = timer.start(trial, ran or path) if trial is not None else None
    timer.stop(token)
    return path, token is not None


def warm_and_time(timer, clock, M, cost, **kw):
    return [call(timer, clock, M, cost, **kw) for _ in range(2 * (SAMPLES + 1))]


def test_outside_the_band_the_static_rule_decides():
    clock = FakeClock({"prefill": 1.0, "dense": 2.0})
    timer = PathTimer(clock.event)
    for cost in (62.0 * BAND[0] * 0.99, 62.0 * BAND[1] * 1.01):
        assert call(timer, clock, 16384, cost) == (None, False)
    assert clock.made == 0 and timer.verdicts() == {}


@pytest.mark.parametrize("faster", ["prefill", "dense"])
def test_trials_alternate_skip_each_first_call_then_keep_the_faster(faster):
    """Both paths run SAMPLES timed calls after one untimed call each (compilation); then the
    class keeps the path with the lower median, on every call of that class, with no trial."""
    slower = "dense" if faster == "prefill" else "prefill"
    clock = FakeClock({faster: 1.0, slower: 1.3})
    timer = PathTimer(clock.event)
    seen = warm_and_time(timer, clock, 16384, 60.0)
    assert sorted(p for p, _ in seen) == sorted(["prefill", "dense"] * (SAMPLES + 1))
    for path in ("prefill", "dense"):
        timed = [t for p, t in seen if p == path]
        assert timed == [False] + [True] * SAMPLES, (path, seen)
    for _ in range(3):
        assert call(timer, clock, 16384, 61.0) == (faster, False)
    (cls, (verdict, base, times)), = timer.verdicts().items()
    assert cls == (16384).bit_length() and verdict == faster and base == 60.0  # the trials' estimate
    assert times == {faster: [1.0] * SAMPLES, slower: [1.3] * SAMPLES}


def test_times_are_compared_per_token_within_a_class():
    """One class spans up to twice the tokens: with calls of 9000 and 16000 tokens in turn,
    prefill's timed calls can be the short ones, and raw times would crown it although dense
    takes 10% less per token (a review's case)."""
    clock = FakeClock({"prefill": 1.1, "dense": 1.0})
    timer = PathTimer(clock.event)
    assert (9000).bit_length() == (16000).bit_length()
    for i in range(2 * (SAMPLES + 1)):
        call(timer, clock, 16000 if i % 4 in (0, 3) else 9000, 60.0)
    assert call(timer, clock, 16000, 60.0)[0] == "dense"
    (_, (_, _, times)), = timer.verdicts().items()
    assert times == {"prefill": pytest.approx([1.1] * SAMPLES), "dense": pytest.approx([1.0] * SAMPLES)}


def test_the_tail_term_moving_with_tokens_does_not_restart_the_trials():
    """cost = base + TAIL_WEIGHT * longest row / M moves by more than COST_TOLERANCE across one
    class; the verdict is kept against the base, so calls of 8192 tokens among 16000 do not
    restart the trials (a review's case: a third of the calls had run the slower path)."""
    clock = FakeClock({"prefill": 1.0, "dense": 1.3})
    timer = PathTimer(clock.event)
    cost = lambda M: 50.0 + 850.0 * 128 / M  # noqa: E731
    assert abs(cost(8192) - cost(16000)) > COST_TOLERANCE * cost(16000)
    warm_and_time(timer, clock, 16000, cost(16000), base=50.0)
    made = clock.made
    for i in range(40):
        M = 8192 if i % 10 == 0 else 16000
        assert call(timer, clock, M, cost(M), base=50.0) == ("prefill", False)
    assert clock.made == made


def test_each_size_class_measures_on_its_own():
    clock = FakeClock({"prefill": 1.0, "dense": 2.0})
    timer = PathTimer(clock.event)
    warm_and_time(timer, clock, 16384, 60.0)
    assert call(timer, clock, 16384 + 1000, 60.0)[0] == "prefill"  # same class: the verdict
    path, timed = call(timer, clock, 65536, 60.0)  # another class: its first trial, untimed
    assert not timed and (65536).bit_length() not in timer.verdicts()
    clock.ms = {"prefill": 3.0, "dense": 2.0}
    warm_and_time(timer, clock, 65536, 60.0)
    assert call(timer, clock, 65536, 60.0)[0] == "dense" and call(timer, clock, 16384, 60.0)[0] == "prefill"


def test_a_moved_estimate_is_measured_again():
    clock = FakeClock({"prefill": 1.0, "dense": 2.0})
    timer = PathTimer(clock.event)
    warm_and_time(timer, clock, 16384, 60.0)
    assert call(timer, clock, 16384, 60.0 * (1 + COST_TOLERANCE * 0.9))[0] == "prefill"
    clock.ms = {"prefill": 2.5, "dense": 2.0}  # the layer grew denser: prefill now loses
    moved = 60.0 * (1 + COST_TOLERANCE * 1.5)
    seen = [call(timer, clock, 16384, moved) for _ in range(2 * SAMPLES)]
    assert all(t for _, t in seen)  # both paths warmed before: every trial is timed
    assert call(timer, clock, 16384, moved) == ("dense", False)
    (_, (_, base, _)), = timer.verdicts().items()
    assert base == moved  # the new trials' estimate, not the old ones'


def test_timings_in_flight_leave_the_static_rule_and_are_read_once_complete():
    clock = FakeClock({"prefill": 1.0, "dense": 2.0})
    clock.done = False
    timer = PathTimer(clock.event)
    paths = [p for p, _ in warm_and_time(timer, clock, 16384, 60.0)]
    assert None not in paths
    assert call(timer, clock, 16384, 60.0) == (None, False)  # all started, none read
    assert timer.verdicts() == {}
    clock.done = True
    assert call(timer, clock, 16384, 60.0)[0] == "prefill"


def test_a_call_that_ran_another_path_stops_the_class_timing():
    """LayerState.run can run dense where the trial said prefill (a down weight that cannot take
    the kernels): that call is not timed as prefill's, and the class leaves the choice to the
    static rule instead of asking for prefill forever (a review's case)."""
    clock = FakeClock({"prefill": 1.0, "dense": 2.0})
    timer = PathTimer(clock.event)
    assert call(timer, clock, 16384, 60.0) == ("prefill", False)  # warm-up
    path, timed = call(timer, clock, 16384, 60.0, ran="dense")
    assert path == "prefill" and not timed
    for _ in range(5):
        assert call(timer, clock, 16384, 60.0) == (None, False)
    assert clock.made == 0 and call(timer, clock, 65536, 60.0)[0] == "prefill"  # other classes time on


def test_events_go_on_the_input_devices_stream(monkeypatch):
    """A layer on cuda:1 may run while cuda:0 is current: both events go on cuda:1's current
    stream, where the path's work goes (``Event.record()`` alone takes the current device's)."""
    recorded = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: ("stream of", device))

    class Event:
        def record(self, stream=None):
            recorded.append(stream)

    timer = PathTimer(Event)
    device = torch.device("cuda", 1)
    for _ in range(2):  # the first call of prefill is its warm-up
        path, trial = timer.choose(16384, 60.0, 60.0, 62.0)
        timer.stop(timer.start(trial, path, device))
    assert path == "prefill" and recorded == [("stream of", device)] * 2


def test_layer_state_takes_the_timer_only_when_asked(monkeypatch):
    """TIMED_CHOICE off: the static rule. On: trials near the limit, not in a capture and not
    for a layer whose kernel_max_density is set; far from the limit, the static rule. A trial
    belongs to the choose() call that made it: the next choose() drops it (a capture's call
    must not consume an eager call's trial)."""
    s = SparseGatedMLP(8, 16)._twell_layer
    M, f = 16384, 11008
    s.estimate = (70.0, 0.0)  # past the 62-unit limit: static says dense
    assert s.choose(M, f, "auto", None, False) == "dense" and s.timer is None
    monkeypatch.setattr(dispatch, "TIMED_CHOICE", True)
    clock = FakeClock({"prefill": 1.0, "dense": 2.0})
    assert s.choose(M, f, "auto", 0.011, False) == "prefill" and s.timer is None  # the owner's limit: 121
    assert s.choose(M, f, "auto", None, True) == "dense" and s.timer is None  # a capture: fixed path
    s.timer = PathTimer(clock.event)
    assert s.choose(M, f, "auto", None, False) == "prefill" and s._trial is not None
    assert s.choose(M, f, "auto", None, True) == "dense" and s._trial is None
    for _ in range(2 * (SAMPLES + 1)):
        path = s.choose(M, f, "auto", None, False)
        clock.path, clock.M = path, M
        s.timer.stop(s.timer.start(s._trial, path))
    assert s.choose(M, f, "auto", None, False) == "prefill" and s._on_kernels and s._trial is None
    s.estimate = (62.0 * BAND[1] * 1.1, 0.0)  # far past the limit: static, dense
    assert s.choose(M, f, "auto", None, False) == "dense"


def test_run_times_the_path_it_ran(monkeypatch):
    """LayerState.run takes the trial its choose() made and records the events around the path
    it runs (the dense path on the CPU here); none when it runs another path than the trial's,
    and none from a trial left by an earlier call."""
    from twell.inference.path_timing import Trial, _SizeClass

    m = SparseGatedMLP(8, 16).eval()
    s = m._twell_layer
    clock = FakeClock({"prefill": 1.0, "dense": 2.0})
    clock.path = "dense"
    s.timer = PathTimer(clock.event)
    cls = _SizeClass()
    cls.warmed.update(prefill=True, dense=True)
    trial = {"path": "dense"}

    def choose(*args, **kwargs):
        s._trial = Trial(cls, trial["path"], 4, 60.0) if trial["path"] else None
        return "dense"

    monkeypatch.setattr(s, "choose", choose)
    x = torch.randn(4, 8)
    w = (m.gate_proj.weight, m.down_proj.weight, m.up_proj.weight)
    with torch.no_grad():
        ref = m.down_proj(torch.relu(m.gate_proj(x)) * m.up_proj(x))
        torch.testing.assert_close(s.run(x, *w), ref)
        assert [p for p, *_ in cls.pending] == ["dense"] and clock.made == 2 and s._trial is None
        trial["path"] = "prefill"  # the trial asked for prefill, the call ran dense
        torch.testing.assert_close(s.run(x, *w), ref)
        assert len(cls.pending) == 1 and clock.made == 2 and cls.disabled


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_timed_choice_gives_the_dense_answer_and_a_verdict(monkeypatch):
    """TIMED_CHOICE on, bf16, d 2048, f 5632, 16384 tokens at about 60 active units (within the
    band around the 62-unit limit): every call, trial or not, matches dense within its rounding,
    and after the trials the layer has a verdict whose timings are real (positive)."""
    from twell.bench.inference import dense_gated, errors, reference_fp32
    from twell.bench.synthetic import make_ffn

    monkeypatch.setattr(dispatch, "TIMED_CHOICE", True)
    s = make_ffn(16384, 2048, 5632, 60, "even", dtype=torch.bfloat16, device="cuda", seed=7)
    m = SparseGatedMLP(2048, 5632, device="cuda", dtype=torch.bfloat16).eval()
    with torch.no_grad():
        m.gate_proj.weight.copy_(s.w_gate), m.up_proj.weight.copy_(s.w_up), m.down_proj.weight.copy_(s.w_down)
        ref = reference_fp32(s.x, s.w_gate, s.w_up, s.w_down)
        _, dense_row = errors(dense_gated(s.x, s.w_gate, s.w_up, s.w_down), ref)
        paths = []
        for _ in range(3 + 2 * (SAMPLES + 1) + 4):
            y = m(s.x)
            torch.cuda.synchronize()
            paths.append(m.last_path)
            rel, row = errors(y, ref)
            assert rel < 1e-2 and row <= 2 * dense_row + 1e-6, (m.last_path, rel, row, dense_row)
    timer = m._twell_layer.timer
    assert timer is not None and {"prefill", "dense"} <= set(paths), paths
    (verdict, cost, times), = timer.verdicts().values()
    assert 62 * BAND[0] <= cost <= 62 * BAND[1]
    assert all(t > 0 for ts in times.values() for t in ts) and paths[-1] == verdict

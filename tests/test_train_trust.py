"""Trustworthy training runs: checkpoints, resume, signals and the data position, tested from a
mutation round on the training loop's host code (a helper, CPU, 60 single-line mutants; each
test's docstring names the mutants it kills: plausible bugs the other tests let through).
The two-rank tests fork gloo processes on the CPU."""

import os
import signal
import time
import types

import pytest
import torch

from test_train_cli import FAST
from test_train_loss import config, small_corpus
from test_train_robust import signal_in_step
from twell.cli import main
from twell.recipe import checkpoint as ckpt
from twell.recipe import trainer as trainer_module
from twell.recipe.data import next_first
from twell.recipe.trainer import RunStopped, Trainer, _PendingSave


# ---------------------------------------------------------------------------------------------
# tests/test_train_resume.py
# ---------------------------------------------------------------------------------------------


def test_resume_restores_the_cpu_rng_state(tmp_path):
    """Kills T04 (CPU RNG saved under a key load never reads) and T12 (CPU RNG not restored).

    Nothing in twell's own loop draws from the global RNG, so no end-to-end resume test can see
    a lost RNG state; any random op (dropout, a user's callback) would. The checkpoint claims
    to carry it: the resumed process's generator is where the saving one's was."""
    with torch.random.fork_rng(devices=[]):
        t = Trainer(config(tmp_path, steps=3, log_every=1, eval_every=3))
        t.train_step()
        torch.manual_seed(1234)
        torch.rand(7)  # somewhere no seed gives
        want = torch.get_rng_state()
        path = t.save_checkpoint()
        torch.rand(100)  # moves on after the save
        resumed = Trainer(config(tmp_path, steps=3, log_every=1, eval_every=3), resume=str(path))
        assert torch.equal(torch.get_rng_state(), want)
        t.loader.close(), resumed.loader.close()


def test_resume_keeps_the_adapted_l1_scales(tmp_path):
    """Kills T06 (l1_scale not saved) and T19 (l1_scale not restored).

    With --l1-target every log row adapts each layer's multiplier of lambda; a resumed run
    continues with the multipliers reached, not with 1, and logs the uninterrupted run's lambdas."""
    common = dict(steps=4, log_every=1, eval_every=4, save_every=2, l1=0.05, l1_target=0.3)
    full = Trainer(config(tmp_path, **common, out=str(tmp_path / "full")))
    full.fit()
    from twell.recipe.report import read_history

    resumed = Trainer(config(tmp_path, **common, out=str(tmp_path / "resumed")),
                      resume=str(tmp_path / "full" / "checkpoints" / "step_000002"))
    assert resumed.l1_scale != [1.0, 1.0]  # the multipliers moved in steps 1-2
    assert torch.equal(resumed._l1_scale_t, torch.tensor(resumed.l1_scale))
    resumed.fit()
    a = {r["step"]: r for r in read_history(tmp_path / "full" / "log.csv")}
    b = {r["step"]: r for r in read_history(tmp_path / "resumed" / "log.csv")}
    for step in (3, 4):
        for key in ("lambda_L0", "lambda_L1", "loss"):
            assert a[step][key] == b[step][key], (step, key)
    assert resumed.l1_scale == full.l1_scale


def test_resume_inside_a_dead_unit_window_restores_the_tracker(tmp_path):
    """Kills T21 (windows_done not restored), T22 (dead mask not restored) and T23 (reinit_count
    not restored).

    test_resume_continues_exactly resumes where the next step closes a window, which recomputes
    the dead mask and windows_done anyway; here the window is 3 steps and the checkpoint is at
    step 4, so Eq. 6 at step 5 runs on the restored mask alone. Some units are made dead for sure
    (their gate rows zeroed: relu(0) = 0 never fires)."""
    cfg = config(tmp_path, steps=6, log_every=1, eval_every=6, l1=0.05, reinit=True, dead_window=3)
    t = Trainer(cfg)
    with torch.no_grad():
        for m in t.modules:
            m.gate_proj.weight[:8] = 0
    for _ in range(4):
        assert t.train_step().applied
    want = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in t.dead.state_dict().items()}
    assert want["windows_done"] == 1 and want["steps_in_window"] == 1
    assert want["dead"].any() and int(want["reinit_count"]) > 0
    path = t.save_checkpoint()
    resumed = Trainer(cfg, resume=str(path))
    got = resumed.dead.state_dict()
    for key, value in want.items():
        assert (torch.equal(got[key], value) if torch.is_tensor(value) else got[key] == value), key
    t.train_step(), resumed.train_step()  # step 5: re-init from the restored mask
    for (n, p), q in zip(t.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(p, q), n
    assert int(resumed.dead.reinit_count) == int(t.dead.reinit_count)
    t.loader.close(), resumed.loader.close()


# ---------------------------------------------------------------------------------------------
# tests/test_train_robust.py
# ---------------------------------------------------------------------------------------------


def test_resume_after_a_nan_stop_keeps_the_streak(tmp_path, monkeypatch):
    """Kills T18 (bad_streak not restored): the skipped steps in a row count across a resume,
    as the checkpoint records them."""
    from test_train_robust import _poison_cross_entropy

    _poison_cross_entropy(monkeypatch, lambda n: n >= 3)  # steps 1 and 2 train, then NaN
    t = Trainer(config(tmp_path, steps=6, log_every=1, eval_every=6, max_bad_steps=3))
    with pytest.raises(RunStopped):
        t.fit()
    resumed = Trainer(config(tmp_path, steps=6), resume=str(tmp_path / "run"))
    assert resumed.step == 2 and resumed.skipped == 3 and resumed.bad_streak == 3
    resumed.loader.close()


def test_a_nan_stop_after_a_save_writes_the_data_position_it_reached(tmp_path, monkeypatch):
    """Kills T20 (the stop reuses a checkpoint of the same step without comparing the data
    position). With ``save_every=2`` step 2 is saved, then steps 3-5 are skipped: the step stays
    2 but their batches are consumed and counted. The stop must write that state, not hand back
    step 2's checkpoint, which resumed at samples_seen 8 with no skip counted; the resume reads
    what the same run without ``save_every`` reads."""
    import torch.nn.functional as F
    from test_train_robust import _poison_cross_entropy

    real_cross_entropy = F.cross_entropy
    positions = {}
    for save_every in (None, 2):
        out = tmp_path / f"save_every_{save_every}"
        monkeypatch.setattr(F, "cross_entropy", real_cross_entropy)
        _poison_cross_entropy(monkeypatch, lambda n: n >= 3)  # steps 1 and 2 train, then NaN
        t = Trainer(config(tmp_path, steps=6, log_every=1, eval_every=6, max_bad_steps=3, save_every=save_every,
                           out=str(out)))
        with pytest.raises(RunStopped) as stopped:
            t.fit()
        assert stopped.value.checkpoint.name == "step_000002"
        resumed = Trainer(config(tmp_path, steps=6, out=str(out)), resume=str(out))
        positions[save_every] = (resumed.step, resumed.samples_seen, resumed.skipped, resumed.bad_streak)
        assert positions[save_every] == (2, t.samples_seen, 3, 3), save_every
        resumed.loader.close()
    assert positions[2] == positions[None] and positions[None][1] > 8


def test_resume_takes_the_runs_betas(tmp_path):
    """``TrainConfig(betas=...)`` given on resume is what the optimizer uses, as it is what the
    resumed run's train_config.json records (before, the loaded optimizer state kept the
    checkpoint's betas silently); given nothing new, the checkpoint's are kept."""
    t = Trainer(config(tmp_path, steps=3, log_every=1, eval_every=3, betas=(0.9, 0.95)))
    t.train_step()
    path = t.save_checkpoint()
    t.loader.close()
    for betas in ((0.9, 0.95), (0.8, 0.9)):
        resumed = Trainer(config(tmp_path, steps=3, log_every=1, eval_every=3, betas=betas), resume=str(path))
        assert [tuple(g["betas"]) for g in resumed.optimizer.param_groups] == [betas] * len(resumed.optimizer.param_groups)
        assert resumed.cfg.betas == betas
        resumed.loader.close()


def _commit_fixture(tmp_path, content: str):
    final = tmp_path / "checkpoints" / "step_000002"
    tmp = ckpt.temporary_folder(final)
    (tmp / "sub").mkdir()
    (tmp / "a.txt").write_text(content)
    (tmp / "sub" / "b.txt").write_text(content)
    return tmp, final


def test_commit_flushes_every_file_and_both_folders(tmp_path, monkeypatch):
    """Kills C09 (files not fsynced before the rename). A power loss cannot be simulated here,
    so a spy checks what commit flushes: every file, the folder written, then the parent (the
    rename itself)."""
    flushed = []
    real = ckpt._fsync
    monkeypatch.setattr(ckpt, "_fsync", lambda p: (flushed.append(os.path.abspath(p)), real(p)))
    tmp, final = _commit_fixture(tmp_path, "x")
    ckpt.commit(tmp, final)
    names = [os.path.relpath(p, tmp_path) for p in flushed]
    assert sorted(names[:2]) == [os.path.join("checkpoints", ".step_000002.tmp", "a.txt"),
                                 os.path.join("checkpoints", ".step_000002.tmp", "sub", "b.txt")]
    assert names[2:] == [os.path.join("checkpoints", ".step_000002.tmp"), "checkpoints"]


def test_commit_over_an_existing_checkpoint_leaves_nothing_behind(tmp_path):
    """Kills C10 (the replaced checkpoint's copy .step_N.old left behind). A run resumed from an
    earlier step into the same folder writes its step folders again."""
    ckpt.commit(*_commit_fixture(tmp_path, "old"))
    ckpt.commit(*_commit_fixture(tmp_path, "new"))
    folder = tmp_path / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["step_000002"]
    assert (folder / "step_000002" / "a.txt").read_text() == "new"


def test_fit_removes_what_killed_writes_left(tmp_path):
    """Kills C11 (remove_partial_writes matches nothing) and T32 (cleaned on non-main ranks only).
    A write killed at a step the resumed run never saves again (here 9) would otherwise stay
    forever: temporary_folder only replaces a leftover of the step it writes."""
    cfg = config(tmp_path, steps=2, log_every=1, eval_every=2)
    stale = tmp_path / "run" / "checkpoints" / ".step_000009.tmp"
    stale.mkdir(parents=True)
    (stale / "optimizer.safetensors").write_bytes(b"half")
    Trainer(cfg).fit()
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step_000002"]


def _fake_clock(monkeypatch, start: float) -> dict:
    """The trainer's ``time.monotonic`` reads ``clock["now"]`` (the returned dict), which the
    test moves by hand."""
    clock = {"now": start}
    monkeypatch.setattr(trainer_module, "time", types.SimpleNamespace(
        monotonic=lambda: clock["now"], perf_counter=time.perf_counter, sleep=time.sleep))
    return clock


def test_a_repeated_signal_within_two_seconds_still_saves(tmp_path, monkeypatch):
    """Kills T27 (no grace window): torchrun passes a terminal's Ctrl-C on to its workers, which
    see it twice in a moment; that must still save and stop, not quit at once. A second signal
    later than two seconds does quit through the handler that was there before."""
    quit_now = []

    def previous(signum, frame):  # the handler before fit: records the quit instead of dying
        quit_now.append(signum)
        raise SystemExit("quit without saving")

    clock = _fake_clock(monkeypatch, 1000.0)
    clock["gap"] = 0.1

    def and_again(trainer):
        clock["now"] += clock["gap"]
        os.kill(os.getpid(), signal.SIGTERM)

    signal_in_step(monkeypatch, 2, then=and_again)
    old = signal.signal(signal.SIGTERM, previous)
    try:
        t = Trainer(config(tmp_path, steps=4, log_every=1, eval_every=4))
        with pytest.raises(RunStopped, match="interrupted by SIGTERM at step 2 of 4"):
            t.fit()
        assert quit_now == []
        clock["gap"] = 3.0  # the second signal 3 s after the first: the user will not wait
        t = Trainer(config(tmp_path, steps=4, log_every=1, eval_every=4, out=str(tmp_path / "again")))
        with pytest.raises(SystemExit, match="quit without saving"):
            t.fit()
        assert quit_now == [signal.SIGTERM]
        assert signal.getsignal(signal.SIGTERM) is previous
    finally:
        signal.signal(signal.SIGTERM, old)


def test_a_signal_in_the_last_step_finishes_the_run(tmp_path, monkeypatch):
    """Kills T28 (a signal in the last step raises RunStopped): the last step's checkpoint and
    evaluation are written anyway, so the run ends normally with its summary."""
    signal_in_step(monkeypatch, 3)
    t = Trainer(config(tmp_path, steps=3, log_every=1, eval_every=3))
    summary = t.fit()
    assert summary["steps"] == 3 and t.stop_signal == signal.SIGTERM
    assert ckpt.latest_checkpoint(tmp_path / "run") == tmp_path / "run" / "checkpoints" / "step_000003"


def test_wall_time_saves_count_from_the_last_save(tmp_path, monkeypatch):
    """Kills T30 (the save clock not reset by a save): with --save-minutes 2.5 and a step taking
    a minute (a fake clock), checkpoints come at steps 3 and 6, not at every step after the
    first that was due."""
    clock = _fake_clock(monkeypatch, 0.0)
    forward_backward = Trainer.forward_backward

    def a_minute_a_step(self):
        clock["now"] += 60.0
        return forward_backward(self)

    monkeypatch.setattr(Trainer, "forward_backward", a_minute_a_step)
    Trainer(config(tmp_path, steps=6, log_every=3, eval_every=6, save_minutes=2.5, keep=0)).fit()
    assert [p.name for p in ckpt.step_checkpoints(tmp_path / "run")] == ["step_000003", "step_000006"]


def test_a_signal_at_a_save_step_writes_the_checkpoint_once(tmp_path, monkeypatch):
    """Kills T31 (a save not remembered: the stop writes the same checkpoint a second time)."""
    save, saves = Trainer.save_checkpoint, []

    def counted(self, *args, **kwargs):
        saves.append(self.step)
        return save(self, *args, **kwargs)

    signal_in_step(monkeypatch, 2)
    monkeypatch.setattr(Trainer, "save_checkpoint", counted)
    t = Trainer(config(tmp_path, steps=4, log_every=1, eval_every=4, save_every=2))
    with pytest.raises(RunStopped) as stop:
        t.fit()
    assert saves == [2] and stop.value.checkpoint == tmp_path / "run" / "checkpoints" / "step_000002"


def test_fit_stops_its_prefetch_thread(tmp_path):
    """Kills T34 (the prefetch thread left running after fit): it would go on reading batches
    nobody wants (several trainers in one process, as in a sweep)."""
    t = Trainer(config(tmp_path, steps=2, log_every=1, eval_every=2))
    t.fit()
    assert t.loader._thread is None


# ---------------------------------------------------------------------------------------------
# tests/test_train_fsdp.py (no process group needed)
# ---------------------------------------------------------------------------------------------


def _fake_sharded_checkpoint(folder):
    """A sharded checkpoint's files (contents irrelevant but the trainer state), and its manifest."""
    (folder / "dcp").mkdir(parents=True)
    (folder / "dcp" / "__0_0.distcp").write_bytes(b"shard" * 10)
    (folder / "dcp" / ".metadata").write_bytes(b"metadata")
    (folder / "config.json").write_text("{}")
    (folder / "train_config.json").write_text("{}")
    ckpt.save_tensors_with_meta(folder / "trainer_state.safetensors", {"x": torch.zeros(3)}, {"step": 1})
    ckpt.write_manifest(folder)
    assert ckpt.missing_files(folder) == []


def test_a_manifest_without_the_dcp_metadata_is_incomplete(tmp_path):
    """Kills C05 (a manifest lacking dcp/.metadata accepted): without .metadata DCP cannot load
    the shards, whatever the manifest lists."""
    folder = tmp_path / "step_000001"
    _fake_sharded_checkpoint(folder)
    (folder / "dcp" / ".metadata").unlink()
    ckpt.write_manifest(folder)  # a manifest written without it
    assert ckpt.missing_files(folder) == ["dcp/.metadata"]


def test_a_trainer_state_of_the_right_size_but_unreadable_is_incomplete(tmp_path):
    """Kills C06 (sharded: an unreadable trainer_state.safetensors not detected). After a power
    loss a file can keep its size and read back as zeros; the manifest's sizes cannot see that."""
    folder = tmp_path / "step_000001"
    _fake_sharded_checkpoint(folder)
    state = folder / "trainer_state.safetensors"
    state.write_bytes(bytes(state.stat().st_size))
    assert ckpt.missing_files(folder) == ["trainer_state.safetensors"]


def test_naming_a_background_checkpoint_prunes_up_to_its_own_step(tmp_path):
    """Kills T38 (the sharded prune counts up to the current step instead of the written one).
    A background (async) write finishes some steps later; if a later step folder of an earlier
    run lies in checkpoints/ (resumed from before it), counting it as ours would delete the
    checkpoint just written. Driven directly, on one process, as rank 0 would."""
    t = Trainer(config(tmp_path, steps=8, keep=1))
    folder = tmp_path / "run" / "checkpoints"
    (folder / "step_000001").mkdir(parents=True)  # ours, older
    (folder / "step_000004").mkdir()  # another run's later step
    final = folder / "step_000002"
    tmp = ckpt.temporary_folder(final)
    (tmp / "config.json").write_text("{}")
    t._pending, t.step = _PendingSave(None, tmp, final, True, 2), 5
    t.wait_for_checkpoint()
    assert sorted(p.name for p in folder.iterdir()) == ["step_000002", "step_000004"]
    assert (final / ckpt.MANIFEST).is_file()
    t.loader.close()


# ---------------------------------------------------------------------------------------------
# tests/test_train_cli.py
# ---------------------------------------------------------------------------------------------


def test_ctrl_c_before_the_loop_exits_130(tmp_path, monkeypatch, capsys):
    """Kills L02 (exit status 1 after a KeyboardInterrupt): a Ctrl-C before the loop installed
    its handlers (or a second one that quits at once) ends with the shell's status for SIGINT
    and one line, no traceback."""
    def interrupted(cfg, resume=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer_module, "train", interrupted)
    data = tmp_path / "data"
    data.mkdir()
    with pytest.raises(SystemExit) as stop:
        main(["train", *FAST, "--data", small_corpus(data), "--steps", "2", "--out", str(tmp_path / "run")])
    assert stop.value.code == 130
    assert capsys.readouterr().err.strip() == "twell train: interrupted; nothing saved since the last checkpoint"


# ---------------------------------------------------------------------------------------------
# tests/test_train_shards.py
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world,B,A", [(2, 2, 2), (3, 1, 1), (2, 3, 1)])
def test_next_first_follows_every_ranks_schedule(world, B, A):
    """Kills D01 (the prefetch schedule ignores the rank after a step's last micro-batch): the
    batches would still be right (the Prefetcher restarts when asked off its schedule), but
    every rank but 0 would throw its prefetched batches away and restart the thread each step."""
    for rank in range(world):
        want = [s * B * A * world + (m * world + rank) * B for s in range(4) for m in range(A)]
        got = [want[0]]
        for _ in want[1:]:
            got.append(next_first(got[-1], B, A, rank, world))
        assert got == want, rank


# ---------------------------------------------------------------------------------------------
# tests/test_train_dist.py (two gloo ranks forked on the CPU; also needs
#   from test_train_dist import _free_port, _spawn
#   from twell.recipe.trainer import shutdown_distributed)
# ---------------------------------------------------------------------------------------------


def _slow_rank0_worker(rank, world, port, cfg, out_file, slow):
    """Rank 0 is 2 s late at one point of save_checkpoint (``slow``: "temporary_folder", before
    it makes the folder; "commit", before it renames it into place); records what each rank saw."""
    from twell.recipe.trainer import shutdown_distributed

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    t = Trainer(cfg)
    seen = []
    if rank == 0:
        real = getattr(ckpt, slow)

        def late(*args):
            time.sleep(2.0)
            if slow == "temporary_folder":  # did another rank make it meanwhile?
                seen.append(ckpt.temporary_path(args[0]).exists())
            return real(*args)

        setattr(ckpt, slow, late)  # in this forked rank only
    path = t.save_checkpoint(blocking=True)
    seen.append(path.is_dir())  # in place when save_checkpoint returns, on every rank
    gathered = [None] * world
    torch.distributed.all_gather_object(gathered, seen)
    if rank == 0:
        torch.save({"seen": gathered, "missing": ckpt.missing_files(path)}, out_file)
    t.loader.close()
    del t
    shutdown_distributed()


def test_no_rank_writes_a_sharded_checkpoint_before_rank_0_made_its_folder(tmp_path):
    """Kills T35 (the barrier before the sharded write dropped). Rank 0 empties and makes the
    temporary folder; without the barrier a faster rank 1 is already inside it (DCP makes the
    folder in its local plan, before any collective), and rank 0 deletes what it made, or fails
    to make the folder if that lands between its rmtree and its mkdir."""
    from test_train_dist import _free_port, _spawn

    cfg = config(tmp_path, batch_size=1, grad_accum=2, fsdp=True, steps=2, out=str(tmp_path / "run"))
    _spawn(_slow_rank0_worker, (2, _free_port(), cfg, str(tmp_path / "rank0.pt"), "temporary_folder"))
    got = torch.load(tmp_path / "rank0.pt", weights_only=False)
    assert got["seen"] == [[False, True], [True]] and got["missing"] == []


def test_every_rank_returns_from_a_save_with_the_checkpoint_in_place(tmp_path):
    """Kills T36 (the barrier at the end of save_checkpoint dropped): rank 0 renames the folder
    into place; rank 1 must not return before (save_checkpoint's contract; RunStopped names the
    folder on every rank)."""
    from test_train_dist import _free_port, _spawn

    cfg = config(tmp_path, batch_size=2, steps=2, out=str(tmp_path / "run"))
    _spawn(_slow_rank0_worker, (2, _free_port(), cfg, str(tmp_path / "rank0.pt"), "commit"))
    got = torch.load(tmp_path / "rank0.pt", weights_only=False)
    assert got["seen"] == [[True], [True]] and got["missing"] == []

"""Two CPU processes (gloo, DDP) compute the same gradients and statistics as one process
that sees both processes' batches."""

import socket

import torch
import torch.multiprocessing as mp

from test_train_loss import config
from twell.recipe.trainer import Trainer, shutdown_distributed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(fn, args, timeout_s: float = 180.0, start_method: str = "fork") -> None:
    """Two ranks running ``fn``, with a deadline, so that a stuck rank fails the test instead of
    hanging CI.

    The ranks are forked from this process, not spawned: a spawned rank starts a fresh Python
    that imports torch and transformers again (10 to 25 s per pair of ranks on a 2-core CPU,
    far more than the training they run), while a forked one starts with them loaded. What these
    tests check (gradients, statistics, checkpoints reduced over gloo ranks) does not depend on
    how the ranks were started; this process never joins a process group itself, and the runs
    are on the CPU even where there is a GPU (a forked child cannot use CUDA once its parent
    has). PyTorch's own gloo tests fork their ranks the same way. Each worker first sets one
    intra-op thread: OpenMP's worker threads are not forked, and a parallel region in a forked
    child would wait for them forever."""
    import time
    import warnings

    with warnings.catch_warnings():  # Python >= 3.12 warns about forking with threads (see above)
        warnings.filterwarnings("ignore", "This process .* is multi-threaded", DeprecationWarning)
        ctx = mp.start_processes(fn, args=args, nprocs=2, join=False, start_method=start_method)
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise TimeoutError(f"the 2-process run did not finish in {timeout_s} s")


def _one_step(trainer: Trainer) -> dict:
    ce, l1 = trainer.forward_backward()
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.dead.end_step(trainer.modules, 1)  # window of 1 step: dead fraction of this step
    stats = trainer.interval.reduce()
    ev = trainer.evaluate(batches=2)
    return {"grads": grads, "stats": stats, "dead_frac": trainer.dead.dead_frac, "eval": ev,
            "ce": ce, "l1": l1}


def _worker(rank, world, port, cfg, out_file):
    import os

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    trainer = Trainer(cfg)
    result = _one_step(trainer)
    # DDP averages the gradients of the ranks; ce/l1 are this rank's, gathered for the test
    gathered = [None] * world
    torch.distributed.all_gather_object(gathered, (float(result["ce"]), float(result["l1"])))
    result["ce_l1_by_rank"] = gathered
    result["broadcast_buffers"] = trainer.wrapped.broadcast_buffers
    if rank == 0:
        torch.save(result, out_file)
    del trainer
    shutdown_distributed()


def test_two_processes_match_one(tmp_path):
    B = 2
    common = dict(device="cpu", l1=0.05, dead_window=1)
    two = config(tmp_path, batch_size=B, **common)
    one = config(tmp_path, batch_size=2 * B, **common)
    out_file = tmp_path / "rank0.pt"
    # The one-process step first: the forked ranks inherit what it imported (transformers).
    single = Trainer(one)
    want = _one_step(single)
    single.loader.close()  # no prefetch thread running while the ranks are forked
    _spawn(_worker, (2, _free_port(), two, str(out_file)))
    got = torch.load(out_file, weights_only=False)
    assert got["broadcast_buffers"] is False  # no buffer broadcast before every forward

    # the one-process loss is the mean of the two ranks' (equal token counts)
    ces, l1s = zip(*got["ce_l1_by_rank"])
    assert abs(sum(ces) / 2 - float(want["ce"])) < 1e-5
    assert abs(sum(l1s) / 2 - float(want["l1"])) < 1e-4 * float(want["l1"])
    for name, g in want["grads"].items():
        err = (got["grads"][name] - g).norm() / g.norm().clamp_min(1e-12)
        assert err < 1e-5, (name, float(err))
    for key in ("active_mean", "l1"):
        torch.testing.assert_close(torch.tensor(got["stats"][key]), torch.tensor(want["stats"][key]), rtol=1e-5, atol=0)
    assert got["stats"]["active_max"] == want["stats"]["active_max"]
    assert got["stats"]["tokens"] == want["stats"]["tokens"] == 2 * B * 32
    assert got["dead_frac"] == want["dead_frac"]
    assert abs(got["eval"]["val_loss"] - want["eval"]["val_loss"]) < 1e-5
    assert got["eval"]["dead_frac"] == want["eval"]["dead_frac"]
    torch.testing.assert_close(torch.tensor(got["eval"]["active_mean"]), torch.tensor(want["eval"]["active_mean"]))


def _fit_worker(rank, world, port, cfg, resume):
    import os

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from twell.recipe.trainer import train

    train(cfg, resume=resume)


def test_two_process_training_matches_one(tmp_path):
    """Three optimizer steps under DDP and under FSDP, with 2 micro-batches per step (gradients
    synced on the last one only), give the losses and statistics of one process; an FSDP
    checkpoint resumes exactly."""
    from twell.recipe.report import read_history

    common = dict(device="cpu", l1=0.05, steps=3, log_every=1, eval_every=3, save_every=1, dead_window=1)
    one = config(tmp_path, batch_size=4, **common, out=str(tmp_path / "one"))
    Trainer(one).fit()
    want = read_history(tmp_path / "one" / "log.csv")
    # 2 ranks x 2 micro-batches x 1 = the 4 sequences of one process; validation: 2 ranks x 2
    # batches x 1 = its 4 windows
    two = dict(batch_size=1, grad_accum=2, val_batches=2)
    runs = {"ddp": (config(tmp_path, **two, **common, out=str(tmp_path / "ddp")), None),
            "fsdp": (config(tmp_path, **two, fsdp=True, **common, out=str(tmp_path / "fsdp")), None),
            "fsdp_resumed": (config(tmp_path, **two, fsdp=True, **common, out=str(tmp_path / "fsdp_resumed")),
                             str(tmp_path / "fsdp" / "checkpoints" / "step_000001"))}
    for name, (cfg, resume) in runs.items():
        _spawn(_fit_worker, (2, _free_port(), cfg, resume))
        got = read_history(tmp_path / name / "log.csv")
        assert [r["step"] for r in got] == ([2, 3] if resume else [1, 2, 3]), name
        for g, w in zip(got, want[-len(got):]):
            for key in ("ce", "l1", "active_mean", "val_loss"):
                if key in w:
                    assert abs(g[key] - w[key]) <= 1e-4 * abs(w[key]) + 1e-6, (name, g["step"], key, g[key], w[key])
            assert g["active_max"] == w["active_max"] and g["dead_frac"] == w["dead_frac"], name


def _state_worker(rank, world, port, out_file):
    """Each rank fires different units / sees different statistics; save, load into fresh
    trackers, finish the window: the verdict must count every rank's firings once."""
    import torch.distributed as dist

    from twell.recipe.stats import DeadUnits, IntervalStats

    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    dead = DeadUnits(1, 4, window_steps=2, device="cpu")
    dead.pending[0, rank] = 3  # rank 0 fires unit 0, rank 1 unit 1; units 2 and 3 never
    dead.end_step([], 1)
    interval = IntervalStats(1, "cpu")
    interval.active_sum += 10.0 * (rank + 1)
    interval.active_max += 5 + rank
    interval.tokens = 4
    dead_state, interval_state = dead.state_dict(), interval.state_dict()

    dead2, interval2 = DeadUnits(1, 4, window_steps=2, device="cpu"), IntervalStats(1, "cpu")
    dead2.load_state_dict(dead_state, primary=rank == 0)
    interval2.load_state_dict(interval_state, primary=rank == 0)
    dead2.end_step([], 2)  # the window ends: counts summed over ranks
    result = {"dead_frac": dead2.dead_frac, "dead": dead2.dead.tolist(), "stats": interval2.reduce()}
    if rank == 0:
        torch.save(result, out_file)
    shutdown_distributed()


def test_tracker_state_saved_under_ddp_counts_every_rank_once(tmp_path):
    out_file = tmp_path / "rank0.pt"
    _spawn(_state_worker, (2, _free_port(), str(out_file)))
    got = torch.load(out_file, weights_only=False)
    assert got["dead"] == [[False, False, True, True]] and got["dead_frac"] == [0.5]
    assert got["stats"]["tokens"] == 8 and got["stats"]["active_max"] == [6]
    assert got["stats"]["active_mean"] == [(10.0 + 20.0) / 8]


def test_two_process_resume_between_windows_and_log_steps(tmp_path):
    """DDP resumed at step 3, inside a 4-step dead-unit window and between log steps (every 2):
    the step-4 row (losses of steps 3-4, statistics, dead units of steps 1-4, counted on both
    ranks) is the uninterrupted run's."""
    from twell.recipe.report import read_history

    common = dict(device="cpu", l1=0.05, steps=4, log_every=2, eval_every=4, save_every=3, dead_window=4, batch_size=2)
    full = config(tmp_path, **common, out=str(tmp_path / "full"))
    _spawn(_fit_worker, (2, _free_port(), full, None))
    resumed = config(tmp_path, **common, out=str(tmp_path / "resumed"))
    _spawn(_fit_worker, (2, _free_port(), resumed, str(tmp_path / "full" / "checkpoints" / "step_000003")))
    want = read_history(tmp_path / "full" / "log.csv")[-1]
    got = read_history(tmp_path / "resumed" / "log.csv")
    assert [r["step"] for r in got] == [4] and want["step"] == 4
    got = got[0]
    for key, w in want.items():
        if key.startswith(("active_max", "dead_frac")) or key in ("step", "tokens", "lr", "lambda"):
            assert got[key] == w, key
        elif key != "tokens_per_s":
            assert abs(got[key] - w) <= 1e-5 * abs(w) + 1e-7, (key, got[key], w)

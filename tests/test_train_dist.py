"""Two CPU processes (gloo, DDP) compute the same gradients and statistics as one process
that sees both processes' batches."""

import socket

import torch
import torch.multiprocessing as mp

from test_train_loss import config
from twell.train.trainer import Trainer, shutdown_distributed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(fn, args, timeout_s: float = 180.0) -> None:
    """mp.spawn with a deadline, so that a stuck rank fails the test instead of hanging CI."""
    import time

    ctx = mp.start_processes(fn, args=args, nprocs=2, join=False, start_method="spawn")
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
    if rank == 0:
        torch.save(result, out_file)
    del trainer
    shutdown_distributed()


def test_two_processes_match_one(tmp_path):
    B = 2
    common = dict(l1=0.05, dead_window=1)
    two = config(tmp_path, batch_size=B, **common)
    one = config(tmp_path, batch_size=2 * B, **common)
    out_file = tmp_path / "rank0.pt"
    _spawn(_worker, (2, _free_port(), two, str(out_file)))
    got = torch.load(out_file, weights_only=False)
    want = _one_step(Trainer(one))

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
    from twell.train.trainer import train

    train(cfg, resume=resume)


def test_two_process_training_matches_one(tmp_path):
    """Three optimizer steps under DDP and under FSDP give the losses and statistics of one
    process; an FSDP checkpoint resumes exactly."""
    from twell.train.report import read_history

    common = dict(l1=0.05, steps=3, log_every=1, eval_every=3, save_every=1, dead_window=1)
    one = config(tmp_path, batch_size=4, **common, out=str(tmp_path / "one"))
    Trainer(one).fit()
    want = read_history(tmp_path / "one" / "log.csv")
    runs = {"ddp": (config(tmp_path, batch_size=2, **common, out=str(tmp_path / "ddp")), None),
            "fsdp": (config(tmp_path, batch_size=2, fsdp=True, **common, out=str(tmp_path / "fsdp")), None),
            "fsdp_resumed": (config(tmp_path, batch_size=2, fsdp=True, **common, out=str(tmp_path / "fsdp_resumed")),
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

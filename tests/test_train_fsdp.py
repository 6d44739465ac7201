"""FSDP2 from the meta device, on two CPU processes (gloo): the sharded model starts from the
seeded build's exact weights.

The two-process run is made once for the module (spawning costs most of its time); the tests
read what it left."""

import os

import pytest
import torch

from test_train_dist import _free_port, _spawn
from test_train_loss import config
from twell.train.meta_init import record_init
from twell.train.model import build_model, make_config
from twell.train.trainer import Trainer, shutdown_distributed

# 2 ranks x 2 micro-batches x 1 sequence: 4 sequences a step, as 1 process x 1 x 4.
COMMON = dict(l1=0.05, steps=3, log_every=1, eval_every=3, save_every=1, dead_window=1, keep=2, val_batches=2)
TWO = dict(batch_size=1, grad_accum=2, fsdp=True)


def _full_state(trainer) -> tuple[dict, dict]:
    """The whole model and optimizer state (gathered from the shards), on the CPU."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(trainer.model, trainer.optimizer,
                              options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return ({k: v.clone() for k, v in msd.items()},
            {name: {k: v.clone() for k, v in slots.items()} for name, slots in osd.get("state", {}).items()})


def _fsdp_worker(rank, world, port, cfg, out_file):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    trainer = Trainer(cfg)
    result = {"config": trainer.config, "init": _full_state(trainer)[0],
              "buffers": {k: v.clone() for k, v in trainer.model.named_buffers()},
              "tied": trainer.model.lm_head.weight is trainer.model.model.embed_tokens.weight,
              "sharded": type(trainer.model.lm_head.weight).__name__}
    if rank == 0:
        torch.save(result, out_file)
    del trainer
    shutdown_distributed()


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp")
    cfg = config(tmp, **COMMON, **TWO, out=str(tmp / "run"))
    _spawn(_fsdp_worker, (2, _free_port(), cfg, str(tmp / "rank0.pt")), start_method="fork")
    return tmp, cfg, torch.load(tmp / "rank0.pt", weights_only=False)


def test_meta_init_replays_the_seeded_build_exactly():
    """One process: the recorded build, replayed, gives build_model's tensors bit for bit and
    leaves the CPU generator where the build left it, through a re-seed inside the build."""
    cfg = make_config("tiny", 257, hidden_size=32, intermediate_size=88, num_layers=2, num_heads=2, context=32)

    def build():
        model = build_model(cfg, seed=7)
        torch.manual_seed(11)  # a re-seed, then more draws into a parameter
        torch.nn.init.normal_(model.model.norm.weight)
        return model

    recipe = record_init(build)
    got = {}
    recipe.replay(lambda name, t: got.__setitem__(name, t.clone()))
    after = torch.get_rng_state()
    want = build()
    assert torch.equal(after, torch.get_rng_state())
    tensors = {**dict(want.named_parameters(remove_duplicate=False)), **dict(want.named_buffers())}
    assert set(got) == set(tensors) and "lm_head.weight" in got and "model.rotary_emb.inv_freq" in got
    for name, t in tensors.items():
        assert torch.equal(got[name], t), name
    # Only what the build's values need is kept: the constructors' kaiming draws, which post_init
    # overwrites, ran on scratch tensors.
    assert sum(op.random and not op.live for op in recipe.ops) >= 2 * 7 + 1


def test_fsdp_meta_init_equals_the_seeded_build(fsdp_run):
    """Two ranks, model built on the meta device and sharded: gathered, its weights and buffers
    are those of build_model on the CPU with the same seed, exactly; the output matrix stays tied."""
    _, cfg, run = fsdp_run
    want = build_model(run["config"], seed=cfg.seed)
    assert run["tied"] and run["sharded"] == "DTensor"
    assert set(run["init"]) == set(want.state_dict())
    for name, t in want.state_dict().items():
        assert torch.equal(run["init"][name], t), name
    for name, t in want.named_buffers():
        assert torch.equal(run["buffers"][name], t), name

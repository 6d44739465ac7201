"""FSDP2 from the meta device and sharded checkpoints (torch.distributed.checkpoint), on two CPU
processes (gloo): the sharded model starts from the seeded build's exact weights, a checkpoint
round-trips exactly, resumes on one process, and exports to a Hugging Face folder that gives
the trained model's logits.

The two-process run is made once for the module (spawning costs most of its time); the tests
read what it left."""

import json
import os
import shutil

import pytest
import torch

from test_train_dist import _free_port, _spawn
from test_train_loss import config
from twell.cli import main
from twell.recipe import checkpoint as ckpt
from twell.recipe.meta_init import record_init
from twell.recipe.model import build_model, make_config
from twell.recipe.report import read_history
from twell.recipe.trainer import Trainer, shutdown_distributed

# 2 ranks x 2 micro-batches x 1 sequence: 4 sequences a step, as 1 process x 1 x 4.
COMMON = dict(l1=0.05, steps=3, log_every=1, eval_every=3, save_every=1, dead_window=1, keep=2, val_batches=2)
TWO = dict(batch_size=1, grad_accum=2, fsdp=True)
PROBE = torch.arange(2 * 16).reshape(2, 16) % 257  # token ids whose logits the tests compare


def _full_state(trainer) -> tuple[dict, dict]:
    """The whole model and optimizer state (gathered from the shards), on the CPU."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(trainer.model, trainer.optimizer,
                              options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return ({k: v.clone() for k, v in msd.items()},
            {name: {k: v.clone() for k, v in slots.items()} for name, slots in osd.get("state", {}).items()})


def _fsdp_worker(rank, world, port, cfg, out_file, unsharded):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    trainer = Trainer(cfg)
    result = {"config": trainer.config, "init": _full_state(trainer)[0],
              "buffers": {k: v.clone() for k, v in trainer.model.named_buffers()},
              "tied": trainer.model.lm_head.weight is trainer.model.model.embed_tokens.weight,
              "sharded": type(trainer.model.lm_head.weight).__name__}
    trainer.fit()
    result["params"], result["optim"] = _full_state(trainer)
    trainer.wrapped.eval()
    with torch.no_grad():
        result["logits"] = trainer.wrapped(input_ids=PROBE).logits.clone()
    # Round trip: a fresh sharded trainer loads the last checkpoint (steps + 1: something to do).
    again = Trainer(type(cfg)(**{**vars(cfg), "steps": cfg.steps + 1}), resume=cfg.out)
    result["reloaded"] = _full_state(again)
    result["reloaded_step"], result["reloaded_samples"] = again.step, again.samples_seen
    # An unsharded (safetensors) checkpoint of a one-process run, resumed sharded.
    cross = Trainer(type(cfg)(**{**vars(cfg), "out": cfg.out + "-cross"}), resume=unsharded)
    result["cross"], result["cross_step"] = _full_state(cross), cross.step
    if rank == 0:
        torch.save(result, out_file)
    del trainer, again, cross
    shutdown_distributed()


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp")
    Trainer(config(tmp, **{**COMMON, "steps": 2}, batch_size=4, out=str(tmp / "one"))).fit()
    cfg = config(tmp, **COMMON, **TWO, out=str(tmp / "run"))
    _spawn(_fsdp_worker, (2, _free_port(), cfg, str(tmp / "rank0.pt"), str(tmp / "one")), start_method="fork")
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


def test_fsdp_checkpoint_round_trip(fsdp_run):
    """Saved by two ranks (in the background), loaded by two: identical weights and AdamW state;
    the folder holds one shard file per rank, the list of files, and --keep pruned the rest."""
    tmp, cfg, run = fsdp_run
    params, optim = run["params"], run["optim"]
    got_params, got_optim = run["reloaded"]
    assert run["reloaded_step"] == 3 and run["reloaded_samples"] == 3 * 4
    for name, t in params.items():
        assert torch.equal(got_params[name], t), name
    assert set(got_optim) == set(optim) and optim
    for name, slots in optim.items():
        for slot, t in slots.items():
            assert torch.equal(got_optim[name][slot], t), (name, slot)
    checkpoints = tmp / "run" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_000002", "step_000003"]
    last = checkpoints / "step_000003"
    assert ckpt.is_sharded(last) and ckpt.missing_files(last) == []
    assert sorted(p.name for p in (last / "dcp").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert not (last / "model.safetensors").exists() and not (last / "optimizer.safetensors").exists()


def test_fsdp_resumes_an_unsharded_checkpoint(fsdp_run):
    """A one-process run's safetensors checkpoint, resumed by two FSDP ranks: its weights and
    AdamW state, exactly."""
    tmp, _, run = fsdp_run
    saved = tmp / "one" / "checkpoints" / "step_000002"
    params, optim = run["cross"]
    assert run["cross_step"] == 2
    weights = ckpt.load_model_weights(saved)
    assert set(weights) == set(params) - {"lm_head.weight"}
    for name, t in weights.items():
        assert torch.equal(params[name], t), name
    state = ckpt.load_optimizer(saved / "optimizer.safetensors")["state"]
    assert set(state) == set(optim)
    for name, slots in state.items():
        for slot, t in slots.items():
            assert torch.equal(optim[name][slot], torch.as_tensor(t)), (name, slot)


def test_truncated_shard_makes_the_checkpoint_incomplete(fsdp_run, tmp_path):
    tmp, _, _ = fsdp_run
    run = tmp_path / "run"
    shutil.copytree(tmp / "run" / "checkpoints", run / "checkpoints")
    shard = run / "checkpoints" / "step_000003" / "dcp" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-10])
    passed_over = []
    assert ckpt.latest_checkpoint(run, passed_over) == run / "checkpoints" / "step_000002"
    assert passed_over == [(run / "checkpoints" / "step_000003", ["dcp/__1_0.distcp"])]


def test_two_rank_fsdp_checkpoint_resumes_on_one_process(fsdp_run, tmp_path, capsys):
    """`twell train --resume` of the step-1 checkpoint in one process (unsharded, 4 sequences a
    step as before) ends where the two-rank run ended, up to the order of the reductions."""
    tmp, cfg, run = fsdp_run
    out = tmp_path / "resumed"
    main(["train", "--resume", str(tmp / "run" / "checkpoints" / "step_000002"), "--batch-size", "2",
          "--out", str(out), "--no-plot"])
    assert "written by an FSDP run; resuming in one process, without FSDP" in capsys.readouterr().err
    want = {r["step"]: r for r in read_history(tmp / "run" / "log.csv")}
    got = read_history(out / "log.csv")
    assert [r["step"] for r in got] == [3]
    for key in ("ce", "l1", "val_loss"):
        assert abs(got[0][key] - want[3][key]) <= 1e-5 * abs(want[3][key]), key
    final = ckpt.load_model_weights(out / "checkpoints" / "step_000003")
    for name, t in run["params"].items():
        if name in final:
            torch.testing.assert_close(final[name], t, rtol=1e-5, atol=1e-6, msg=name)


def test_export_gives_the_trained_models_logits(fsdp_run, tmp_path, capsys):
    """`twell export RUN DIR` of the sharded checkpoint: from_pretrained gives the logits of the
    trained (sharded) model, and `twell eval DIR` the run's validation loss."""
    from transformers import LlamaForCausalLM

    from twell import sparsify

    tmp, _, run = fsdp_run
    out = tmp_path / "hf"
    main(["export", str(tmp / "run"), str(out)])
    assert "from_pretrained" in capsys.readouterr().out
    model = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=PROBE).logits, run["logits"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(sparsify(model)(input_ids=PROBE).logits, run["logits"], rtol=1e-5, atol=1e-5)
    summary = json.loads((tmp / "run" / "summary.json").read_text())
    for path in (out, tmp / "run"):  # the export, and the sharded checkpoint itself
        main(["eval", str(path), "--json"])
        assert json.loads(capsys.readouterr().out)["val_loss"] == pytest.approx(summary["val_loss"], rel=1e-5)
    with pytest.raises(SystemExit, match="exists and is not an empty folder"):
        main(["export", str(tmp / "run"), str(out)])


def test_export_of_an_unsharded_checkpoint(tmp_path):
    t = Trainer(config(tmp_path, steps=2, log_every=1, eval_every=2))
    t.fit()
    out = tmp_path / "hf"
    main(["export", str(tmp_path / "run"), str(out)])
    from transformers import LlamaForCausalLM

    t.model.eval()
    with torch.no_grad():
        want = t.model(input_ids=PROBE).logits
        got = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()(input_ids=PROBE).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    info = json.loads((out / "twell_export.json").read_text())
    assert info["format"] == "safetensors" and info["step"] == 2 and (out / "twell_tokenizer.json").is_file()
    # generation reads the KV cache setting from the export (the training preset's was off)
    exported = LlamaForCausalLM.from_pretrained(out)
    assert exported.config.use_cache and exported.generation_config.use_cache


def test_an_export_of_a_byte_level_run_loads_and_generates_with_the_auto_classes(tmp_path):
    """The README's generation example on a byte-level run: AutoTokenizer gives the run's byte
    ids, AutoModelForCausalLM the trained logits, and the sparsified model generates as the
    dense one does, stopping at the run's end-of-text id."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from twell import sparsify
    from twell.recipe.data import ByteTokenizer

    t = Trainer(config(tmp_path, steps=2, log_every=1, eval_every=2))
    t.fit()
    out = tmp_path / "hf"
    main(["export", str(tmp_path / "run"), str(out)])
    tok = AutoTokenizer.from_pretrained(out)
    text = "def f():\n    return 'h\u00e9' \U0001F600"
    ids = tok(text, return_tensors="pt")["input_ids"]
    assert ids[0].tolist() == ByteTokenizer().encode(text).tolist() and tok.decode(ids[0]) == text
    assert tok.eos_token_id == ByteTokenizer.eos_id
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    t.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, t.model(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
        dense = model.generate(input_ids=ids, max_new_tokens=8, do_sample=False)
        sparse = sparsify(model).generate(input_ids=ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(sparse, dense) and dense.shape[1] > ids.shape[1]
    assert isinstance(tok.decode(sparse[0, ids.shape[1]:]), str)


# Units whose gate rows are zeroed never fire: dead from the first window. Some rows in each
# rank's shard (88 units: rows 0-43 on rank 0, 44-87 on rank 1).
ZEROED = [0, 1, 2, 3, 4, 50, 51, 52, 53, 54]


def _zero_gate_rows(trainer) -> None:
    """Zero the ZEROED gate rows of every layer, sharded or not."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        for m in trainer.modules:
            w = m.gate_proj.weight
            keep = torch.ones(tuple(w.shape), dtype=w.dtype)
            keep[ZEROED] = 0.0
            if isinstance(w, DTensor):
                keep = distribute_tensor(keep, w.device_mesh, w.placements, src_data_rank=None)
            w.mul_(keep)


def _gate_rows(trainer) -> dict:
    return {k: v for k, v in _full_state(trainer)[0].items() if "gate_proj" in k}


def _reinit_worker(rank, world, port, cfg, out_file):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    trainer = Trainer(cfg)
    _zero_gate_rows(trainer)
    trainer.fit()
    result = {"gates": _gate_rows(trainer), "reinit_count": int(trainer.dead.reinit_count),
              "sharded": type(trainer.modules[0].gate_proj.weight).__name__}
    if rank == 0:
        torch.save(result, out_file)
    del trainer
    shutdown_distributed()


def test_fsdp_reinit_gives_the_one_process_rows(tmp_path):
    """--reinit under FSDP2: each rank nudges its own shard's dead gate rows with its rows of the
    one whole-matrix draw, so the gathered gates are the one-process run's, the zeroed rows on
    both ranks' shards included (off zero, and not the unsharded draw's first rows on every
    rank); without --reinit those rows stay at zero."""
    common = dict(l1=0.05, steps=2, log_every=1, eval_every=2, dead_window=1, reinit=True)
    runs = {}
    for reinit in (True, False):
        one = Trainer(config(tmp_path, **{**common, "reinit": reinit}, batch_size=4, out=str(tmp_path / f"one_{reinit}")))
        _zero_gate_rows(one)
        one.fit()
        runs[reinit] = (_gate_rows(one), int(one.dead.reinit_count))
        one.loader.close()  # no prefetch thread running while the ranks are forked
    cfg = config(tmp_path, **common, **TWO, out=str(tmp_path / "fsdp"))
    _spawn(_reinit_worker, (2, _free_port(), cfg, str(tmp_path / "rank0.pt")), start_method="fork")
    got = torch.load(tmp_path / "rank0.pt", weights_only=False)
    want, count = runs[True]
    plain, plain_count = runs[False]
    assert got["sharded"] == "DTensor" and set(got["gates"]) == set(want) and len(want) == 2
    assert got["reinit_count"] == count >= 2 * len(ZEROED) and plain_count == 0  # 2 layers
    for name, w in want.items():
        assert torch.count_nonzero(plain[name][ZEROED]) == 0
        assert bool((w[ZEROED].abs().sum(dim=1) > 0).all())
        torch.testing.assert_close(got["gates"][name], w, rtol=1e-4, atol=1e-6)

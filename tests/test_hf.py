"""twell.sparsify on tiny randomly initialised Hugging Face models (no download)."""

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from sparsity import rel_err
import twell
from twell import SparseGatedMLP, sparsify

TINY = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=72,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)

FAMILIES = [(LlamaConfig, LlamaForCausalLM), (Qwen2Config, Qwen2ForCausalLM), (MistralConfig, MistralForCausalLM)]


def build(config_cls, model_cls, act, seed=0):
    torch.manual_seed(seed)
    return model_cls(config_cls(hidden_act=act, **TINY)).double().eval()


@pytest.mark.parametrize("config_cls, model_cls", FAMILIES, ids=["llama", "qwen2", "mistral"])
def test_sparsify_equals_the_relu_model(config_cls, model_cls):
    relu_model = build(config_cls, model_cls, "relu")
    model = build(config_cls, model_cls, "silu")  # same seed: same weights
    ids = torch.randint(0, 97, (2, 11))
    silu_logits = model(ids).logits
    weights_before = {n: p.clone() for n, p in model.named_parameters()}
    sparsify(model)
    mlps = [m for m in model.modules() if isinstance(m, SparseGatedMLP)]
    assert len(mlps) == 2
    assert model.config.hidden_act == "relu"
    out = model(ids).logits
    assert rel_err(out, relu_model(ids).logits) < 1e-12
    assert rel_err(out, silu_logits) > 1e-3  # ReLU for SiLU changes the function
    # the weights were kept, under the same names
    after = dict(model.named_parameters())
    assert set(after) == set(weights_before)
    assert all(torch.equal(after[n], w) for n, w in weights_before.items())
    # in eval mode statistics are kept only when asked for
    assert all(m.stats is None for m in mlps)
    for m in mlps:
        m.track_stats = True
    model(ids)
    assert all(m.stats.tokens == 22 for m in mlps)


def test_sparsify_shares_parameters_and_trains():
    model = build(LlamaConfig, LlamaForCausalLM, "silu")
    gate = model.model.layers[0].mlp.gate_proj.weight
    sparsify(model)
    assert model.model.layers[0].mlp.gate_proj.weight is gate
    model.train()
    out = model(torch.randint(0, 97, (1, 9)), labels=torch.randint(0, 97, (1, 9)))
    out.loss.backward()
    assert gate.grad is not None and torch.isfinite(gate.grad).all()


def test_sparsify_filter_and_idempotence():
    model = build(LlamaConfig, LlamaForCausalLM, "relu")
    sparsify(model, filter=lambda name, m: name.startswith("model.layers.1."))
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    assert kinds == ["LlamaMLP", "SparseGatedMLP"]
    sparsify(model)
    sparsify(model)  # nothing left to swap, no error
    assert all(isinstance(layer.mlp, SparseGatedMLP) for layer in model.model.layers)


def test_sparsify_needs_a_module():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got dict"):
        sparsify({"model": None})


def test_sparsify_without_gated_mlp_raises():
    with pytest.raises(ValueError, match="no gated MLP"):
        sparsify(torch.nn.Sequential(torch.nn.Linear(4, 4)))


def test_save_and_reload_round_trip(tmp_path):
    model = sparsify(build(LlamaConfig, LlamaForCausalLM, "silu"))
    model.save_pretrained(tmp_path)
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path, torch_dtype=torch.float64).eval()
    assert reloaded.config.hidden_act == "relu"
    ids = torch.randint(0, 97, (1, 8))
    assert rel_err(sparsify(reloaded)(ids).logits, model(ids).logits) < 1e-12


def test_convert_command(tmp_path, capsys):
    from twell.cli import main

    src, dst = tmp_path / "src", tmp_path / "dst"
    build(Qwen2Config, Qwen2ForCausalLM, "silu").save_pretrained(src)
    main(["convert", str(src), str(dst), "--dtype", "float32"])
    assert "converted 2 MLPs of Qwen2ForCausalLM" in capsys.readouterr().out
    reloaded = Qwen2ForCausalLM.from_pretrained(dst)
    assert reloaded.config.hidden_act == "relu"
    sparsify(reloaded)
    assert isinstance(reloaded.model.layers[0].mlp, SparseGatedMLP)


def test_convert_command_errors_are_one_line(tmp_path):
    """A missing folder, a model without gated MLPs, a destination that is not empty: one line
    naming the problem, before anything is written."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from twell.cli import main

    with pytest.raises(SystemExit, match=r"^twell convert: .*nowhere is not a folder$"):
        main(["convert", str(tmp_path / "nowhere"), str(tmp_path / "out")])
    gpt2 = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32)).save_pretrained(gpt2)
    with pytest.raises(SystemExit, match=r"^twell convert: .*gpt2: .*gated MLP"):
        main(["convert", str(gpt2), str(tmp_path / "out2")])
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("x")
    with pytest.raises(SystemExit, match=r"^twell convert: .*full exists and is not an empty folder$"):
        main(["convert", str(gpt2), str(full)])
    assert (full / "keep.txt").read_text() == "x" and sorted(p.name for p in full.iterdir()) == ["keep.txt"]


def test_convert_command_expands_the_home_folder(tmp_path, monkeypatch, capsys):
    from twell.cli import main

    monkeypatch.setenv("HOME", str(tmp_path))
    build(Qwen2Config, Qwen2ForCausalLM, "silu").save_pretrained(tmp_path / "src")
    main(["convert", "~/src", "~/dst"])
    assert "converted 2 MLPs" in capsys.readouterr().out and (tmp_path / "dst" / "config.json").is_file()


def test_cli_help(capsys):
    from twell.cli import main

    main([])
    out = capsys.readouterr().out
    assert all(cmd in out for cmd in ("train", "eval", "bench", "convert"))


def test_sparsify_puts_the_statistics_on_the_weights_device():
    model = LlamaForCausalLM(LlamaConfig(**TINY)).to("meta")
    sparsify(model)
    for m in twell.sparse_modules(model):
        assert m.fire_counts.device.type == "meta" and m.tokens_seen.device.type == "meta"


def test_a_second_sparsify_keeps_the_modules():
    torch.manual_seed(0)
    model = sparsify(LlamaForCausalLM(LlamaConfig(**TINY)))
    mlp = model.model.layers[0].mlp
    sparsify(model)
    assert model.model.layers[0].mlp is mlp


class _MLP(torch.nn.Module):
    def __init__(self, gate, up, down):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate, up, down


def test_sparsify_refuses_mixed_biases_and_wrong_shapes():
    lin = torch.nn.Linear
    mixed = torch.nn.Sequential()
    mixed.add_module("mlp", _MLP(lin(8, 16), lin(8, 16), lin(16, 8, bias=False)))
    with pytest.raises(ValueError, match="biases or none"):
        sparsify(mixed)
    wrong = torch.nn.Sequential()
    wrong.add_module("mlp", _MLP(lin(8, 16, bias=False), lin(8, 16, bias=False), lin(16, 4, bias=False)))
    with pytest.raises(ValueError, match=r"expected \[f, d\]"):
        sparsify(wrong)


def test_sparsify_leaves_the_config_when_asked():
    model = LlamaForCausalLM(LlamaConfig(hidden_act="silu", **TINY))
    sparsify(model, set_config_activation=False)
    assert model.config.hidden_act == "silu"


def test_convert_honours_dtype(tmp_path):
    from twell.hf import convert

    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(**TINY)).double().save_pretrained(tmp_path / "src")
    model = convert(str(tmp_path / "src"), str(tmp_path / "dst"), dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    back = Qwen2ForCausalLM.from_pretrained(tmp_path / "dst", dtype="auto")
    assert back.model.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16


def test_is_gated_mlp_needs_all_three_projections():
    """A module without an up_proj Linear is not a gated MLP: swapping it would fail on the
    missing projection (or drop a non-Linear one) instead of leaving it alone."""
    lin = torch.nn.Linear
    assert twell.hf.is_gated_mlp(_MLP(lin(8, 16), lin(8, 16), lin(16, 8)))
    for gate, up, down in ((lin(8, 16), None, lin(16, 8)), (None, lin(8, 16), lin(16, 8)),
                           (lin(8, 16), lin(8, 16), torch.nn.Identity())):
        mlp = _MLP(gate, up, down)
        assert not twell.hf.is_gated_mlp(mlp)
        holder = torch.nn.Sequential()
        holder.add_module("mlp", mlp)
        with pytest.raises(ValueError, match="no gated MLP"):
            sparsify(holder)


def test_sparsify_refuses_an_up_projection_unlike_the_gate():
    """gate_proj and up_proj must both be [f, d] with biases alike: the checks on down_proj
    alone let an up_proj of another width, or the only bias on up_proj, through to the kernels."""
    lin = torch.nn.Linear
    for up, match in ((lin(8, 12, bias=False), r"expected \[f, d\]"), (lin(8, 16), "biases or none")):
        model = torch.nn.Sequential()
        model.add_module("mlp", _MLP(lin(8, 16, bias=False), up, lin(16, 8, bias=False)))
        with pytest.raises(ValueError, match=match):
            sparsify(model)
        assert type(model.mlp) is _MLP  # nothing swapped


def test_sparsify_of_a_bare_mlp_raises():
    """The root module is never swapped (there is no parent to put the new module in): a bare
    LlamaMLP gets the "no gated MLP" error rather than a silent no-op."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    with pytest.raises(ValueError, match="no gated MLP"):
        sparsify(LlamaMLP(LlamaConfig(**TINY)))


def test_sparsify_filter_is_given_each_mlp():
    model = build(LlamaConfig, LlamaForCausalLM, "relu")
    second = model.model.layers[1].mlp
    seen = []
    sparsify(model, filter=lambda name, m: seen.append(name) or m is second)
    assert "model.layers.0.mlp" in seen and "model.layers.1.mlp" in seen
    assert [type(layer.mlp).__name__ for layer in model.model.layers] == ["LlamaMLP", "SparseGatedMLP"]


def test_sparsify_builds_no_weights():
    """The new modules are built on the meta device and take the model's Parameters: building
    them with real weights would hold a second copy of each MLP for a moment and draw their
    initialisation from the global generator (a seeded run would then differ with sparsify)."""
    model = LlamaForCausalLM(LlamaConfig(**TINY))
    state = torch.random.get_rng_state()
    sparsify(model)
    assert torch.equal(torch.random.get_rng_state(), state)


def test_sparsified_training_model_counts_on_the_weights_device():
    """The statistics buffers are made on the weights' device (here the CPU), not left on the
    meta device the module was built on: a training forward must count into real tensors."""
    model = sparsify(build(LlamaConfig, LlamaForCausalLM, "relu").train())
    model(torch.randint(0, 97, (2, 5)))
    for m in twell.sparse_modules(model):
        assert m.fire_counts.device.type == "cpu" and m.tokens_seen.device.type == "cpu"
        assert int(m.tokens_seen) == 10 and torch.equal(m.fire_counts, m.stats.unit_counts)


def test_sparsify_swaps_an_mlp_shared_by_two_layers_at_both():
    """One MLP instance registered under two names (layers sharing their MLP): named_modules()
    lists it once, and the second name kept the dense MLP (SiLU here), while the config said
    ReLU. Both names now hold the same SparseGatedMLP."""
    model = build(LlamaConfig, LlamaForCausalLM, "silu")
    layers = model.model.layers
    layers[1].mlp = layers[0].mlp
    sparsify(model)
    assert isinstance(layers[0].mlp, SparseGatedMLP) and layers[1].mlp is layers[0].mlp


@pytest.mark.parametrize("act", ["silu", "gelu", "relu", None])
def test_activation_note_names_a_non_relu_activation(act):
    note = twell.hf.activation_note(act)
    if act in ("relu", None):
        assert note is None
    else:
        assert act in note and "ReLU" in note

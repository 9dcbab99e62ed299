"""Hugging Face models as layer lists (`hf:PATH`): tiny GPT-2 and Llama configs built here, saved
with `transformers`' own save_pretrained, read back by pipectl. The layer chain gives the
`transformers` model's logits exactly; bad directories are named; a two-stage pipeline (real
ranks) trains with the one-rank losses, and its checkpoint exports to a directory transformers
loads with the same loss."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM  # noqa: E402

from pipectl.errors import UserInputError  # noqa: E402
from pipectl.models import build_model  # noqa: E402
from pipectl.models.base import shape_of  # noqa: E402
from pipectl.models.hf import hf_layer_names  # noqa: E402
from pipectl.paths import stored_reference  # noqa: E402
from builders import gpt_tiny_candidate, plan_of, train_run  # noqa: E402

VOCAB, SEQ = 256, 32
TOKENS = {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}


def gpt2_config(layers: int = 3) -> GPT2Config:
    return GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=layers, n_head=4,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **TOKENS)  # fmt: skip


def llama_config(tied: bool) -> LlamaConfig:
    return LlamaConfig(vocab_size=VOCAB, max_position_embeddings=SEQ, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                       tie_word_embeddings=tied, **TOKENS)  # fmt: skip


def saved(model_class, config, folder):
    torch.manual_seed(0)
    model = model_class(config).eval()
    model.save_pretrained(folder)
    return model


def chain_logits(reference: str, input_ids: torch.Tensor) -> torch.Tensor:
    """Run pipectl's layer list of `reference` in order, as one pipeline stage would."""
    layers = build_model(reference)
    holders: dict[str, torch.nn.Module] = {}
    x = input_ids
    with torch.no_grad():
        for layer in layers.layers:
            if layer.tied_forward is not None and layer.tie_key in holders:
                x = layer.forward(holders[layer.tie_key], x)
                continue
            module = layer.build().eval()
            if layer.tie_key is not None:
                holders[layer.tie_key] = module
            x = layer.forward(module, x)
    return x


@pytest.mark.parametrize(
    "model_class, config",
    [(GPT2LMHeadModel, gpt2_config()), (LlamaForCausalLM, llama_config(tied=False)), (LlamaForCausalLM, llama_config(tied=True))],
    ids=["gpt2-tied", "llama", "llama-tied"],
)
def test_the_layer_chain_gives_the_transformers_models_logits(tmp_path, model_class, config):
    model = saved(model_class, config, tmp_path)
    input_ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(input_ids).logits
    assert torch.equal(chain_logits(f"hf:{tmp_path}", input_ids), expected)


def test_layers_are_embed_blocks_norm_head_with_the_models_parameter_names(tmp_path):
    model = saved(GPT2LMHeadModel, gpt2_config(), tmp_path)
    layers = build_model(f"hf:{tmp_path / 'config.json'}")
    assert [layer.name for layer in layers.layers] == ["embed", "block.0", "block.1", "block.2", "final_norm", "head"]
    assert layers.layers[-1].tie_key == "embed" and (layers.seq_len, layers.hidden, layers.vocab) == (SEQ, 64, VOCAB)
    names = {hf for layer in hf_layer_names(layers) for hf in layer.values()}
    assert names == set(model.state_dict()) - {"lm_head.weight"}  # tied: stored once, as the token table
    shape = shape_of(layers)
    assert shape.parameter_count == sum(p.numel() for p in model.parameters())


def test_without_weights_the_layers_start_from_a_seeded_initialisation(tmp_path):
    (tmp_path / "config.json").write_text(llama_config(tied=False).to_json_string())
    first = build_model(f"hf:{tmp_path}").layers[1]
    torch.manual_seed(5)
    a = first.build().state_dict()
    torch.manual_seed(5)
    b = first.build().state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    weight = a["layer.self_attn.q_proj.weight"]
    assert abs(weight.std().item() - 0.02) < 0.005  # transformers' initializer_range, not PyTorch's default


def test_bad_directories_are_named(tmp_path):
    with pytest.raises(UserInputError, match="no Hugging Face config at .*nowhere/config.json"):
        build_model(f"hf:{tmp_path / 'nowhere'}")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5"}))
    with pytest.raises(UserInputError, match="model_type 't5' is not a supported") as caught:
        build_model(f"hf:{tmp_path}")
    assert "gpt2, llama" in caught.value.hint


def test_the_stored_reference_is_absolute(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(gpt2_config().to_json_string())
    monkeypatch.chdir(tmp_path.parent)
    assert stored_reference(f"hf:{tmp_path.name}") == f"hf:{tmp_path}"


@pytest.mark.multiprocess
def test_a_two_stage_gpt2_trains_with_the_one_rank_losses_and_exports_to_transformers(tmp_path):
    """Then its step-4 checkpoint, exported and loaded by transformers, gives the loss pipectl
    logged at step 5 (computed with the step-4 weights) on that step's batch."""
    from transformers import AutoModelForCausalLM

    from pipectl.launch import LaunchOptions, prepare_launch, run_engine
    from pipectl.runtime.data import DeterministicBatches, make_source
    from pipectl.runtime.hf_export import export_hf
    from pipectl.rundir.metrics import read_metrics

    saved(GPT2LMHeadModel, gpt2_config(layers=4), tmp_path / "gpt2")  # 7 layers: embed, 4 blocks, norm, head
    reference = f"hf:{tmp_path / 'gpt2'}"
    one = gpt_tiny_candidate(1, b=4, m=2).model_copy(update={"stage_layers": [(0, 7)]})
    two = gpt_tiny_candidate(2, b=4, m=2).model_copy(update={"stage_layers": [(0, 3), (3, 7)]})
    reference_run = train_run(plan_of(one, model=reference), tmp_path / "one", 5, warmup_steps=0, timeout_seconds=150)
    prepared = prepare_launch(plan_of(two, model=reference), tmp_path / "two", LaunchOptions(steps=5, checkpoint_every=4))
    assert run_engine(prepared.command, prepared.run_dir, timeout_seconds=150) == 0
    expected = [m.loss for m in read_metrics(reference_run)]
    losses = [m.loss for m in read_metrics(prepared.run_dir)]
    assert len(expected) == 5 and expected[-1] < expected[0]
    assert losses == pytest.approx(expected, rel=1e-5)

    exported, step = export_hf(prepared.run_dir, tmp_path / "exported", step=4)
    model = AutoModelForCausalLM.from_pretrained(exported).eval()
    inputs, labels = DeterministicBatches(make_source(build_model(reference), None, 0), 8, 0).global_batch_tensors(step)
    with torch.no_grad():
        logits = model(inputs).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1)).item()
    assert loss == pytest.approx(losses[step], rel=1e-5)  # losses[4]: step 5, before its update


def test_export_refuses_a_run_of_another_model_and_an_existing_directory(tmp_path):
    from pipectl.launch import LaunchOptions, prepare_launch
    from pipectl.runtime.hf_export import export_hf

    prepare_launch(plan_of(gpt_tiny_candidate(1)), tmp_path / "tiny", LaunchOptions(steps=2))
    with pytest.raises(UserInputError, match="trains gpt-tiny, not a Hugging Face model"):
        export_hf(tmp_path / "tiny", tmp_path / "out")
    saved(GPT2LMHeadModel, gpt2_config(), tmp_path / "gpt2")
    one = gpt_tiny_candidate(1).model_copy(update={"stage_layers": [(0, 6)]})
    prepare_launch(plan_of(one, model=f"hf:{tmp_path / 'gpt2'}"), tmp_path / "hf", LaunchOptions(steps=2))
    with pytest.raises(UserInputError, match="exists; export writes a new directory"):
        export_hf(tmp_path / "hf", tmp_path / "gpt2")
    with pytest.raises(UserInputError, match="has no verified checkpoint") as caught:
        export_hf(tmp_path / "hf", tmp_path / "out")
    assert "it has none verified" in caught.value.hint  # not "verified checkpoints: steps none"
    assert not (tmp_path / "out").exists()


@pytest.mark.multiprocess
def test_a_llama_on_a_text_file_resized_from_two_stages_to_one_rank_keeps_the_one_rank_losses(tmp_path):
    """The README as the corpus (bytes: the model has no tokenizer), steps 1-5 on a two-stage
    pipeline, then a resize to one rank for steps 6-8: every loss equals the uninterrupted one-rank run's."""
    import shutil
    from pathlib import Path

    from pipectl.artifacts.plan import MorphEntry
    from pipectl.artifacts.run import DataKind, DataSpec
    from pipectl.launch import LaunchOptions, prepare_launch, run_engine
    from pipectl.resize.restart import resize_run
    from pipectl.rundir.metrics import read_metrics

    saved(LlamaForCausalLM, llama_config(tied=False), tmp_path / "llama")  # 6 layers: embed, 3 blocks, norm, head
    reference = f"hf:{tmp_path / 'llama'}"
    corpus = DataSpec(kind=DataKind.FILE, path=str(Path(__file__).resolve().parents[2] / "README.md"))
    one = gpt_tiny_candidate(1, b=4, m=2).model_copy(update={"stage_layers": [(0, 6)]})
    two = gpt_tiny_candidate(2, b=4, m=2).model_copy(update={"stage_layers": [(0, 3), (3, 6)]})
    table = [MorphEntry(devices=1, candidate=one), MorphEntry(devices=2, candidate=two)]

    def run(candidate, folder, steps):
        prepared = prepare_launch(plan_of(candidate, model=reference, morph_table=table), folder,
                                  LaunchOptions(steps=steps, data=corpus))  # fmt: skip
        assert run_engine(prepared.command, prepared.run_dir, timeout_seconds=150) == 0
        return prepared.run_dir

    expected = [m.loss for m in read_metrics(run(one, tmp_path / "one", 8))]
    split = run(two, tmp_path / "two", 5)
    resized = tmp_path / "resized"
    shutil.copytree(split, resized)
    result = resize_run(resized, 1, steps=8, run_timeout_seconds=150)
    assert result.exit_code == 0, (resized / "logs" / "engine.log").read_text()[-3000:]
    metrics = read_metrics(resized)
    assert [m.layout.split()[0] for m in metrics] == ["t1p2d1"] * 5 + ["t1p1d1"] * 3
    assert [m.loss for m in metrics] == pytest.approx(expected, rel=1e-5)


def test_the_example_tiny_llama_is_a_model(tmp_path):
    import runpy
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "examples" / "tiny_llama.py"
    runpy.run_path(str(script), run_name="example").get("main")(str(tmp_path / "llama"))
    layers = build_model(f"hf:{tmp_path / 'llama'}")
    assert len(layers.layers) == 7 and (layers.seq_len, layers.vocab) == (64, 256)


@pytest.mark.parametrize(
    "config",
    [gpt2_config(), llama_config(tied=False), llama_config(tied=True),
     LlamaConfig(vocab_size=VOCAB, max_position_embeddings=SEQ, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=4, attention_bias=True, mlp_bias=True, **TOKENS)],
    ids=["gpt2", "llama-gqa", "llama-tied", "llama-biases"],
)  # fmt: skip
def test_the_derived_shape_has_the_models_layers_and_parameters(tmp_path, config):
    from pipectl.catalog import get_device
    from pipectl.models.hf import model_config
    from pipectl.profile.derive import derive_profile

    (tmp_path / "config.json").write_text(config.to_json_string())
    reference = f"hf:{tmp_path}"
    built = shape_of(build_model(reference))
    shape = model_config(reference)
    assert shape.layer_parameter_counts() == built.layer_parameter_counts
    profile = derive_profile(shape, get_device("a100-80gb"), [1, 2])
    layers = build_model(reference).layers
    assert [(p.name, p.kind) for p in profile.layers] == [(layer.name, layer.kind) for layer in layers]
    assert [p.parameter_count for p in profile.layers] == built.layer_parameter_counts
    assert [p.shared_group for p in profile.layers] == [layer.tie_key for layer in layers]


def test_a_llama_blocks_derived_flops_and_memory_follow_its_shape(tmp_path):
    from pipectl.catalog import get_device
    from pipectl.models.hf import model_config
    from pipectl.profile.derive import derive_profile

    config = LlamaConfig(vocab_size=32000, max_position_embeddings=4096, hidden_size=4096, intermediate_size=11008,
                         num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=8)  # fmt: skip
    (tmp_path / "config.json").write_text(config.to_json_string())
    profile = derive_profile(model_config(f"hf:{tmp_path}"), get_device("a100-80gb"), [1, 2])
    block = profile.layers[1]
    h, s, i, kv = 4096, 4096, 11008, 8 * 128
    assert block.cost(1).forward_flops == 2 * s * (2 * h * h + 2 * h * kv + 3 * h * i) + 4 * s * s * h
    one, two = block.cost(1), block.cost(2)
    assert 1.8 < two.forward_seconds / one.forward_seconds < 2.2  # GEMM-bound: linear in b
    # 1.66 TFLOP of forward GEMMs at 74 % of 312 TFLOP/s is 7.2 ms; attention and element-wise work add.
    assert 0.0072 < one.forward_seconds < 0.011
    assert {shard.tensor_parallel for shard in block.shards} == {2, 4, 8}  # 8 kv heads: t = 8 still divides


def test_a_derived_profile_of_a_hugging_face_directory_plans_and_launches_for_a_gpu_cluster(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from pipectl.cli.main import app

    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(llama_config(tied=False).to_json_string())
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    steps = [
        ["profile", "hf:llama", "--derive", "--device", "a100-80gb", "-o", "profile.json"],
        ["plan", "--profile", "profile.json", "--cluster", "a100-8x8", "--global-batch", "64", "-o", "plan.json"],
        ["launch", "plan.json", "--run-dir", "run", "--engine", "slurm", "--steps", "1000", "--data", "synthetic",
         "--dry-run"],  # checks the model against the plan
    ]
    for args in steps:
        result = runner.invoke(app, args, env={"COLUMNS": "200"})
        assert result.exit_code == 0, (args, result.output)
    assert f'"model": "hf:{tmp_path / "llama"}"' in result.output  # job.json: the absolute directory


# --------------------------------------------------------------------------- tensor parallelism


@pytest.mark.parametrize("model_class, config", [(GPT2LMHeadModel, gpt2_config()), (LlamaForCausalLM, llama_config(tied=False))],
                         ids=["gpt2", "llama"])  # fmt: skip
def test_a_split_decoder_layer_holds_its_ranks_slices_under_the_same_names(tmp_path, model_class, config):
    from pipectl.models.tensor_parallel import TensorParallelGroup, shard_model

    saved(model_class, config, tmp_path)
    model = build_model(f"hf:{tmp_path}")
    full = model.layers[1].build().state_dict()
    halves = [shard_model(model, TensorParallelGroup.without_communication(2, r)).layers[1].build() for r in range(2)]
    states = [half.state_dict() for half in halves]
    assert list(states[0]) == list(full)  # names unchanged: checkpoints and export map them as before
    if model_class is GPT2LMHeadModel:  # Conv1D (in, out): c_attn's columns are [q_r; k_r; v_r]
        q = torch.cat([s["layer.attn.c_attn.weight"][:, :32] for s in states], dim=1)
        assert torch.equal(q, full["layer.attn.c_attn.weight"][:, :64])
        assert torch.equal(torch.cat([s["layer.attn.c_proj.weight"] for s in states]), full["layer.attn.c_proj.weight"])
    else:
        for name, dim in (("self_attn.k_proj", 0), ("mlp.up_proj", 0), ("self_attn.o_proj", 1), ("mlp.down_proj", 1)):
            joined = torch.cat([s[f"layer.{name}.weight"] for s in states], dim=dim)
            assert torch.equal(joined, full[f"layer.{name}.weight"]), name
    split = dict(halves[0].named_parameters())
    assert getattr(split["layer.mlp." + ("c_fc" if model_class is GPT2LMHeadModel else "gate_proj") + ".weight"],
                   "tensor_model_parallel", False)  # fmt: skip


def test_a_split_needs_divisible_heads_and_no_dropout(tmp_path):
    from pipectl.models.tensor_parallel import TensorParallelGroup, shard_model

    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(llama_config(tied=False).to_json_string())  # 4 heads, 2 kv heads
    with pytest.raises(UserInputError, match=r"the key/value heads \(2\) do not divide by tensor-parallel degree 4"):
        shard_model(build_model(f"hf:{tmp_path / 'llama'}"), TensorParallelGroup.without_communication(4)).layers[1].build()
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(GPT2Config(n_embd=64, n_layer=1, n_head=4, n_positions=SEQ, vocab_size=VOCAB,
                                                              **TOKENS).to_json_string())  # fmt: skip
    with pytest.raises(UserInputError, match="needs dropout 0") as caught:
        shard_model(build_model(f"hf:{tmp_path / 'gpt2'}"), TensorParallelGroup.without_communication(2)).layers[1].build()
    assert "config.json" in caught.value.hint


@pytest.mark.multiprocess
@pytest.mark.parametrize("model_class, config", [(GPT2LMHeadModel, gpt2_config()), (LlamaForCausalLM, llama_config(tied=False))],
                         ids=["gpt2", "llama"])  # fmt: skip
def test_two_tensor_ranks_give_the_one_rank_losses(tmp_path, model_class, config):
    from pipectl.artifacts.layout import Layout
    from pipectl.runtime.job import TrainingJob
    from pipectl.runtime.worker import spawn_ranks
    from builders import training_config

    saved(model_class, config, tmp_path)
    layers = len(build_model(f"hf:{tmp_path}").layers)

    def losses(layout):
        job = TrainingJob(f"hf:{tmp_path}", layout, training_config(layout), steps=6, seed=1)
        return {rank: outcome.losses for rank, outcome in spawn_ranks(job, timeout_seconds=180).items()}

    reference = losses(Layout(1, 1, 2, 4, ((0, layers),)))[0]
    split = losses(Layout(1, 1, 2, 4, ((0, layers),), tensor_parallel=2))
    assert reference[-1] < reference[0]
    for rank, got in split.items():
        assert got == pytest.approx(reference, rel=1e-4), rank


def test_a_weights_index_naming_files_outside_the_directory_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(gpt2_config().to_json_string())
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"transformer.wte.weight": "../x.safetensors"}}))
    with pytest.raises(UserInputError, match="names '../x.safetensors', not a file of"):
        build_model(f"hf:{tmp_path}").layers[0].build()


def test_damaged_or_pickled_weights_and_impossible_configs_are_named(tmp_path):
    model = saved(LlamaForCausalLM, llama_config(tied=False), tmp_path / "pickled")
    (tmp_path / "pickled" / "model.safetensors").unlink()
    torch.save(model.state_dict(), tmp_path / "pickled" / "pytorch_model.bin")
    with pytest.raises(UserInputError, match="pytorch_model.bin, a pickle") as caught:
        build_model(f"hf:{tmp_path / 'pickled'}").layers[0].build()
    assert "safe_serialization=True" in caught.value.hint
    saved(GPT2LMHeadModel, gpt2_config(), tmp_path / "damaged")
    (tmp_path / "damaged" / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(UserInputError, match="cannot be read as safetensors"):
        build_model(f"hf:{tmp_path / 'damaged'}").layers[0].build()
    (tmp_path / "zero").mkdir()
    (tmp_path / "zero" / "config.json").write_text(json.dumps({**json.loads(gpt2_config().to_json_string()), "vocab_size": 0}))
    with pytest.raises(UserInputError, match="vocab_size is 0, not a positive whole number"):
        build_model(f"hf:{tmp_path / 'zero'}")


def test_a_model_this_host_cannot_hold_is_refused_whole_and_marked_shape_only_per_layer(tmp_path, monkeypatch):
    import pipectl.models.registry as registry

    (tmp_path / "config.json").write_text(llama_config(tied=False).to_json_string())
    total = sum(shape_of(build_model(f"hf:{tmp_path}")).layer_parameter_counts)
    monkeypatch.setattr(registry, "host_memory_bytes", lambda: 4 * total - 1)  # a host one byte short
    with pytest.raises(UserInputError, match="as float32, more than this host's") as caught:
        build_model(f"hf:{tmp_path}")
    assert "--once" in caught.value.hint and "shape_only: true" not in caught.value.hint
    assert build_model(f"hf:{tmp_path}", allow_shape_only=True).shape_only  # one layer at a time


def test_launch_refuses_a_tensor_split_the_models_heads_or_dropout_do_not_allow(tmp_path):
    from pipectl.launch import LaunchOptions, prepare_launch

    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(llama_config(tied=False).to_json_string())  # 2 key/value heads
    four = gpt_tiny_candidate(1, b=4, m=2).model_copy(update={"stage_layers": [(0, 6)], "tensor_parallel": 4, "devices": 4})
    with pytest.raises(UserInputError, match=r"key/value heads \(2\) do not divide by tensor-parallel degree 4"):
        prepare_launch(plan_of(four, model=f"hf:{tmp_path / 'llama'}"), tmp_path / "run", LaunchOptions(steps=2), write=False)
    assert not (tmp_path / "run").exists()


def test_a_hugging_face_llamas_plan_emits_its_architecture_for_megatron_and_torchtitan(tmp_path):
    """From a working directory, `hf:llama` as a user names it: Megatron's arguments named only the
    layer count and widths (a user following them trained a GPT-2-like model), and torchtitan's
    header called a Llama none of its decoders."""
    from cli_process import pipectl

    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(llama_config(tied=False).to_json_string())
    assert pipectl("profile", "hf:llama", "--derive", "--device", "a100-80gb", "-o", "p.json", cwd=tmp_path).returncode == 0
    planned = pipectl("plan", "--profile", "p.json", "--cluster", "a100-8x8", "--global-batch", "32", "--pipeline-parallel",
                      "3", "--no-morph", "--emit", "megatron", "-o", "meg/", cwd=tmp_path)  # fmt: skip
    assert planned.returncode == 0, planned.stderr
    args = (tmp_path / "meg" / "megatron-args.sh").read_text()
    for flag in ("--group-query-attention --num-query-groups 2", "--ffn-hidden-size 128", "--swiglu",
                 "--normalization RMSNorm", "--position-embedding-type rope", "--untie-embeddings-and-output-weights"):
        assert flag in args, flag
    (tmp_path / "elsewhere").mkdir()
    exported = pipectl("export-plan", "../meg/plan.json", "--to", "torchtitan", "-o", "tt", cwd=tmp_path / "elsewhere")
    assert exported.returncode == 0, exported.stderr
    assert "none of torchtitan's decoders" not in (tmp_path / "elsewhere" / "tt" / "torchtitan.toml").read_text()

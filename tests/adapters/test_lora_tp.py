"""``model.lora`` with ``distributed.tp_size`` > 1 (issue 32): TP plans shard PEFT's LoRA layers.

A tiny Hugging Face Llama with LoRA on q/k/v/o and gate/up/down, built as the YAML path builds it
(``apply_adapters``, then ``build_pipeline`` over the pp mesh, then ``apply_tensor_parallel`` with
the built-in plan), at pp2 x tp2 on 4 gloo ranks: the loss and every adapter gradient
(``full_tensor()``) equal the unsplit PEFT model's on one process (1e-5) for 1F1B and for zero
bubble (split backward) with sequence parallelism, and the base gets no gradient. Column-wise
layers hold ``lora_B`` sharded and ``lora_A`` replicated, row-wise ones ``lora_A`` sharded and
``lora_B`` replicated; the demo GPT's fused ``qkv`` shards its ``lora_B`` strided like its base;
FSDP2 over tp (dp_shard2 x tp2) gives the same gradients. Dropout > 0: each tp rank drops its own
slice of the features, so the sharded layer computes exactly what PEFT's layer computes with one
mask (the one the ranks drew together). A ``pp-core run`` at pp2 x tp2 hands the adapter back as
PEFT writes it. (Refusals: test_lora_tp_checks.py.)
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

ATOL = 1e-5
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": TARGETS,
        "init_lora_weights": False}  # lora_B != 0: every adapter gets a gradient


def lora_tp_case(schedule: str, sequence_parallel: bool, arch: str = "llama") -> dict:
    """One step at pp2 x tp2 against the unsplit PEFT model on one process (``arch``: the tiny
    Llama, or the demo GPT with PEFT's default targets, its fused ``qkv`` a strided shard)."""
    from pp_core import PipelineConfig, build_pipeline
    from pp_core.app.adapters import apply_adapters
    from pp_core.losses import resolve_loss
    from pp_core.parallel import apply_tensor_parallel
    from pp_core_builtins.transformers import causal_lm_loss
    from tests.cases import hf, runtime
    from tests.cases.tp import pp_tp_mesh, tiny_gpt

    torch.set_num_threads(1)
    mesh = pp_tp_mesh()
    torch.manual_seed(3)
    llama = arch == "llama"
    settings = LORA if llama else {"r": 4, "alpha": 8, "init_lora_weights": False}
    reference = apply_adapters(hf.tiny_model("llama", 4) if llama else tiny_gpt(4), settings,
                               None, tp_size=2)
    model = copy.deepcopy(reference)
    config = PipelineConfig(pp_schedule=schedule, pp_batch_size=8, pp_microbatch_size=2,
                            loss_fn=causal_lm_loss if llama else "cross_entropy")
    pipe = build_pipeline(model, config, pp_group=mesh["pp"])
    modules = apply_tensor_parallel(pipe.model_parts, mesh["tp"],
                                    sequence_parallel=sequence_parallel)
    inputs, labels = hf.batch(8) if llama else runtime.batch("gpt", 8)
    loss = pipe.step(inputs, target=labels)
    if llama:
        expected, grads = hf.reference_step(reference, inputs, labels, config.num_microbatches)
    else:
        expected = runtime.reference(reference, resolve_loss("cross_entropy"), inputs, labels,
                                     config.num_microbatches, scale=False)
        grads = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    worst, trained, base_grads, placements = 0.0, [], [], {}
    for part in pipe.model_parts:
        for name, param in part.named_parameters():
            if not param.requires_grad:
                base_grads += [name] if param.grad is not None else []
                continue
            trained.append(name)
            placements[name] = str(tuple(param.placements))
            if tuple(param.grad.placements) != tuple(param.placements):  # step reduced them
                placements[name] += f" with a {tuple(param.grad.placements)} gradient"
            grad = param.grad.full_tensor()
            worst = max(worst, (grad - grads[name]).abs().max().item())
    return {"loss_err": None if loss is None else abs(float(loss) - float(expected)),
            "worst": worst, "trained": trained, "base_grads": base_grads,
            "placements": placements, "modules": modules}


pytestmark = pytest.mark.ranks(4, timeout=300)


def check(results) -> None:
    losses = [r["loss_err"] for r in results if r["loss_err"] is not None]
    assert len(losses) == 2 and max(losses) <= ATOL, losses  # both tp ranks of the last stage
    for result in results:
        assert result["worst"] <= ATOL and not result["base_grads"], result
        assert result["modules"] > 0 and all(".lora_" in n for n in result["trained"])


@pytest.mark.parametrize("schedule, sequence_parallel", [("1f1b", False), ("zero_bubble", True)],
                         ids=["1f1b", "zero_bubble-sequence_parallel"])
def test_lora_at_pp2_tp2_matches_the_unsplit_peft_model(pool, schedule, sequence_parallel):
    results = pool.run(lora_tp_case, schedule, sequence_parallel)
    check(results)
    trained = {n for r in results for n in r["trained"]}
    assert len(trained) == 4 * len(TARGETS) * 2
    placements = {k: v for r in results for k, v in r["placements"].items()}
    for name, placement in placements.items():
        colwise = not any(f".{kind}." in name for kind in ("o_proj", "down_proj"))
        sharded = ".lora_B." in name if colwise else ".lora_A." in name
        want = ("(Shard(dim=0),)" if colwise else "(Shard(dim=1),)") if sharded \
            else "(Replicate(),)"
        assert placement == want, (name, placement)


def test_lora_on_the_demo_gpt_with_its_strided_qkv(pool):
    """PEFT's default targets of the demo GPT (qkv, proj, ffn.0, ffn.2): ``qkv``'s ``lora_B`` is
    sharded as its base is, whole heads of q, k and v on each tp rank."""
    results = pool.run(lora_tp_case, "1f1b", False, arch="gpt")
    check(results)
    placements = {k: v for r in results for k, v in r["placements"].items()}
    assert "_StridedShard" in placements["layers.0.qkv.lora_B.default.weight"], placements
    assert placements["layers.0.qkv.lora_A.default.weight"] == "(Replicate(),)"


def fsdp_case() -> dict:
    """dp_shard2 x tp2 (sequence parallel; pp 1): FSDP2 shards the tp-sharded LoRA layers again,
    on the 2-D (dp_shard, tp) mesh; one step on a global batch of 8 against one process."""
    from pp_core import PipelineConfig, build_pipeline
    from pp_core.app.adapters import apply_adapters
    from pp_core.parallel import parallelize
    from pp_core_builtins.transformers import causal_lm_loss
    from tests.cases import hf
    from tests.cases.meshes import meshes

    torch.set_num_threads(1)
    run_meshes = meshes(pp=1, dp_shard=2, tp=2, sequence_parallel=True)
    torch.manual_seed(3)
    reference = apply_adapters(hf.tiny_model("llama", 2), LORA, None, tp_size=2)
    config = PipelineConfig(pp_schedule="1f1b", pp_batch_size=4, pp_microbatch_size=2,
                            loss_fn=causal_lm_loss)
    pipe = build_pipeline(copy.deepcopy(reference), config, meshes=run_meshes)
    parallelize(pipe, run_meshes)  # tp, then FSDP2 over dp_shard
    inputs, labels = hf.batch(8)
    start = 4 * run_meshes.dp_rank
    mine = slice(start, start + 4)
    with warnings.catch_warnings(record=True) as caught:  # FSDP2 on a stage returning a view
        loss = pipe.step({k: v[mine] for k, v in inputs.items()}, target=labels[mine])
    expected, grads = hf.reference_step(reference, inputs, labels, 4)
    worst, trained = 0.0, 0
    for name, param in pipe.model_parts[0].named_parameters():
        if param.requires_grad:  # the dp mean of the sums over each rank's 2 microbatches
            trained += 1
            worst = max(worst, (param.grad.full_tensor() - grads[name] / 2).abs().max().item())
        else:
            worst = max(worst, float(param.grad is not None))
    return {"loss": float(loss), "expected": float(expected), "worst": worst,
            "trained": trained, "mesh": str(param.device_mesh.mesh_dim_names),
            "warned": [str(w.message) for w in caught if "returned a view" in str(w.message)]}


def test_lora_with_fsdp2_over_tp(pool):
    results = pool.run(fsdp_case)
    assert abs(sum(r["loss"] for r in results) / 4 - results[0]["expected"]) <= ATOL
    for result in results:
        assert result["worst"] <= ATOL and result["trained"] == 2 * len(TARGETS) * 2, result
        assert result["mesh"] == "('dp_shard', 'tp')", result
        assert result["warned"] == [], result  # the runtime never writes into a stage's output


class TwoLayers(torch.nn.Module):
    """A column-wise and a row-wise Linear (the attention's and the MLP's pattern)."""

    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class Masked(torch.nn.Module):
    """PEFT's dropout with a given outcome: ``x`` where ``dropped`` is not 0, scaled."""

    def __init__(self, dropped, p: float):
        super().__init__()
        self.keep = (dropped != 0) / (1 - p)

    def forward(self, x):
        return x * self.keep


P = 0.5


def dropout_case() -> dict:
    """LoRA with dropout on a column- and a row-wise layer at tp2, against PEFT's layers on one
    process given the masks the tp ranks drew (their dropouts' outputs, gathered)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from pp_core.app.adapters import apply_adapters
    from pp_core.parallel import apply_tensor_parallel
    from pp_core.parallel.lora_tp import ShardedDropout
    from tests.cases.tp import pp_tp_mesh

    torch.set_num_threads(1)
    tp = pp_tp_mesh()["tp"]
    torch.manual_seed(0)
    settings = {"r": 2, "alpha": 4, "dropout": P, "target_modules": ["up", "down"],
                "init_lora_weights": False}
    model = apply_adapters(TwoLayers(), settings, None, tp_size=2)
    reference = copy.deepcopy(model)
    apply_tensor_parallel([model], tp, plan={"up": ColwiseParallel(), "down": RowwiseParallel()})
    dropped = {}
    for name in ("up", "down"):
        dropout = getattr(model, name).lora_dropout["default"]
        assert isinstance(dropout, ShardedDropout), dropout
        dropout.register_forward_hook(
            lambda module, args, out, name=name: dropped.__setitem__(name, out.full_tensor()))
    x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(7), requires_grad=True)
    weight = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(8))
    out = model(x)
    (out * weight).sum().backward()
    for name in ("up", "down"):
        getattr(reference, name).lora_dropout["default"] = Masked(dropped[name], P)
    x_ref = x.detach().clone().requires_grad_(True)
    out_ref = reference(x_ref)
    (out_ref * weight).sum().backward()
    grads = dict(reference.named_parameters())
    grad_err = max((p.grad.full_tensor() - grads[n].grad).abs().max().item()
                   for n, p in model.named_parameters() if p.requires_grad)
    half = dropped["up"].shape[-1] // 2
    up_kept = dropped["up"] != 0
    return {"out_err": (out - out_ref).abs().max().item(), "grad_err": grad_err,
            "x_grad_err": (x.grad - x_ref.grad).abs().max().item(),
            "dropped": {n: (t == 0).float().mean().item() for n, t in dropped.items()},
            "same_halves": torch.equal(up_kept[..., :half], up_kept[..., half:]),
            "trained": sorted(n for n, p in model.named_parameters() if p.requires_grad)}


def test_dropout_drops_each_feature_on_one_tp_rank(pool):
    """The sharded layers compute PEFT's ``base(x) + B(A(dropout(x))) * scaling`` with one mask:
    output, input gradient and adapter gradients equal one process given that mask; the two
    ranks' slices are drawn apart (not one pattern twice)."""
    for result in pool.run(dropout_case):
        assert result["out_err"] <= ATOL and result["x_grad_err"] <= ATOL, result
        assert result["grad_err"] <= ATOL, result
        assert all(0.2 < share < 0.8 for share in result["dropped"].values()), result
        assert not result["same_halves"]
        assert len(result["trained"]) == 4


def _source(directory):
    """A tiny Llama made with ``save_pretrained`` (the base a fine-tune starts from)."""
    import transformers

    config = transformers.AutoConfig.for_model(
        "llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(1)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


def _base(source):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        str(source), attn_implementation="eager", local_files_only=True).eval()


@pytest.mark.cli
def test_a_lora_tp2_run_exports_the_adapter_peft_loads(tmp_path):
    """``pp-core run`` of a LoRA YAML at pp2 x tp2 (sequence parallel, dropout 0.05) trains 2
    steps; ``pp-core export CKPT --format hf`` of its checkpoint writes PEFT's own adapter files
    (what ``save_pretrained`` writes of the checkpoint's adapters on one process: whole tensors
    under PEFT's names), ``PeftModel.from_pretrained`` of them gives the trained logits, and
    ``--merge`` the merged model's."""
    from peft import PeftModel, get_peft_model
    from safetensors.torch import load_file

    from pp_core.app import cli
    from pp_core.app.adapters import lora_config
    from pp_core.checkpoint import checkpoint_path, read_model_state_dict
    from tests.cases.hf_export import pretrained_logits, run_losses

    source = _source(tmp_path / "source")
    lora = {**LORA, "dropout": 0.05}
    lora.pop("init_lora_weights")  # PEFT's own start: lora_B = 0, the base's logits
    losses = run_losses(tmp_path, {
        "model": {"name": "hf_causal_lm", "lora": lora,
                  "args": {"config": str(source), "attn_implementation": "eager"}},
        "data": {"name": "synthetic", "args": {"seq_len": 8, "vocab_size": 64}},
        "pipeline": {"pp_schedule": "zero_bubble", "pp_batch_size": 4, "pp_microbatch_size": 2,
                     "loss_fn": "cross_entropy"},
        "distributed": {"pp_size": 2, "tp_size": 2, "sequence_parallel": True, "device": "cpu"},
        "train": {"steps": 2, "log_every": 1, "optimizer": {"name": "AdamW", "lr": 0.02}},
        "checkpoint": {"dir": str(tmp_path / "ckpt")},
        "output": {"progress": "off", "summary": False,
                   "metrics": str(tmp_path / "metrics.jsonl")}})
    assert len(losses) == 2
    step = checkpoint_path(tmp_path / "ckpt", 2)
    out = tmp_path / "adapter"
    assert cli.main(["export", str(step), "--format", "hf", "-o", str(out)]) == 0

    base = _base(source)
    trained = get_peft_model(_base(source), lora_config(lora, base)).eval()
    trained.base_model.model.load_state_dict(read_model_state_dict(step), strict=True)
    trained.save_pretrained(str(tmp_path / "peft"))  # PEFT's own files of the same adapters
    ours, theirs = (load_file(str(d / "adapter_model.safetensors"))
                    for d in (out, tmp_path / "peft"))
    assert sorted(ours) == sorted(theirs) and len(ours) == 4 * len(TARGETS) * 2
    assert all(torch.equal(ours[n], theirs[n]) for n in theirs)
    ids = torch.randint(64, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = trained(input_ids=ids).logits
        loaded = PeftModel.from_pretrained(_base(source), str(out)).eval()
        torch.testing.assert_close(loaded(input_ids=ids).logits, want, rtol=0, atol=1e-6)
        assert not torch.allclose(base(input_ids=ids).logits, want, atol=1e-4)  # it trained
    merged = tmp_path / "merged"
    assert cli.main(["export", str(step), "--format", "hf", "--merge", "-o", str(merged)]) == 0
    with torch.no_grad():
        torch.testing.assert_close(pretrained_logits(merged, ids), want, rtol=1e-5, atol=1e-5)

"""LoRA (``model.lora``) on a Hugging Face Llama with tied embeddings, split by ``hf_decoder``
on 2 gloo ranks: the loss and every adapter gradient equal the unsplit PEFT model's, the base
gets no gradient, and a split backward schedule and a frozen prefix work as with the demo GPT.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")


ATOL = 1e-5


def lora_llama_case(schedule: str, layers_to_transform=None) -> dict:
    from pp_core import PipelineConfig, build_pipeline
    from pp_core.app.adapters import apply_adapters
    from pp_core_builtins.transformers import causal_lm_loss
    from tests.cases.hf import batch, reference_step, tiny_model

    settings = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"],
                "init_lora_weights": False}
    if layers_to_transform is not None:
        settings["layers_to_transform"] = list(layers_to_transform)
    torch.manual_seed(3)
    reference = apply_adapters(tiny_model("llama", 4, tie_word_embeddings=True), settings, None)
    model = copy.deepcopy(reference)
    config = PipelineConfig(pp_schedule=schedule, pp_batch_size=8, pp_microbatch_size=2,
                            loss_fn=causal_lm_loss)
    pipe = build_pipeline(model, config)
    inputs, labels = batch(8)
    loss = pipe.step(inputs, target=labels)
    expected, grads = reference_step(reference, inputs, labels, config.num_microbatches)
    worst, trained, base_grads = 0.0, [], []
    for part in pipe.model_parts:
        for name, param in part.named_parameters():
            if not param.requires_grad:
                base_grads += [name] if param.grad is not None else []
                continue
            trained.append(name)
            worst = max(worst, (param.grad - grads[name]).abs().max().item())
    return {"loss_err": None if loss is None else abs(loss.item() - expected.item()),
            "worst": worst, "trained": trained, "base_grads": base_grads,
            "trainable": pipe.plan.trainable}


pytestmark = pytest.mark.ranks(2)


@pytest.mark.parametrize("schedule, layers", [("zero_bubble", None), ("1f1b", (2, 3))],
                         ids=["zero_bubble", "1f1b-frozen-prefix"])
def test_lora_llama_matches_the_unsplit_peft_model(pool, schedule, layers):
    results = pool.run(lora_llama_case, schedule, layers)
    losses = [r["loss_err"] for r in results if r["loss_err"] is not None]
    assert len(losses) == 1 and losses[0] <= ATOL
    for result in results:
        assert result["worst"] <= ATOL and not result["base_grads"]
    trained = [n for r in results for n in r["trained"]]
    assert trained and all(".lora_" in n for n in trained)
    assert results[0]["trainable"] == ((False, True) if layers else (True, True))


def test_lora_on_a_model_each_stage_loads_from_a_save_pretrained_directory(tmp_path):
    """``hf_causal_lm(config=DIR)`` builds on meta and each part loads its own tensors: PEFT's
    ``base_layer`` names load from the base's, the adapters get PEFT's init (B = 0, so the
    adapted model starts as the base), the same on every build."""
    from pp_core import PipelineConfig, build_pipeline
    from pp_core.app.adapters import apply_adapters
    from pp_core_builtins.transformers import causal_lm_loss, hf_causal_lm
    from tests.cases.hf import batch, tiny_model

    base = tiny_model("llama", 4, tie_word_embeddings=True)
    base.save_pretrained(str(tmp_path))
    settings = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    config = PipelineConfig(pp_schedule="1f1b", pp_batch_size=4, pp_microbatch_size=2,
                            loss_fn=causal_lm_loss)
    inputs, labels = batch(4)
    with torch.no_grad():
        want = causal_lm_loss(base(**inputs).logits, labels)
    states = []
    for _ in range(2):
        model = apply_adapters(hf_causal_lm(str(tmp_path), attn_implementation="eager"),
                               settings, None)
        pipe = build_pipeline(model, config)
        torch.testing.assert_close(pipe.eval_step(inputs, target=labels), want, rtol=0,
                                   atol=1e-6)
        state = {n: p.detach().clone() for part in pipe.model_parts
                 for n, p in part.named_parameters()}
        assert all(not t.abs().any() for n, t in state.items() if ".lora_B." in n)
        assert any(t.abs().any() for n, t in state.items() if ".lora_A." in n)
        for name, tensor in base.state_dict().items():
            key = name.replace("q_proj.", "q_proj.base_layer.").replace("v_proj.",
                                                                        "v_proj.base_layer.")
            if key in state:
                assert torch.equal(state[key], tensor), name
        states.append(state)
    assert all(torch.equal(states[0][n], states[1][n]) for n in states[0])


def test_the_adapter_export_of_an_hf_model_loads_with_peft(tmp_path):
    """A LoRA Llama's checkpoint (as DCP keys ``model.<name>``, its run recorded beside it)
    exports to what ``PeftModel.from_pretrained`` loads onto the base: the same logits; merged
    (streamed, ``--merge``), to what ``merge_and_unload().save_pretrained`` writes."""
    import json

    import torch.distributed.checkpoint as dcp
    from peft import PeftModel

    from pp_core.app.adapters import apply_adapters
    from pp_core.app.export.peft import export_merged, export_peft_adapter
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM
    from tests.cases.hf import batch, tiny_config, tiny_model

    settings = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"],
                "init_lora_weights": False}
    trained = apply_adapters(tiny_model("llama", 2, tie_word_embeddings=True), settings, None)
    step = tmp_path / "step_00000001"
    dcp.save({f"model.{k}": v for k, v in trained.state_dict().items()},
             checkpoint_id=str(step), no_dist=True)
    section = {"name": "hf_causal_lm", "target": None, "lora": settings,
               "args": {"config": tiny_config("llama", 2, tie_word_embeddings=True),
                        "attn_implementation": "eager"}}
    (step / "pp_core_run.json").write_text(json.dumps({"model": section}))
    out = export_peft_adapter(step, tmp_path / "adapter")
    loaded = PeftModel.from_pretrained(tiny_model("llama", 2, tie_word_embeddings=True),
                                       str(out)).eval()
    inputs, _ = batch(2)
    with torch.no_grad():
        torch.testing.assert_close(loaded(**inputs).logits, trained.eval()(**inputs).logits,
                                   rtol=0, atol=1e-6)
    merged = export_merged(step, tmp_path / "merged")
    reference = loaded.merge_and_unload()  # PEFT's own merge of the exported adapter
    reference.save_pretrained(str(tmp_path / "reference"))
    assert sorted(p.name for p in merged.iterdir()) == \
        sorted(p.name for p in (tmp_path / "reference").iterdir())
    with safe_open(str(merged / "model.safetensors"), "pt") as ours, \
            safe_open(str(tmp_path / "reference" / "model.safetensors"), "pt") as theirs:
        assert set(ours.keys()) == set(theirs.keys())
        for name in theirs.keys():
            torch.testing.assert_close(ours.get_tensor(name), theirs.get_tensor(name), rtol=0,
                                       atol=1e-7)
    unmerged = AutoModelForCausalLM.from_pretrained(str(merged), attn_implementation="eager")
    with torch.no_grad():
        torch.testing.assert_close(unmerged(**inputs).logits, trained(**inputs).logits,
                                   rtol=1e-5, atol=1e-5)

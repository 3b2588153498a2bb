"""NeMo AutoModel's pipelining contract, one process (issue 20): an initializer with NeMo's
keyword-only ``prepare``, a ``get_pipeline_runtime_initializers`` provider, a model laid out like
an HF causal LM without being a ``transformers`` model, both ``module_fqns_per_model_part`` and
``layers_per_stage`` set, a missing schedule CSV caught as ``FileNotFoundError``, keyword inputs
whose batch dim is not 0, ``model.dtype`` in YAML, and ``pp-core validate`` listing each stage's
runtime initializers. The 2-rank halves are in ``tests/nemo/test_nemo_pipeline.py``."""

from __future__ import annotations

import pytest
import torch
import yaml

from pp_core import PipelineConfig, ScheduleError, build_pipeline
from pp_core.errors import ConfigError, PluginError
from pp_core.planning.plan import plan_pipeline
from pp_core.runtime import collect_pipeline_runtime_initializers
from tests.cases.nemo import DIM, ROPE, MropeLM, NemoLM, NemoRope, lm_loss, rope_lm
from tests.app.test_validate_build import BASE, validate


def test_keyword_only_prepare_runs_before_each_microbatch():
    ROPE.calls.clear()
    model = rope_lm()
    pipe = build_pipeline(model, PipelineConfig(pp_batch_size=4, pp_microbatch_size=2,
                                                loss_fn=lm_loss))
    ids = torch.randint(0, 64, (4, 6))
    pipe.step(ids, target=ids)
    assert ROPE.calls == [(12, "cpu"), (12, "cpu")]  # once per microbatch, 2 x 6 tokens


def test_get_pipeline_runtime_initializers_is_collected():
    found = collect_pipeline_runtime_initializers([rope_lm(3)])
    assert found == [ROPE]


def test_both_names_must_agree():
    class Both(torch.nn.Module):
        def pipeline_runtime_initializers(self):
            return [NemoRope(DIM)]

        def get_pipeline_runtime_initializers(self):
            return [NemoRope(2 * DIM)]

    with pytest.raises(PluginError, match=r"Both defines both pipeline_runtime_initializers\(\) "
                                          r"\(pp-core\) and get_pipeline_runtime_initializers\(\) "
                                          r"\(NeMo AutoModel\) and they answer differently"):
        collect_pipeline_runtime_initializers([Both()])

    class Same(Both):  # equal answers (new objects each call) are fine: pp-core's name first
        def get_pipeline_runtime_initializers(self):
            return self.pipeline_runtime_initializers()

    assert [i.signature for i in collect_pipeline_runtime_initializers([Same()])] == \
        [("rope", DIM)]


def test_hf_shaped_model_is_split_without_transformers():
    """NeMo's own model classes: model.embed_tokens/layers/norm + lm_head, no PreTrainedModel."""
    plan = plan_pipeline(NemoLM(num_layers=4), PipelineConfig(pp_schedule="interleaved_1f1b",
                                                              pp_batch_size=4,
                                                              layers_per_stage=1), 2)
    assert plan.split.splitter == "hf_decoder"
    assert plan.split.fqns_per_stage == [
        ["model.embed_tokens", "model.layers.0", "model.rotary_emb"],
        ["model.layers.1", "model.rotary_emb"], ["model.layers.2", "model.rotary_emb"],
        ["model.layers.3", "model.norm", "lm_head", "model.rotary_emb"]]


@pytest.mark.parametrize("name", ["language_model", "text_model", "text_decoder"])
def test_text_module_found_under_nemo_names(name):
    model = NemoLM(num_layers=2, text=name)
    plan = plan_pipeline(model, PipelineConfig(pp_batch_size=2), 2)
    assert plan.split.fqns_per_stage[0][0] == f"{name}.embed_tokens"


def test_fqn_lists_win_over_layers_per_stage_with_a_warning():
    fqns = [["model.embed_tokens", "model.layers.0", "model.rotary_emb"],
            ["model.layers.1", "model.norm", "lm_head", "model.rotary_emb"]]
    config = PipelineConfig(pp_batch_size=2, module_fqns_per_model_part=fqns, layers_per_stage=4)
    with pytest.warns(UserWarning, match=r"layers_per_stage=4 are both set; the module lists fix "
                                         r"the stages, so layers_per_stage is ignored"):
        plan = plan_pipeline(NemoLM(num_layers=2), config, 2)
    assert plan.split.fqns_per_stage == fqns


def test_missing_schedule_csv_is_a_file_not_found_error(tmp_path):
    config = PipelineConfig(pp_schedule=None, pp_schedule_csv=str(tmp_path / "nope.csv"))
    with pytest.raises(FileNotFoundError) as caught:
        plan_pipeline(None, config, 2)
    assert isinstance(caught.value, ScheduleError)
    assert str(caught.value) == f"schedule CSV '{tmp_path / 'nope.csv'}' does not exist (or is " \
                                f"not a file)"


def test_keyword_chunk_dims_declared_by_the_model():
    from pp_core.runtime.microbatch import kwargs_chunk_dims, split_microbatches

    pos = torch.arange(3 * 4 * 5).reshape(3, 4, 5)
    kwargs = {"position_ids": pos, "mask": torch.ones(4, 5)}
    dims = kwargs_chunk_dims(MropeLM(), kwargs)
    assert dims == {"position_ids": 1}
    parts = split_microbatches(kwargs, 2, 4, "stage_kwargs", dims)
    assert torch.equal(parts[1]["position_ids"], pos[:, 2:])
    assert torch.equal(parts[1]["mask"], torch.ones(2, 5))
    assert kwargs_chunk_dims(NemoLM(), kwargs) == {}  # no method: dim 0 everywhere

    class Wrong(torch.nn.Module):
        def get_pipeline_kwargs_chunk_dims(self, kwargs):
            return {"position_id": 1}

    with pytest.raises(ConfigError, match=r"Wrong.get_pipeline_kwargs_chunk_dims names "
                                          r"'position_id', which is not among"):
        kwargs_chunk_dims(Wrong(), kwargs)


def test_model_dtype_casts_parameters_in_yaml(tmp_path, capsys):
    from pp_core.app.spec import load_spec

    path = tmp_path / "pipe.yaml"
    path.write_text(yaml.safe_dump({**BASE, "model": {**BASE["model"], "dtype": "bf16"}}))
    assert load_spec(str(path), []).model.dtype == "bfloat16"
    code, text = validate(tmp_path, capsys, "model.dtype=int64")
    assert code == 1 and "model.dtype" in text, text


def test_validate_prints_each_stages_runtime_initializers(tmp_path, capsys):
    data = {**BASE, "model": {"target": "tests.cases.nemo:rope_lm", "args": {"num_layers": 2}},
            "data": {"name": "synthetic", "args": {"seq_len": 8, "vocab_size": 64}}}
    code, text = validate(tmp_path, capsys, data=data)
    assert code == 0, text
    assert "runtime initializers (prepared before each microbatch):" in text, text
    assert "stage 0: key ('rope-cache',), signature ('rope', 16), 1 module" in text, text
    assert "stage 1: key ('rope-cache',), signature ('rope', 16), 1 module" in text, text


def test_a_splitter_that_copies_a_shared_weight_silently_is_refused():
    from pp_core.planning.parts import build_model_parts, prune_model
    from pp_core.planning.split import plan_split

    fqns = [["model.embed_tokens", "model.layers.0", "model.layers.1", "model.rotary_emb"],
            ["model.layers.2", "model.layers.3", "model.norm", "lm_head", "model.rotary_emb"]]

    class Copying:
        name = "copying"

        def split(self, model, num_stages, config):
            return fqns

        def make_part(self, model, names, stage_index, num_stages, config):
            part = prune_model(model, names)
            rotary = part.model.rotary_emb = torch.nn.Module.__new__(type(model.model.rotary_emb))
            rotary.__dict__.update(model.model.rotary_emb.__dict__)
            rotary._parameters = {"scale": torch.nn.Parameter(model.model.rotary_emb.scale.clone())}
            return part

    model = NemoLM(trainable_rope=True)
    plan = plan_split(model, PipelineConfig(pp_batch_size=2), 2, 1, splitter=Copying())
    assert ("model.rotary_emb.scale",) in plan.tied_parameters
    with pytest.raises(PluginError, match=r"stage 1 holds its own copy of "
                                          r"'model.rotary_emb.scale', a weight stages \[0, 1\] "
                                          r"share, without recording it"):
        build_model_parts(model, plan, [1], None)

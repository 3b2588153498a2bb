"""``model.splitter`` in YAML: ``balanced`` is profiled once before launch and every rank gets the
cut as module lists; other names pick that splitter; the limits say what to do."""

from __future__ import annotations

import copy
import os

import pytest
from tests.cases.specs import TINY, pp_core, write_spec

from pp_core import ConfigError
from pp_core.app.launch.decide import balanced_spec
from pp_core.app.launch import launch
from pp_core.planning.units import model_units
from pp_core.app.check import preflight
from pp_core.app.spec import SpecError, parse_spec
from pp_core_builtins.models import GPT


def spec(**model):
    values = copy.deepcopy(TINY)
    values["model"].update(model)
    return parse_spec(values, "tiny.yaml")


def test_the_cut_is_measured_once_and_written_into_the_spec():
    lines = []
    resolved = balanced_spec(spec(splitter="balanced"), say=lines.append)
    stages = resolved.pipeline.module_fqns_per_model_part
    units = model_units(GPT(**TINY["model"]["args"]))
    assert len(stages) == 2 and [fqn for stage in stages for fqn in stage] == \
        [fqn for unit in units for fqn in unit]
    assert stages[0][0] == "tok_embeddings" and stages[1][-1] == "output"
    assert len(lines) == 2 and lines[0].startswith("balanced split: stage 0: ")
    assert "ms forward+backward per microbatch (tok_embeddings .. " in lines[0]
    # what the ranks get plans without measuring again: the fqn splitter takes the lists
    assert preflight(resolved, run_checks=False).plan.splitter == "fqn"


def test_limits_name_the_fix(monkeypatch):
    both = spec(splitter="balanced").with_("pipeline", module_fqns_per_model_part=[
        ["tok_embeddings", "pos_embeddings", "layers.0"],
        ["layers.1", "layers.2", "layers.3", "norm", "output"]])
    with pytest.raises(ConfigError, match="names the stages too; remove one of them"):
        balanced_spec(both)
    nodes = spec(splitter="balanced").with_("distributed", nnodes=2)
    with pytest.raises(ConfigError, match="each of several nodes would measure its own cut"):
        balanced_spec(nodes)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="torchrun does not have; start it with `pp-core run`"):
        launch(spec(splitter="balanced"))


def test_other_names_pick_that_splitter_and_unknown_ones_are_refused():
    assert preflight(spec(splitter="layers"), run_checks=False).plan.splitter == "layers"
    with pytest.raises(SpecError, match="unknown splitter 'layer'"):
        preflight(spec(splitter="layer"), run_checks=False)
    with pytest.raises(SpecError, match="model.splitter: expected a non-empty string"):
        spec(splitter=3)


@pytest.mark.cli
@pytest.mark.ranks
def test_pp_core_run_with_a_balanced_split(tmp_path):
    path = write_spec(tmp_path / "balanced.yaml", TINY,
                      model={**TINY["model"], "splitter": "balanced"})
    result = pp_core("run", str(path), env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "pp-core: balanced split: stage 1: " in result.stdout
    assert "pp-core run summary" in result.stdout

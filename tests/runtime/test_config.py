"""PipelineConfig: exact fields and defaults, and a message naming field, value and fix."""

import dataclasses
import subprocess
import sys
from typing import Callable, Literal

import pytest
import torch

from pp_core import ConfigError, PipelineConfig
from pp_core.config import TorchDtype, field_types

DESIGN_DEFAULTS = {
    "pp_schedule": "1f1b", "pp_schedule_csv": None, "pp_microbatch_size": 1, "pp_batch_size": 1,
    "layers_per_stage": None, "round_virtual_stages_to_pp_multiple": None,
    "module_fqns_per_model_part": None, "patch_inner_model": True, "patch_causal_lm_model": True,
    "patch_stage_backward_maybe_with_nosync": False, "dtype": None,
    "scale_grads_in_schedule": False, "loss_fn": None, "pp_seq_len": None,
    "pp_recv_buffer_pool": False, "pp_recv_buffer_pool_slack": 2,
    "pp_seq_chunks": 1,  # DESIGN "Long sequences"
}


def test_fields_and_defaults_are_exactly_the_design():
    assert [f.name for f in dataclasses.fields(PipelineConfig)] == list(DESIGN_DEFAULTS)
    assert PipelineConfig().to_dict() == DESIGN_DEFAULTS


@pytest.mark.parametrize("kwargs, pattern", [
    ({"pp_batch_size": 0}, r"pp_batch_size=0 must be a positive int"),
    ({"pp_microbatch_size": -2}, r"pp_microbatch_size=-2 must be a positive int"),
    ({"pp_batch_size": 2.0}, r"pp_batch_size=2.0 must be a positive int"),
    ({"pp_batch_size": 10, "pp_microbatch_size": 4},
     r"pp_batch_size=10 is not divisible by pp_microbatch_size=4; use pp_batch_size=8 or 12"),
    ({"pp_recv_buffer_pool_slack": True}, r"pp_recv_buffer_pool_slack=True must be an int >= 0 \(a bool"),
    ({"pp_recv_buffer_pool_slack": -1}, r"pp_recv_buffer_pool_slack=-1 must be an int >= 0"),
    ({"pp_seq_chunks": 0}, r"pp_seq_chunks=0 must be a positive int"),
    ({"pp_seq_chunks": 2.0}, r"pp_seq_chunks=2.0 must be a positive int"),
    ({"pp_seq_chunks": 2, "pp_schedule_csv": "s.csv"},
     r"pp_seq_chunks=2 cannot run the CSV schedule 's.csv': a CSV orders whole microbatches"),
    ({"pp_seq_chunks": 3, "pp_seq_len": 64},
     r"pp_seq_chunks=3 must divide pp_seq_len=64 into equal slices; use a divisor of 64 such "
     r"as 2"),
    ({"pp_seq_chunks": 128, "pp_seq_len": 64}, r"pp_seq_chunks=128 must divide pp_seq_len=64"),
    ({"pp_recv_buffer_pool_slack": 1.5}, r"pp_recv_buffer_pool_slack=1.5"),
    ({"round_virtual_stages_to_pp_multiple": "nearest"},
     r"round_virtual_stages_to_pp_multiple='nearest' must be None, 'up' or 'down'"),
    ({"layers_per_stage": 0}, r"layers_per_stage=0 must be a positive int"),
    ({"pp_seq_len": 0}, r"pp_seq_len=0 must be a positive int"),
    ({"module_fqns_per_model_part": []}, r"must be a non-empty list of lists"),
    ({"module_fqns_per_model_part": [["a"], []]}, r"module_fqns_per_model_part\[1\]=\[\] must be a non-empty list"),
    ({"module_fqns_per_model_part": [["a", 3]]}, r"module_fqns_per_model_part\[0\] contains 3"),
    ({"dtype": "float33"}, r"dtype='float33' is not a torch dtype; use .* 'bfloat16'"),
    ({"loss_fn": "torch.nn.functional.cross_entropy"},
     r"neither a built-in loss nor a 'module:attr' string; did you mean 'torch.nn.functional:cross_entropy'"),
    ({"loss_fn": "cross_entropyy"}, r"unknown loss 'cross_entropyy'; did you mean 'cross_entropy'"),
    ({"loss_fn": 3}, r"loss_fn=3 is neither a callable nor a 'module:attr' string"),
    ({"loss_fn": "torch.nn.functional:cross_entropie"},
     r"has no attribute 'cross_entropie'; did you mean 'torch.nn.functional:cross_entropy'"),
    ({"loss_fn": "no_such_module_x:f"}, r"cannot import module 'no_such_module_x'"),
    ({"pp_schedule": ""}, r"pp_schedule='' must be a schedule name"),
    ({"scale_grads_in_schedule": "yes"}, r"scale_grads_in_schedule='yes' must be True or False"),
])
def test_invalid_values_are_named_with_the_fix(kwargs, pattern):
    with pytest.raises(ConfigError, match=pattern):
        PipelineConfig(**kwargs)


def test_fields_are_typed_as_the_design_types_them():
    types = field_types()
    assert types["pp_schedule"] == types["pp_schedule_csv"] == str | None
    assert types["round_virtual_stages_to_pp_multiple"] == Literal["up", "down"] | None
    assert types["module_fqns_per_model_part"] == list[list[str]] | None
    assert types["dtype"] == TorchDtype | None  # torch.dtype, read without importing torch
    assert types["loss_fn"] == Callable | str | None
    assert types["pp_batch_size"] is int and types["patch_inner_model"] is bool
    assert types["layers_per_stage"] == types["pp_seq_len"] == int | None


@pytest.mark.cli
def test_the_config_module_does_not_import_torch():
    code = "import sys, pp_core.config as c; c.field_types(); print('torch' in sys.modules)"
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True)
    assert found.stdout.strip() == "False"


@pytest.mark.parametrize("kwargs, field", [
    ({"pp_batch_size": 0}, "pp_batch_size"),
    ({"pp_batch_size": 10, "pp_microbatch_size": 4}, "pp_batch_size"),
    ({"pp_recv_buffer_pool_slack": -1}, "pp_recv_buffer_pool_slack"),
    ({"round_virtual_stages_to_pp_multiple": "nearest"}, "round_virtual_stages_to_pp_multiple"),
    ({"module_fqns_per_model_part": [["a"], []]}, "module_fqns_per_model_part"),
    ({"dtype": "pp_seq_len"}, "dtype"),
    ({"loss_fn": "layers_per_stage"}, "loss_fn"),
    ({"pp_schedule": None}, "pp_schedule"),
    ({"pp_recv_buffer_pool": 1}, "pp_recv_buffer_pool"),
])
def test_errors_carry_the_field_they_are_about(kwargs, field):
    with pytest.raises(ConfigError) as refused:
        PipelineConfig(**kwargs)
    assert refused.value.field == field


def test_pp_schedule_none_needs_the_csv_that_overrides_it():
    config = PipelineConfig(pp_schedule=None, pp_schedule_csv="order.csv")
    assert (config.pp_schedule, config.pp_schedule_csv) == (None, "order.csv")
    with pytest.raises(ConfigError, match=r"^pp_schedule=None needs pp_schedule_csv: set one of "
                                          r"the two, a schedule name such as pp_schedule='1f1b' "
                                          r"or a compute-only CSV file as pp_schedule_csv$"):
        PipelineConfig(pp_schedule=None)

def test_dtype_accepts_names_and_dtypes():
    assert PipelineConfig(dtype="bfloat16").torch_dtype is torch.bfloat16
    assert PipelineConfig(dtype="torch.float16").torch_dtype is torch.float16
    assert PipelineConfig(dtype=torch.float32).torch_dtype is torch.float32


def test_loss_fn_accepts_callable_and_import_string():
    PipelineConfig(loss_fn=torch.nn.functional.mse_loss)
    PipelineConfig(loss_fn="torch.nn.functional:mse_loss")


def test_num_microbatches():
    assert PipelineConfig(pp_batch_size=12, pp_microbatch_size=3).num_microbatches == 4


def test_from_dict_round_trips_and_suggests_the_closest_key():
    config = PipelineConfig(pp_schedule="gpipe", pp_batch_size=8, pp_microbatch_size=2,
                            module_fqns_per_model_part=[["a"], ["b"]])
    assert PipelineConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ConfigError, match=r"unknown PipelineConfig field 'pp_microbatchsize'; "
                                          r"did you mean 'pp_microbatch_size'\?"):
        PipelineConfig.from_dict({"pp_microbatchsize": 2})

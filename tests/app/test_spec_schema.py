"""Each key of a pipeline file is declared once, as a field of its section's dataclass
(:func:`pp_core.app.spec.sections.key`), and :data:`~pp_core.app.spec.schema.SCHEMA` is read from
those fields: the same sections, keys, checkers, defaults and docs, in the same order, as the
hand-written list it replaced (the snapshot below was taken from that list)."""

from __future__ import annotations

import dataclasses

import pytest

from pp_core.app.spec import SCHEMA
from pp_core.app.spec.checkers import integer, optional, text
from pp_core.app.spec.schema import REQUIRED_SECTIONS, _section_keys
from pp_core.app.spec.sections import KEY, SECTIONS, ModelSpec, TrainSpec, file_name, key
from pp_core.config import PipelineConfig


def checker(check) -> str:
    """A checker as the call that made it: ``optional(inner=integer(maximum=None, minimum=1,
    word='a positive int'))``; a plain function by its name."""
    cells = check.__closure__ or ()
    if not cells:
        return check.__qualname__
    values = [c.cell_contents for c in cells]
    made = ", ".join(f"{name}={checker(v) if callable(v) else repr(v)}"
                     for name, v in zip(check.__code__.co_freevars, values))
    return f"{check.__qualname__.partition('.')[0]}({made})"


# (key, checker, default, doc) per section, in file order
SNAPSHOT = {
    "model": [
        ("name", "optional(inner=text)", None,
         "a model registered by a plugin (pp_register_models)"),
        ("target", "optional(inner=text)", None,
         "or an importable 'module:callable' (imports code)"),
        ("args", "mapping", {}, "keyword arguments of the model factory"),
        ("splitter", "optional(inner=text)", None,
         "a splitter plugin by name (default: chosen automatically); balanced: profile before "
         "launch, split by measured time"),
        ("dtype", "optional(inner=param_dtype)", None,
         "cast the built model's parameters and buffers to this floating dtype before it is "
         "split (pipeline.dtype never does)"),
        ("lora", "optional(inner=lora)", None,
         "LoRA adapters built with peft: {r, alpha, dropout, target_modules, "
         "...peft.LoraConfig fields}; the base is frozen"),
        ("freeze", "optional(inner=patterns)", None,
         "parameters to freeze: fnmatch patterns of parameter or module FQNs (e.g. "
         "[tok_embeddings, layers.0])"),
    ],
    "data": [
        ("name", "text", None, "a dataset registered by a plugin (pp_register_datasets)"),
        ("args", "mapping", {}, "keyword arguments of the dataset factory"),
        ("eval_args", "mapping", {}, "overrides of args for evaluation (e.g. split: val)"),
    ],
    "pipeline": [
        ("pp_schedule", "optional(inner=text)", "1f1b", "PipelineConfig.pp_schedule"),
        ("pp_schedule_csv", "optional(inner=text)", None, "PipelineConfig.pp_schedule_csv"),
        ("pp_microbatch_size", "integer(maximum=None, minimum=1, word='a positive int')", 1,
         "PipelineConfig.pp_microbatch_size"),
        ("pp_batch_size", "integer(maximum=None, minimum=1, word='a positive int')", 1,
         "PipelineConfig.pp_batch_size"),
        ("layers_per_stage",
         "optional(inner=integer(maximum=None, minimum=1, word='a positive int'))",
         None,
         "PipelineConfig.layers_per_stage"),
        ("round_virtual_stages_to_pp_multiple",
         "optional(inner=one_of(options=('up', 'down')))",
         None,
         "PipelineConfig.round_virtual_stages_to_pp_multiple"),
        ("module_fqns_per_model_part", "anything", None,
         "PipelineConfig.module_fqns_per_model_part"),
        ("patch_inner_model", "flag", True, "PipelineConfig.patch_inner_model"),
        ("patch_causal_lm_model", "flag", True, "PipelineConfig.patch_causal_lm_model"),
        ("patch_stage_backward_maybe_with_nosync", "flag", False,
         "PipelineConfig.patch_stage_backward_maybe_with_nosync"),
        ("dtype", "anything", None, "PipelineConfig.dtype"),
        ("scale_grads_in_schedule", "flag", False, "PipelineConfig.scale_grads_in_schedule"),
        ("loss_fn", "anything", None, "PipelineConfig.loss_fn"),
        ("pp_seq_len",
         "optional(inner=integer(maximum=None, minimum=1, word='a positive int'))",
         None,
         "PipelineConfig.pp_seq_len"),
        ("pp_recv_buffer_pool", "flag", False, "PipelineConfig.pp_recv_buffer_pool"),
        ("pp_recv_buffer_pool_slack", "integer(maximum=None, minimum=0, word='an int >= 0')", 2,
         "PipelineConfig.pp_recv_buffer_pool_slack"),
        ("pp_seq_chunks", "integer_or(as_int=integer(maximum=None, minimum=1, word='a positive "
         "int'), word='auto')", 1,
         "PipelineConfig.pp_seq_chunks"),
    ],
    "distributed": [
        ("pp_size", "integer(maximum=None, minimum=1, word='a positive int')", 2,
         "pipeline ranks (stages are spread over them)"),
        ("dp_shard", "integer(maximum=None, minimum=1, word='a positive int')", 1,
         "FSDP2 degree: each pipeline stage's parameters, gradients and optimizer state are "
         "sharded over this many ranks"),
        ("dp_replicate", "integer(maximum=None, minimum=1, word='a positive int')", 1,
         "replicas of the whole pipeline (DDP semantics; HSDP together with dp_shard)"),
        ("dp_size", "integer(maximum=None, minimum=1, word='a positive int')", 1,
         "dp_replicate * dp_shard; written alone (older files) it means dp_replicate"),
        ("tp_size", "integer(maximum=None, minimum=1, word='a positive int')", 1,
         "tensor-parallel degree inside each stage (torch's parallelize_module with the "
         "model's plan from the pp_tensor_parallel_plan hook; the innermost mesh dimension)"),
        ("sequence_parallel", "flag", False,
         "with tp_size > 1: also shard norms and the activations between blocks and stages "
         "along the sequence"),
        ("ep_size", "integer(maximum=None, minimum=1, word='a positive int')", 1,
         "expert-parallel degree: each MoE layer's experts are sharded over this many of the "
         "dp ranks (it divides dp_replicate * dp_shard and num_experts; docs/experts.md)"),
        ("world_size",
         "optional(inner=integer(maximum=None, minimum=1, word='a positive int'))",
         None,
         "processes of the job; with layout: fixed it must equal the product of the degrees, "
         "with layout: auto 'pp-core plan' searches its factorisations"),
        ("layout", "one_of(options=('fixed', 'auto'))", "fixed",
         "auto: 'pp-core plan FILE' ranks every pp x dp_replicate x dp_shard x tp (x ep) "
         "layout of world_size processes and -o writes the chosen one; 'pp-core run' plans it"
         " only with nnodes 'MIN:MAX', for each world the run may be given (docs/failures.md)"),
        ("mixed_precision", "optional(inner=mixed_precision)", None,
         "{param_dtype, reduce_dtype} of the dp engines (FSDP2's MixedPrecisionPolicy), e.g. "
         "bfloat16 / float32"),
        ("backend", "one_of(options=('auto', 'gloo', 'nccl'))", "auto",
         "auto: nccl on CUDA, else gloo"),
        ("device", "one_of(options=('auto', 'cpu', 'cuda'))", "auto",
         "auto: cuda when every rank on the machine gets a GPU of its own, else cpu"),
        ("nnodes", "nnodes", 1,
         "machines taking part; each runs the same command; 'MIN:MAX' (torchrun's elastic "
         "form): the run goes on at a smaller dp when nodes are lost, and grows back "
         "(docs/failures.md)"),
        ("nproc_per_node",
         "optional(inner=integer(maximum=None, minimum=1, word='a positive int'))",
         None,
         "ranks per machine; default pp_size * dp_replicate * dp_shard * tp_size / nnodes"),
        ("node_rank", "optional(inner=integer(maximum=None, minimum=0, word='an int >= 0'))", None,
         "this machine's index (static rendezvous); with c10d, a node_rank > 0 never hosts the "
         "store"),
        ("master_addr", "address", "127.0.0.1",
         "address of the rendezvous host; loopback unless you name another"),
        ("master_port", "optional(inner=port)", None, "its port; default a free port (one node)"),
        ("rdzv_backend", "one_of(options=('c10d', 'static'))", "c10d",
         "torchrun's rendezvous backend"),
        ("rdzv_endpoint", "optional(inner=endpoint)", None,
         "host:port; default master_addr:master_port"),
        ("rdzv_id", "text", "pp-core", "the job id every node passes"),
        ("timeout_s",
         "integer(maximum=1000000000, minimum=1, word='an int in [1, 1000000000]')",
         300,
         "rendezvous and process-group timeout in seconds"),
        ("max_restarts", "integer(maximum=None, minimum=0, word='an int >= 0')", 0,
         "times torch's elastic agent starts every rank again after a rank dies or hangs; each "
         "restart resumes from the latest complete checkpoint of checkpoint.dir "
         "(docs/failures.md)"),
        ("elastic_wait_s", "integer(maximum=3600, minimum=1, word='an int in [1, 3600]')", 10,
         "with nnodes 'MIN:MAX': seconds a rendezvous that has MIN nodes waits for more "
         "(torch's last_call_timeout); a shrink waits this long for the lost node"),
    ],
    "train": [
        ("steps", "integer(maximum=None, minimum=1, word='a positive int')", 100,
         "optimizer steps"),
        ("optimizer", "mapping", {"name": "AdamW", "lr": 0.001},
         "{name: a torch.optim class, then its keyword arguments}"),
        ("warmup_steps", "integer(maximum=None, minimum=0, word='an int >= 0')", 0,
         "linear learning-rate warm-up from 0"),
        ("lr_decay", "one_of(options=('constant', 'linear', 'cosine'))", "constant",
         "learning-rate shape after warm-up"),
        ("min_lr_ratio", "number(bounds=' in [0.0, 1.0]', maximum=1.0, minimum=0.0)", 0.1,
         "final lr / peak lr for linear or cosine"),
        ("grad_clip", "optional(inner=positive_number)", None,
         "clip the global gradient norm to this (> 0)"),
        ("seed",
         "integer(maximum=18446744073709551615, minimum=0, "
         "word='an int in [0, 18446744073709551615]')",
         0,
         "model initialisation and data order"),
        ("log_every", "integer(maximum=None, minimum=1, word='a positive int')", 10,
         "steps between metric lines"),
        ("eval_every",
         "optional(inner=integer(maximum=None, minimum=1, word='a positive int'))",
         None,
         "steps between evaluations (data.eval_args)"),
        ("eval_steps", "integer(maximum=None, minimum=1, word='a positive int')", 2,
         "batches per evaluation"),
        ("activation_checkpointing", "activation_checkpointing", {"mode": "none", "every": 1},
         "{mode: none | full | selective | auto (chosen per stage by pp_schedule: auto), or a "
         "list with one mode per stage, every: N} per block (docs/activation_and_compile.md, "
         "docs/planning.md)"),
        ("on_nonfinite", "one_of(options=('stop', 'skip'))", "stop",
         "a step with a NaN/inf loss or gradient norm: stop the run (exit 1) or skip its "
         "update (docs/refuses.md)"),
        ("compile", "compile_options", {"enabled": False},
         "{enabled: bool, mode, fullgraph, dynamic, backend}: torch.compile each block "
         "(docs/activation_and_compile.md)"),
    ],
    "checkpoint": [
        ("dir", "optional(inner=text)", None, "where checkpoints go (one step_NNNNNNNN dir each)"),
        ("every", "optional(inner=integer(maximum=None, minimum=1, word='a positive int'))", None,
         "steps between checkpoints"),
        ("save_final", "flag", True, "also save after the last step (when dir is set)"),
        ("resume", "resume", False, "true: latest checkpoint in dir; or a checkpoint path"),
        ("export_hf", "export_hf", None,
         "DIR or {dir: DIR, every: N}: the ranks write a save_pretrained directory at the end "
         "(every N steps: DIR/step_NNNNNNNN)"),
        ("verify", "flag", True,
         "check every file's recorded checksum when a checkpoint is resumed, loaded or "
         "exported (false skips it)"),
        ("async", "flag", False,
         "save with torch.distributed.checkpoint.async_save: staged to host memory, written "
         "while training goes on (docs/failures.md)"),
    ],
    "output": [
        ("metrics", "optional(inner=text)", None, "JSON-lines metrics file"),
        ("trace", "optional(inner=text)", None, "Chrome trace (chrome://tracing, Perfetto)"),
        ("schedule_image", "optional(inner=text)", None,
         "SVG of a steady step as measured, above the same step simulated"),
        ("progress", "one_of(options=('auto', 'bar', 'plain', 'off'))", "auto",
         "auto: a bar on a terminal, plain lines otherwise"),
        ("summary", "flag", True, "print the summary table at the end"),
        ("tensorboard", "optional(inner=text)", None,
         "TensorBoard log directory (needs the tensorboard extra)"),
    ],
}
REQUIRED = ["data.name"]
OPEN_MAPPINGS = ["model.args", "data.args", "data.eval_args", "train.optimizer"]


def test_the_schema_read_from_the_sections_is_the_one_written_out_before():
    assert list(SCHEMA) == list(SNAPSHOT)
    for section, keys in SCHEMA.items():
        found = [(k.name, checker(k.check), k.default, k.doc) for k in keys]
        assert found == SNAPSHOT[section], section
    assert sorted(f"{s}.{k.name}" for s, keys in SCHEMA.items() for k in keys if k.required) \
        == REQUIRED
    assert [f"{s}.{k.name}" for s, keys in SCHEMA.items() for k in keys if k.open_mapping] \
        == OPEN_MAPPINGS
    assert REQUIRED_SECTIONS == ("model", "data")


def test_the_snapshot_tells_checkers_apart():
    assert checker(integer(1)) != checker(integer(0)) != checker(integer(1, 10))
    assert checker(optional(text)) == "optional(inner=text)" != checker(text)


def test_a_section_made_bare_holds_the_schema_defaults():
    assert list(SECTIONS) == list(SCHEMA)
    for section, keys in SCHEMA.items():
        declared = dataclasses.fields(SECTIONS[section])
        assert [file_name(f) for f in declared] == [k.name for k in keys], section
        made = SECTIONS[section]()
        for one, field in zip(keys, declared):
            assert getattr(made, field.name) == one.default, f"{section}.{one.name}"


def test_every_section_key_is_declared_with_key_and_a_mutable_default_is_never_shared():
    for section, kind in SECTIONS.items():
        if kind is not PipelineConfig:
            assert all(KEY in f.metadata for f in dataclasses.fields(kind)), section
    assert ModelSpec().args is not ModelSpec().args
    optimizer = next(k for k in SCHEMA["train"] if k.name == "optimizer").default
    made = TrainSpec()
    made.optimizer["lr"] = 5.0
    assert optimizer == TrainSpec().optimizer == {"name": "AdamW", "lr": 1e-3}


def test_a_field_declared_without_key_is_refused():
    @dataclasses.dataclass(frozen=True)
    class Loose:
        steps: int = key(1, integer(1), "steps")
        seed: int = 0

    with pytest.raises(TypeError, match=r"Loose\.seed is not declared with"):
        _section_keys(Loose)

"""``validate`` checks what the ranks will compute and see (issue #34, the validate-side classes):
a module the split runs more often than the unsplit model, evaluation batches, the data's
largest token id, argument types, runtime initializers that hang or exit, plans that do nothing.
Table-driven over real pipeline files and real model modules; each case asserts the whole
message a user sees and that no traceback is printed."""

from __future__ import annotations

import os
import sys

import pytest
import yaml

from pp_core.app import cli
from pp_core.plugin_manager import default_plugins
from tests.cases.specs import tiny_gpt_spec

ARGS = {"dim": 16, "num_layers": 3, "num_heads": 2, "max_seq_len": 8, "vocab_size": 64}
BASE = tiny_gpt_spec(model={"args": ARGS}, data={"args": {"vocab_size": 64}},
                     pipeline={"pp_schedule": None, "pp_batch_size": 2, "pp_microbatch_size": None},
                     train=None, output=None)
MODELS = '''
import threading

import torch
from torch import nn


class Init:
    def __init__(self, mode="ok", key="workspace", signature=1):
        self.mode, self.resource_key, self.signature = mode, key, signature

    def prepare(self, num_tokens, device):
        if self.mode == "block":
            threading.Event().wait(60)
        if self.mode == "exit":
            raise SystemExit(3)


class BadHash:
    def __hash__(self):
        raise ValueError("no hash today")

    def __repr__(self):
        return "BadHash()"


class NoKey:
    def prepare(self, num_tokens, device):
        pass


class WithInit(nn.Module):
    \"\"\"Two layers, each asking for a runtime resource; ``mode`` picks what goes wrong.\"\"\"
    def __init__(self, mode="ok"):
        super().__init__()
        self.mode = mode
        self.embed = nn.Embedding(64, 16)
        self.layers = nn.ModuleList([Layer(mode, i) for i in range(2)])
        self.head = nn.Linear(16, 64)

    def forward(self, x):
        h = self.embed(x) if self.embed is not None else x
        for layer in self.layers:
            h = layer(h)
        return self.head(h) if self.head is not None else h

    def pipeline_runtime_initializers(self):
        mode = self.mode
        if mode == "dict":
            return {"workspace": Init()}
        if mode == "int":
            return 3
        if mode == "nokey":
            return [NoKey()]
        if mode == "hash":
            return [Init(key=BadHash())]
        if mode == "raises":
            raise RuntimeError("no workspace for you")
        if mode == "generator":
            return self._generate()
        return [Init(mode)] if mode in ("block", "exit") else None

    def _generate(self):
        yield Init()
        raise KeyError("the second one")


class PlanModel(nn.Module):
    """A model the test plugin ppt_plans answers for, as ``mode`` says."""
    def __init__(self, mode="ok"):
        super().__init__()
        self.plan_mode = mode
        self.embed = nn.Embedding(64, 16)
        self.layers = nn.ModuleList([nn.Linear(16, 16) for _ in range(2)])
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 64)

    def forward(self, x):
        h = self.embed(x) if self.embed is not None else x
        for layer in self.layers:
            h = layer(h)
        h = self.norm(h) if self.norm is not None else h
        return self.head(h) if self.head is not None else h


class Layer(nn.Linear):
    \"\"\"``per_layer``: each layer's resource has its own signature (a conflict on one rank).\"\"\"
    def __init__(self, mode, index):
        super().__init__(16, 16)
        self.mode, self.index = mode, index

    def pipeline_runtime_initializers(self):
        return [Init(key="per_layer", signature=self.index)] if self.mode == "per_layer" else None


class Rotary(nn.Module):
    """Buffers only: every stage may recompute it."""
    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.ones(8, 16))

    def forward(self, x):
        return self.table[: x.shape[1]]


class Tied(nn.Module):
    """A shared rotary module every stage lists, and a head tied to the embedding."""
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.rotary = Rotary()
        self.layers = nn.ModuleList([nn.Linear(16, 16) for _ in range(2)])
        self.head = nn.Linear(16, 64, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x):
        h = self.embed(x) if self.embed is not None else x
        for layer in self.layers:
            h = layer(h) + self.rotary(h)
        return self.head(h) if self.head is not None else h
'''


def _with(section: str, **values) -> dict:
    return {**BASE, section: {**BASE.get(section, {}), **values}}


def _data(name="tokenized_text", train=None, **args) -> dict:
    """BASE on ``name`` with ``args`` (a tokenized corpus: files made in the test's directory)."""
    if name == "tokenized_text":
        args = {"files": ["corpus.jsonl"], "tokenizer": "gap.json", "seq_len": 8,
                "cache_dir": "cache", **args}
    found = {**BASE, "data": {"name": name, "args": args}}
    return {**found, "train": train} if train else found


def _moe(**args) -> dict:
    return _with("model", name="moe_gpt", args={**ARGS, "num_experts": 4, **args})


def _init(mode: str, **pipeline) -> dict:
    return {**BASE, "model": {"target": "models_mod:WithInit", "args": {"mode": mode}},
            "pipeline": {**BASE["pipeline"], **pipeline}}


def _sp(**values) -> dict:
    return {**BASE, "distributed": {"pp_size": 1, "tp_size": 2, "sequence_parallel": True},
            **values}


def _corpus(tmp_path) -> None:
    """A JSONL corpus whose 40th document holds id 300 (the gapped tokenizer's 'zz'), a corpus
    with a UTF-8 BOM, and bad ones: a number, a list, an object as text; a line not JSON."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2, "zz": 300},
                                           unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(tmp_path / "gap.json"))
    lines = ['{"text": "a b a b a b a b a b a b"}'] * 60
    lines[40] = '{"text": "a b zz a b a b a b a b"}'
    (tmp_path / "corpus.jsonl").write_text("\n".join(lines) + "\n")
    plain = "\n".join(['{"text": "a b a b a b a b a b a b"}'] * 60) + "\n"
    (tmp_path / "bom.jsonl").write_bytes("\ufeff".encode() + plain.encode())
    for name, value in (("number", "12"), ("list", '["a", "b"]'), ("object", '{"a": 1}'),
                        ("broken", '"a b')):
        bad = plain.splitlines()
        bad[2] = '{"text": %s}' % value
        (tmp_path / f"{name}.jsonl").write_text("\n".join(bad) + "\n")


def _validate(tmp_path, capsys, monkeypatch, values) -> tuple[int, str]:
    for name in ("models_mod", "ppt_plans"):  # this test's copies, not an earlier test's
        sys.modules.pop(name, None)
    (tmp_path / "models_mod.py").write_text(MODELS)
    (tmp_path / "a_file").write_text("not a directory")
    _corpus(tmp_path)
    _plugin_dist(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pipe.yaml").write_text(yaml.safe_dump(values))
    default_plugins.cache_clear()  # load this test's plugin distribution, not an earlier set
    try:
        code = cli.main(["validate", str(tmp_path / "pipe.yaml")])
    finally:
        default_plugins.cache_clear()  # and leave it to no later test
    out = capsys.readouterr()
    return code, out.err


PLANS = """
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from pp_core import hookimpl


class Shard:
    def apply(self, module, ep_group):
        pass


TP = {"list": lambda: ["layers.*"], "int": lambda: 3,
      "intkeys": lambda: {0: ColwiseParallel()}, "string": lambda: {"layers.*": "colwise"},
      "norm": lambda: {"norm": ColwiseParallel()}, "empty": lambda: {},
      "nothing": lambda: {"blocks.*": ColwiseParallel()},
      "head": lambda: {"head": ColwiseParallel()},
      "ok": lambda: {"layers.*": ColwiseParallel(), "head": ColwiseParallel(),
                     "embed": RowwiseParallel()}}


@hookimpl
def pp_tensor_parallel_plan(model, sequence_parallel):
    mode = getattr(model, "plan_mode", None)
    if mode == "raises":
        raise RuntimeError("no plan today")
    return TP[mode]() if mode in TP else None


@hookimpl
def pp_expert_parallel_plan(model):
    mode = getattr(model, "plan_mode", None)
    if mode == "ep_raises":
        raise RuntimeError("no experts today")
    if mode == "ep_list":
        return [Shard()]
    if mode == "ep_string":
        return {"layers.*": "shard"}
    return None
"""


def _plugin_dist(root) -> None:
    """A real distribution of a plugin (dist-info with its entry point) on sys.path."""
    (root / "ppt_plans.py").write_text(PLANS)
    info = root / "pp_plans-1.2.3.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: pp-plans\nVersion: 1.2.3\n")
    (info / "entry_points.txt").write_text("[pp_core]\nppt_plans = ppt_plans\n")


def _plan(mode: str, tp: int = 2, **distributed) -> dict:
    return {**BASE, "model": {"target": "models_mod:PlanModel", "args": {"mode": mode}},
            "distributed": {"pp_size": 2, "tp_size": tp, **distributed}}


PROVIDER = "plugin 'ppt_plans' (pp-plans 1.2.3)"


def _guard(key: str, what: str, why: str) -> str:
    """The plugin guard's message for a factory that refused the file's arguments."""
    kind = "model factory" if key == "model.args" else what
    return (f"{key}: {'the model factory' if key == 'model.args' else kind} refused these "
            f"arguments ({why}); fix {key}, or {what} from plugin 'pp_core_builtins.models' "
            f"(pp-core-torch 0.1.0) if the arguments are right (skip a broken plugin with "
            f"PP_CORE_DISABLE_PLUGINS=<plugin name>)")


TWICE = [["tok_embeddings", "pos_embeddings", "layers.0", "layers.1"],
         ["layers.1", "layers.2", "norm", "output"]]
REFUSED = [
    # class: a module run twice (the unsplit model's function, checked)
    (_with("pipeline", module_fqns_per_model_part=TWICE),
     "pipeline.module_fqns_per_model_part: module 'layers.1' runs 2 time(s) per microbatch in "
     "the split but 1 in the unsplit model (stages 0, 1 each run it), so the pipeline would "
     "compute another function; list 'layers.1' in one stage only (it is in stages 0, 1)"),
    # class: validate sees what the ranks will see
    (_sp(data={**BASE["data"], "eval_args": {"seq_len": 7}}, train={"eval_every": 1}),
     "distributed.sequence_parallel: shards the sequence over the tp_size=2 ranks, but the "
     "dataset yields sequences of 7 with data.eval_args; make the length a multiple of 2 "
     "(data.eval_args.seq_len) or set sequence_parallel: false"),
    (_data(), "data.args: the corpus holds token id 300, but the model's vocabulary has 64 ids "
              "(0..63); a batch holding it would fail in the embedding; set "
              "model.args.vocab_size to at least 301, or use the tokenizer the model was made "
              "for"),
    (_data(pack="false", files=["bom.jsonl"]),
     _guard("data.args", "dataset 'tokenized_text'", "TypeError: tokenized_text: pack='false' "
            "must be true or false (a string: write false without quotes?)")),
    (_data(shuffle="no", files=["bom.jsonl"]),
     _guard("data.args", "dataset 'tokenized_text'", "TypeError: tokenized_text: shuffle='no' "
            "must be true or false (a string: write no without quotes?)")),
    (_data(seq_len=True, files=["bom.jsonl"]),
     _guard("data.args", "dataset 'tokenized_text'", "TypeError: tokenized_text: seq_len=True "
            "must be an int")),
    (_data("synthetic", seq_len=8, vocab_size="64"),
     _guard("data.args", "dataset 'synthetic'", "TypeError: synthetic: vocab_size='64' must be "
            "an int (a string: write 64 without quotes?)")),
    (_moe(aux_loss_coef="0.01"),
     _guard("model.args", "model 'moe_gpt'", "TypeError: moe_gpt: aux_loss_coef='0.01' must be "
            "a number (a string: write 0.01 without quotes?)")),
    (_moe(shared_expert="no"),
     _guard("model.args", "model 'moe_gpt'", "TypeError: moe_gpt: shared_expert='no' must be "
            "true or false (a string: write no without quotes?)")),
    (_moe(moe_hidden=0),
     _guard("model.args", "model 'moe_gpt'", "ValueError: moe_gpt: moe_hidden=0 must be at "
            "least 1 (the experts' hidden width), or left out for mlp_ratio * dim")),
    *[(_data(files=[f"{name}.jsonl"]),
       _guard("data.args", "dataset 'tokenized_text'", f"ValueError: tokenized_text: "
              f"'<DIR>/{name}.jsonl' line 3: 'text' is {kind}, expected a string (it would train on "
              f"its Python repr); fix the file or data.args.text_field"))
      for name, kind in (("number", "int 12"), ("list", 'list ["a", "b"]'),
                         ("object", 'dict {"a": 1}'))],
    # class: runtime initializers and what hooks return, one line blaming the provider
    (_init("exit"), "model: the runtime initializer models_mod.Init (resource_key 'workspace') "
                    "raised in prepare() (SystemExit: 3); the model or plugin that provides it "
                    "is at fault, not data.args or model.args"),
    *[(_init(mode), f"model: class 'WithInit' of module 'models_mod': "
                    f"pipeline_runtime_initializers() returned {found}; return a list of runtime "
                    f"initializers (objects with resource_key, signature and prepare(num_tokens, "
                    f"device)), or None for none")
      for mode, found in (("dict", "a dict (keys ['workspace']), not a list of its values"),
                          ("int", "int 3"),
                          ("nokey", "a NoKey without resource_key, signature in its list"))],
    (_init("raises"), "model: class 'WithInit' of module 'models_mod': "
                      "pipeline_runtime_initializers() raised RuntimeError: no workspace for you; "
                      "this is a defect of the plugin: fix it, name another, or skip the plugin "
                      "with PP_CORE_DISABLE_PLUGINS=<plugin name>"),
    (_init("generator"), "model: class 'WithInit' of module 'models_mod': "
                         "pipeline_runtime_initializers() raised KeyError: 'the second one' while "
                         "its result was read; this is a defect of that code: fix it"),
    (_init("hash"), "model: runtime initializer Init from plugin 'pp_core.model_initializers' for "
                    "module '<root>' of model part 0 (WithInit) has an unhashable resource_key "
                    "BadHash() (ValueError: no hash today); make resource_key a tuple, string, "
                    "number or frozen dataclass"),
    (_init("per_layer", pp_schedule="v_schedule", module_fqns_per_model_part=[
        ["embed"], ["layers.0"], ["layers.1"], ["head"]]),
     "model: the runtime initializers of rank 1, which runs stages 1, 2 in one process, "
     "disagree: runtime resource 'per_layer' is requested with two different signatures: 0 by module "
     "'layers.0' of model part 0 (Layer) and 1 by module 'layers.1' of model part 1 (Layer); "
     "every module sharing a resource_key must expect the same configuration, so give the "
     "resources different keys or make their configurations equal"),
    # fixes: output.tensorboard is a directory validate checks
    ({**BASE, "output": {"tensorboard": "a_file"}},
     "output.tensorboard: '<DIR>/a_file' is a file, expected a directory; choose another path"),
    # smaller: dtypes, compile options
    (_with("model", dtype="float8_e4m3fn"),
     "model.dtype: expected a floating-point dtype name: float32, bfloat16, float16 or float64 "
     "(float8 is a storage format the model cannot compute in), found 'float8_e4m3fn' (str)"),
    (_with("train", compile={"enabled": True, "options": {"trace.enabeld": True}}),
     "train.compile: expected torch.compile options (options: unknown inductor option "
     "'trace.enabeld'; did you mean 'trace.enabled'?), found {'enabled': True, 'options': {'trace.enabeld': True}} (dict)"),
    # class: plans that must do something (a real plugin distribution gives them)
    (_plan("list"), f"distributed.tp_size: {PROVIDER} returned list ['layers.*'] from "
                    f"pp_tensor_parallel_plan, expected a dict {{module pattern: style}}; return "
                    f"e.g. {{'layers.*.attn': ...}}"),
    (_plan("int"), f"distributed.tp_size: {PROVIDER} returned int 3 from pp_tensor_parallel_plan, "
                   f"expected a dict {{module pattern: style}}; return e.g. "
                   f"{{'layers.*.attn': ...}}"),
    (_plan("intkeys"), f"distributed.tp_size: {PROVIDER}'s pp_tensor_parallel_plan plan has the "
                       f"key 0 (int), expected a module path such as 'layers.*.mlp'"),
    (_plan("raises"), f"distributed.tp_size: {PROVIDER}: pp_tensor_parallel_plan(model=PlanModel, "
                      f"sequence_parallel=False) raised RuntimeError: no plan today; this is a "
                      f"defect of the plugin: fix it, name another, or skip the plugin with "
                      f"PP_CORE_DISABLE_PLUGINS=<plugin name>"),
    (_plan("string"), f"distributed.tp_size: {PROVIDER}'s pp_tensor_parallel_plan plan maps "
                      f"'layers.*' to 'colwise' (a string names no style), expected a torch "
                      f"ParallelStyle (ColwiseParallel(), RowwiseParallel(), SequenceParallel(), "
                      f"...)"),
    (_plan("norm"), f"distributed.tp_size: {PROVIDER}'s plan shards 'norm' (LayerNorm) with "
                    f"ColwiseParallel, which torch applies only to nn.Linear and nn.Embedding; use "
                    f"SequenceParallel() for a norm, or leave it out of the plan (replicated)"),
    *[(_plan(mode), f"distributed.tp_size: the tensor-parallel plan of {PROVIDER} matches no "
                    f"module of stage(s) 0 (1,296 parameters), 1 (1,392 parameters): their tp "
                    f"ranks would each compute the whole stage, the same work twice; make the "
                    f"plan's module paths match the model's (e.g. 'layers.*.attn.q'), or set "
                    f"distributed.tp_size: 1") for mode in ("empty", "nothing")],
    (_plan("head"), f"distributed.tp_size: the tensor-parallel plan of {PROVIDER} matches no "
                    f"module of stage(s) 0 (1,296 parameters): their tp ranks would each compute "
                    f"the whole stage, the same work twice; make the plan's module paths match "
                    f"the model's (e.g. 'layers.*.attn.q'), or set distributed.tp_size: 1"),
    (_plan("ep_raises", tp=1, dp_size=2, ep_size=2),
     f"distributed.ep_size: {PROVIDER}: pp_expert_parallel_plan(model=PlanModel) raised "
     f"RuntimeError: no experts today; this is a defect of the plugin: fix it, name another, "
     f"or skip the plugin with PP_CORE_DISABLE_PLUGINS=<plugin name>"),
    (_plan("ep_list", tp=1, dp_size=2, ep_size=2),
     f"distributed.ep_size: {PROVIDER} returned list [<ppt_plans.Shard object at 0x"),
    (_plan("ep_string", tp=1, dp_size=2, ep_size=2),
     f"distributed.ep_size: {PROVIDER}'s pp_expert_parallel_plan plan maps 'layers.*' to 'shard' "
     f"(a string names no style), expected an expert-parallel style (an object with "
     f"apply(module, ep_group))"),
    (_data(files=["broken.jsonl"]),
     _guard("data.args", "dataset 'tokenized_text'", "ValueError: tokenized_text: "
            "'<DIR>/broken.jsonl' line 3 is not JSON (Unterminated string starting at column 10); "
            "fix that line of data.args.files")),
]


@pytest.mark.parametrize("values, expected", REFUSED, ids=[c[1][:48] for c in REFUSED])
def test_validate_refuses(tmp_path, capsys, monkeypatch, values, expected):
    code, err = _validate(tmp_path, capsys, monkeypatch, values)
    assert code == 1, err
    expected = expected.replace("<DIR>", str(tmp_path))  # every relative path: under the file's folder
    if expected.endswith("object at 0x"):  # an address follows
        assert err.startswith(f"pp-core: error: {tmp_path / 'pipe.yaml'}: {expected}"), err
        assert err.count("\n") == 1, err
        return
    assert err == f"pp-core: error: {tmp_path / 'pipe.yaml'}: {expected}\n", err


TIED_FQNS = [["embed", "rotary", "layers.0"], ["layers.1", "rotary", "head"]]
ACCEPTED = [
    {**BASE, "model": {"target": "models_mod:Tied"},
     "pipeline": {**BASE["pipeline"], "module_fqns_per_model_part": TIED_FQNS}},
    _data(files=["bom.jsonl"]),  # a UTF-8 BOM, as CSV readers take it
    _plan("ok"),
    # one key, two signatures, on two ranks: two processes, two resources
    _init("per_layer", module_fqns_per_model_part=[["embed", "layers.0"], ["layers.1", "head"]]),
    {**BASE, "output": {"tensorboard": "runs/tb/"}},  # a directory, spelled as one
    # mixed precision spelled as model.dtype is
    _with("distributed", pp_size=2, dp_shard=2,
          mixed_precision={"param_dtype": "bf16", "reduce_dtype": "torch.float32"}),
    # Mixtral in float32: the meta forward's experts run eager (grouped_mm's meta kernel is BF16)
    {**BASE, "model": {"name": "hf_causal_lm", "args": {"config": {
        "model_type": "mixtral", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
        "num_local_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 16}}}},
]


@pytest.mark.parametrize("values", ACCEPTED, ids=range(len(ACCEPTED)))
def test_validate_accepts(tmp_path, capsys, monkeypatch, values):
    if values["model"].get("name") == "hf_causal_lm":
        pytest.importorskip("transformers")
    code, err = _validate(tmp_path, capsys, monkeypatch, values)
    assert code == 0, err


@pytest.mark.cli
def test_a_prepare_that_blocks_ends_validate_with_a_message(tmp_path):
    """A real ``pp-core validate`` process: an initializer whose prepare() blocks is reported
    after $PP_CORE_PREPARE_TIMEOUT seconds (it used to hang validate and run)."""
    import subprocess
    import time

    (tmp_path / "models_mod.py").write_text(MODELS)
    (tmp_path / "pipe.yaml").write_text(yaml.safe_dump(_init("block")))
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pp_core", "validate", "pipe.yaml"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PP_CORE_PREPARE_TIMEOUT": "2",
                               "PYTHONPATH": str(tmp_path)})
    assert time.monotonic() - started < 60
    assert done.returncode == 1, done.stderr
    assert done.stderr == (
        "pp-core: error: pipe.yaml: model: the runtime initializer models_mod.Init (resource_key "
        "'workspace') did not return from prepare(num_tokens=8, device=meta) within 2 s "
        "($PP_CORE_PREPARE_TIMEOUT); the executor calls it before every microbatch, so the run "
        "would hang there: the model or plugin that provides it must not block\n"), done.stderr


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_validate_refuses_an_unwritable_tensorboard_directory(tmp_path, capsys, monkeypatch):
    (tmp_path / "locked").mkdir(mode=0o555)
    code, err = _validate(tmp_path, capsys, monkeypatch,
                          {**BASE, "output": {"tensorboard": "locked/tb"}})
    assert code == 1
    assert err == (f"pp-core: error: {tmp_path / 'pipe.yaml'}: output.tensorboard: cannot create "
                   f"'locked/tb': no permission to write in '{tmp_path / 'locked'}'; choose a "
                   f"writable place\n"), err


def test_relative_corpus_paths_are_relative_to_the_pipeline_file(tmp_path, capsys, monkeypatch):
    """``files: [../corpus.jsonl]`` in ``conf/pipe.yaml`` reads ``corpus.jsonl`` beside ``conf``,
    whatever the working directory (it was read from the working directory)."""
    _corpus(tmp_path)
    (tmp_path / "conf").mkdir()
    (tmp_path / "elsewhere").mkdir()
    values = _data(files=["../bom.jsonl"], tokenizer="../gap.json", cache_dir=str(tmp_path / "c"))
    (tmp_path / "conf" / "pipe.yaml").write_text(yaml.safe_dump(values))
    monkeypatch.chdir(tmp_path / "elsewhere")
    code = cli.main(["validate", str(tmp_path / "conf" / "pipe.yaml")])
    assert code == 0, capsys.readouterr().err


def test_the_library_collector_names_the_provider_of_a_wrong_answer():
    """``collect_pipeline_runtime_initializers`` (what every rank calls) gives one error naming
    the model's class for a dict, items without a key, a raising generator, and the documented
    ``TypeError`` for a key whose ``__hash__`` raises ``ValueError`` (raw tracebacks before)."""
    import torch

    from pp_core.errors import PluginError
    from pp_core.runtime import collect_pipeline_runtime_initializers

    namespace: dict = {}
    exec(compile(MODELS, "models_mod", "exec"), namespace)  # noqa: S102 - the test's own source
    with torch.device("meta"):
        model = namespace["WithInit"]
        for mode, expected in (("dict", "returned a dict (keys ['workspace'])"),
                               ("nokey", "returned a NoKey without resource_key, signature"),
                               ("generator", "raised KeyError: 'the second one' while its "
                                             "result was read")):
            with pytest.raises(PluginError) as caught:
                collect_pipeline_runtime_initializers([model(mode)])
            assert "class 'WithInit'" in str(caught.value) and expected in str(caught.value)
        with pytest.raises(TypeError, match=r"unhashable resource_key BadHash\(\) \(ValueError: "
                                            r"no hash today\)"):
            collect_pipeline_runtime_initializers([model("hash")])

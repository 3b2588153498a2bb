"""``validate`` refuses what would train nothing, or something else than written (issue #48,
item 6): each used to pass validate and then train nothing (grad norm 0, rc 0), ignore a
setting, or fail on the ranks. One case per line of the issue; each asserts the whole output,
in-process over real pipeline files."""

from __future__ import annotations

import pytest
import yaml

from pp_core.app import cli
from pp_core.plugin_manager import default_plugins
from tests.cases.specs import tiny_gpt_spec

ARGS = {"dim": 16, "num_layers": 2, "num_heads": 2, "max_seq_len": 8, "vocab_size": 256}
BASE = tiny_gpt_spec(model={"args": ARGS}, data={"args": {"vocab_size": 256}},
                     pipeline={"pp_schedule": None, "pp_batch_size": 2, "pp_microbatch_size": None},
                     train=None, output=None)
CORPUS = {"name": "tokenized_text", "args": {"files": "corpus.txt", "tokenizer": "bytes",
                                             "seq_len": 8, "cache_dir": "cache"}}
MODELS = '''
from pp_core_builtins.models.moe_gpt import MoEGPT, ShardExperts


class MisnamedPlan(MoEGPT):
    def expert_parallel_plan(self):
        return {"layers.*.moe": ShardExperts(), "layers.*.experts_typo": ShardExperts()}
'''
MOE = {"dim": 16, "num_layers": 2, "num_heads": 2, "max_seq_len": 8, "vocab_size": 256,
       "num_experts": 2, "top_k": 1}
LLAMA = {"model_type": "llama", "vocab_size": 256, "hidden_size": 16, "intermediate_size": 32,
         "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2}


CORPUS_PLUGIN = default_plugins().origin("dataset", "tokenized_text")
MOE_PLUGIN = default_plugins().origin("model", "moe_gpt")
REST = (" if the arguments are right (skip a broken plugin with "
        "PP_CORE_DISABLE_PLUGINS=<plugin name>)")


def _with(section: str, **values) -> dict:
    return {**BASE, section: {**BASE.get(section, {}), **values}}


CASES = [
    ("lora alpha 0", _with("model", lora={"r": 4, "alpha": 0}),
     "model.lora.alpha: expected a number > 0 (LoRA scales the adapters' output by alpha / r; "
     "0 trains them to no effect), found 0"),
    ("lora alpha negative", _with("model", lora={"r": 4, "alpha": -8}),
     "model.lora.alpha: expected a number > 0 (LoRA scales the adapters' output by alpha / r; "
     "0 trains them to no effect), found -8"),
    ("freeze everything", _with("model", freeze=["*"]),
     "model.freeze: ['*'] freezes every parameter of GPT: nothing is left to train; freeze "
     "fewer modules (e.g. 'tok_embeddings'), or add model.lora"),
    ("negative pad_id", {**BASE, "data": {**CORPUS, "args": {**CORPUS["args"], "pack": False,
                                                             "pad_id": -1}}},
     "data.args: dataset 'tokenized_text' refused these arguments (ValueError: tokenized_text: "
     f"pad_id=-1 must be a token id >= 0); fix data.args, or {CORPUS_PLUGIN}{REST}"),
    ("cache_dir is a file", {**BASE, "data": {**CORPUS, "args": {**CORPUS["args"],
                                                                 "cache_dir": "corpus.txt"}}},
     "data.args: dataset 'tokenized_text' refused these arguments (ValueError: tokenized_text: "
     "cache_dir='{folder}/corpus.txt' is a file, expected a directory for the token cache (it is "
     f"created when missing)); fix data.args, or {CORPUS_PLUGIN}{REST}"),
    ("negative z_loss_coef", {**BASE, "model": {"name": "moe_gpt",
                                                "args": {**MOE, "z_loss_coef": -0.1}}},
     "model.args: the model factory refused these arguments (ValueError: moe_gpt: "
     "z_loss_coef=-0.1 must be a finite number >= 0 (a coefficient of a loss added to the "
     f"model's)); fix model.args, or {MOE_PLUGIN}{REST}"),
    ("EP plan names no module", {**BASE, "model": {"target": "models_mod:MisnamedPlan",
                                                   "args": MOE},
                                 "distributed": {"pp_size": 2, "dp_shard": 2, "ep_size": 2}},
     "distributed.ep_size: the expert-parallel plan of MisnamedPlan names 'layers.*.experts_typo', "
     "which matches no module of the model; correct or remove it (its modules are named like "
     "'layers.0.moe')"),
    ("mixed precision on fp16", {**BASE, "model": {**BASE["model"], "dtype": "float16"},
                                 "distributed": {"pp_size": 2, "dp_shard": 2,
                                                 "mixed_precision": {"param_dtype": "bfloat16"}}},
     "distributed.mixed_precision: casts float32 parameters to a lower precision for compute, "
     "but the model's parameters are float16 (model.dtype); keep one of them: drop "
     "mixed_precision, or build the model in float32"),
    ("a shifting loss on shifted targets", {
        **BASE, "model": {"name": "hf_causal_lm", "args": {"config": LLAMA}},
        "data": {"name": "text_bytes", "args": {"seq_len": 8}},
        "pipeline": {**BASE["pipeline"], "loss_fn": "pp_core_builtins.transformers:causal_lm_loss"}},
     "pipeline.loss_fn: pp_core_builtins.transformers:causal_lm_loss shifts its labels by one "
     "token, but the targets of data 'text_bytes' are already the next tokens (target[t] = "
     "input[t + 1]): the model would learn the token after next; use loss_fn: cross_entropy, "
     "which takes a dataset's targets as they are (docs/data.md, 'Targets')"),
    ("HF torch_dtype beside model.dtype", {
        **BASE, "model": {"name": "hf_causal_lm", "dtype": "float32",
                          "args": {"config": {**LLAMA, "torch_dtype": "bfloat16"}}}},
     "model.dtype: float32, but model.args.config.torch_dtype says bfloat16; the model would be "
     "built in one and cast to the other: give the dtype once"),
]


@pytest.mark.parametrize("values, message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_validate_refuses_in_one_line(tmp_path, capsys, monkeypatch, values, message):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "models_mod.py").write_text(MODELS)
    (tmp_path / "corpus.txt").write_text("a few words of text\n\n" * 20)
    (tmp_path / "pipe.yaml").write_text(yaml.safe_dump(values))
    code = cli.main(["validate", "pipe.yaml"])
    out = capsys.readouterr()
    assert code == 1 and out.out == "", out.out + out.err
    message = message.replace("{folder}", str(tmp_path))
    assert out.err == f"pp-core: error: pipe.yaml: {message}\n"


def test_targets_equal_to_the_inputs_are_refused_with_a_loss_that_does_not_shift():
    """The other half of the one convention: Hugging Face labels (the input ids) given to
    ``cross_entropy``, which would teach the model to copy its input."""
    import torch

    from pp_core.app.check.data import label_problem
    from pp_core.losses import cross_entropy

    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    assert label_problem("cross_entropy", cross_entropy, "mine", {"input_ids": ids}, ids) == (
        "pipeline.loss_fn: cross_entropy takes targets that are the next tokens, but the targets "
        "of data 'mine' equal its inputs (Hugging Face labels): the model would learn to copy its "
        "input; use loss_fn: pp_core_builtins.transformers:causal_lm_loss, which shifts them, or "
        "make the dataset's targets the next tokens (docs/data.md, 'Targets')")
    assert label_problem("cross_entropy", cross_entropy, "mine", ids[:, :-1], ids[:, 1:]) is None

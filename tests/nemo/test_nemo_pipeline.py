"""A NeMo AutoModel user's pipeline, run unchanged on 2 gloo ranks (issue 20): NeMo-shaped model
classes (not ``transformers`` models), the documented ``model.rotary_emb``-in-every-part FQN
lists (the rotary module parameter-free, and with a trainable parameter: tied across the ranks),
one ``nn.Linear`` shared by stages on two ranks (issue 25), ``pp_seq_len`` as a hint with batches
of another length, mRoPE position ids ``[3, batch, seq]`` split on dim 1, and ``dtype`` as the
dtype of the tensors between stages. Loss and every gradient equal the unsplit model's on one
process."""

import pytest
import torch

from tests.cases.nemo import dtype_case, lm_case, shared_linear_case

ATOL = 1e-5
FQNS_2 = [["model.embed_tokens", "model.layers.0", "model.layers.1", "model.rotary_emb"],
          ["model.layers.2", "model.layers.3", "model.norm", "lm_head", "model.rotary_emb"]]
FQNS_4 = [["model.embed_tokens", "model.layers.0", "model.rotary_emb"],
          ["model.layers.1", "model.rotary_emb"], ["model.layers.2", "model.rotary_emb"],
          ["model.layers.3", "model.norm", "lm_head", "model.rotary_emb"]]


pytestmark = pytest.mark.ranks(2)


def check(results):
    for step in range(len(results[0]["steps"])):
        losses = [r["steps"][step]["loss_err"] for r in results
                  if r["steps"][step]["loss_err"] is not None]
        assert len(losses) == 1 and losses[0] <= ATOL, (step, losses)
        for r in results:
            assert r["steps"][step]["grad_err"] <= ATOL, (step, r["rank"], r["steps"][step])


@pytest.mark.parametrize("fqns,schedule,trainable", [
    (FQNS_2, "1f1b", False), (FQNS_4, "interleaved_1f1b", False),
    (FQNS_2, "1f1b", True), (FQNS_4, "v_schedule", True)],
    ids=["2-stages", "4-stages", "2-stages-trainable", "4-stages-v-trainable"])
def test_rotary_emb_in_every_part(pool, fqns, schedule, trainable):
    """NeMo's documented lists: every part names model.rotary_emb; with a parameter it is tied
    (its gradient summed over every stage and rank holding it), and with layers_per_stage also
    set the lists win."""
    results = pool.run(lm_case, "lm", schedule, fqns=fqns, trainable_rope=trainable,
                       layers_per_stage=3)
    check(results)
    names = [n for r in results for n in r["steps"][0]["names"]]
    assert names.count("model.rotary_emb.scale") == (2 if trainable else 0)


def test_nemo_shaped_model_split_by_layers_per_stage(pool):
    results = pool.run(lm_case, "lm", "interleaved_1f1b", layers_per_stage=1)
    assert {r["splitter"] for r in results} == {"hf_decoder"}
    assert [r["steps"][0]["stages"] for r in results] == [(0, 2), (1, 3)]
    check(results)


def test_shared_linear_on_two_ranks_equals_one_process(pool):
    results = pool.run(shared_linear_case)
    for r in results:
        assert r["grad_err"] <= ATOL, r
    assert [r["loss_err"] for r in results if r["loss_err"] is not None][0] <= ATOL
    first, second = (r["weights"] for r in results)
    assert torch.equal(first["layers.0.weight"], second["layers.2.weight"])  # still one weight


@pytest.mark.parametrize("pool_buffers", [False, True], ids=["plain", "buffer_pool"])
def test_pp_seq_len_is_a_hint(pool, pool_buffers):
    """pp_seq_len=8, then batches of 5, 5, 8: each step equals one process, one note is logged."""
    results = pool.run(lm_case, "flat", "interleaved_1f1b", seqs=(8, 8, 5, 5, 8), seq_len=8,
                       layers_per_stage=1, pool=pool_buffers)
    check(results)
    notes = [n for r in results for n in r["notes"] if "pp_seq_len is a hint" in n]
    assert len(notes) == 1, notes


def test_mrope_position_ids_split_on_dim_1(pool):
    results = pool.run(lm_case, "mrope", "1f1b", m=2, seqs=(8, 8))
    check(results)


def test_dtype_is_the_dtype_between_stages(pool):
    results = pool.run(dtype_case)
    assert {d for r in results for d in r["param_dtypes"]} == {"torch.float32"}
    assert {d for r in results for d in r["grad_dtypes"]} == {"torch.float32"}
    later = [r for r in results if 0 not in r["stages"]][0]
    assert later["received"] == ["torch.bfloat16"]

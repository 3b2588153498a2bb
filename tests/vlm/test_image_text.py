"""The ``image_text`` dataset on one process: a processor built here, PNGs of several sizes,
0..3 images per sample; what a step's batch holds, labels on text only, resuming."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from pp_core.runtime.microbatch import kwargs_chunk_dims  # noqa: E402
from pp_core_builtins.transformers import causal_lm_loss  # noqa: E402
from pp_core_builtins.transformers.image_text import image_text  # noqa: E402
from tests.cases.vlm import IMAGE, save_processor, tiny_vlm, write_images_dataset  # noqa: E402

IMAGES = (1, 0, 2, 3)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("image_text")
    return write_images_dataset(tmp, IMAGES), save_processor("llava_next", tmp / "processor")


def test_a_batch_is_the_processors_tensors_with_labels_on_text_only(files):
    data = image_text(*files, seq_len=160, batch_size=4, shuffle=False)
    inputs, labels = data.batch(0)
    assert inputs.keys() == {"input_ids", "attention_mask", "pixel_values", "image_sizes"}
    assert inputs["pixel_values"].shape[0] == inputs["image_sizes"].shape[0] == sum(IMAGES)
    ids = inputs["input_ids"]
    assert ((labels == -100) == ((ids == IMAGE) | (inputs["attention_mask"] == 0))).all()
    model = tiny_vlm("llava_next")  # the processor's tokens per image are the model's
    assert kwargs_chunk_dims(model, inputs)["pixel_values"].tolist() == [0, 2, 2, 3, 3, 3]
    assert torch.isfinite(causal_lm_loss(model(**inputs).logits, labels))


def test_batches_are_deterministic_and_skip_resumes_where_it_left(files):
    data = image_text(*files, seq_len=160, batch_size=3, seed=5)
    first = [batch[0]["input_ids"] for batch, _ in zip(data, range(3))]
    again = image_text(*files, seq_len=160, batch_size=3, seed=5)
    again.skip(2)
    assert torch.equal(next(iter(again))[0]["input_ids"], first[2])
    epoch = torch.cat([b for b in first])[:4]  # 4 samples, one epoch: each once
    assert len({tuple(row.tolist()) for row in epoch}) == 4

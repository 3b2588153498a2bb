"""Tiny vision-language models, batches of 0..3 images per sample, and the unsplit reference,
for the tests of ``hf_image_text_to_text`` (and for their spawned ranks).

No network: every model is built from a config in code, with random weights; every batch is made
here (pixels, placeholders, sizes), in the layout each family's processor gives. Importing this
module skips the importing test module when ``transformers`` is not installed.
"""

from __future__ import annotations

import functools

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pp_core_builtins.transformers import causal_lm_loss, hf_image_text_to_text  # noqa: E402

VOCAB = 64
IMAGE = 60  # the image placeholder token
PAD = 0

TEXT = dict(model_type="llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            max_position_embeddings=256, pad_token_id=PAD)
CLIP = dict(model_type="clip_vision_model", hidden_size=16, intermediate_size=32,
            num_hidden_layers=3, num_attention_heads=2, image_size=8, patch_size=4)
SIGLIP = {**CLIP, "model_type": "siglip_vision_model"}
PINPOINTS = [[8, 16], [16, 8], [16, 16]]
QWEN_TEXT = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                 pad_token_id=PAD, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                    "mrope_section": [1, 1, 2]})
QWEN_VISION = dict(depth=3, embed_dim=16, hidden_size=32, num_heads=2, mlp_ratio=2,
                   patch_size=2, spatial_merge_size=2, temporal_patch_size=2, in_channels=3)


def tiny_config(family: str = "llava", **extra) -> dict:
    """A config dict for ``hf_image_text_to_text``: ``llava``, ``llava_next`` or ``qwen2_vl``."""
    if family == "qwen2_vl":
        return {"model_type": "qwen2_vl", "text_config": dict(QWEN_TEXT),
                "vision_config": dict(QWEN_VISION), "image_token_id": IMAGE,
                "video_token_id": IMAGE + 1, "vision_start_token_id": IMAGE + 2, **extra}
    config = {"model_type": family, "text_config": dict(TEXT), "vision_config": dict(CLIP),
              "image_token_id": IMAGE, **extra}
    if family == "llava_next":
        config["image_grid_pinpoints"] = PINPOINTS
    return config


def tiny_vlm(family: str = "llava", seed: int = 0, **extra):
    """A tiny VLM in float32 with eager attention; the same weights for the same seed."""
    return hf_image_text_to_text(tiny_config(family, **extra), seed=seed,
                                 attn_implementation="eager")


@functools.lru_cache(maxsize=None)
def image_tokens(family: str, size) -> int:
    """Placeholder tokens of one image (``size``: LLaVA-NeXT's (h, w), Qwen2-VL's (t, h, w))."""
    from transformers import AutoConfig

    from pp_core_builtins.transformers.vision import FAMILIES

    values = tiny_config(family)
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    media = torch.tensor([size]) if size is not None else torch.zeros((0, 2), dtype=torch.long)
    return int(FAMILIES[family].image_tokens(config, media, 1)[0])


def _image(family: str, generator):
    """``(pixels, size)`` of one random image in the family's processor layout."""
    if family == "llava":
        return torch.randn(3, 8, 8, generator=generator), None
    if family == "llava_next":
        size = [(8, 16), (16, 8), (12, 12), (16, 16)][int(torch.randint(4, (1,), generator=generator))]
        from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

        tiles = image_size_to_num_patches(list(size), PINPOINTS, 8)
        return torch.randn(tiles, 3, 8, 8, generator=generator), size
    h, w = [(2, 2), (2, 4), (4, 4)][int(torch.randint(3, (1,), generator=generator))]
    return torch.randn(h * w, 3 * 2 * 2 * 2, generator=generator), (1, h, w)


def batch(family: str = "llava", images=(1, 0, 2, 3), text: int = 6, seed: int = 1):
    """``(inputs dict, labels)``: sample ``i`` holds ``images[i]`` images, each as its
    placeholders between text tokens; left padding; labels ``-100`` on padding and images."""
    generator = torch.Generator().manual_seed(seed)
    rows, pixels, sizes = [], [], []
    for count in images:
        ids = torch.randint(3, IMAGE, (text,), generator=generator).tolist()
        for _ in range(count):
            pixel, size = _image(family, generator)
            pixels.append(pixel)
            sizes.append(size)
            ids += [IMAGE] * image_tokens(family, size) + \
                torch.randint(3, IMAGE, (2,), generator=generator).tolist()
        rows.append(ids)
    length = max(map(len, rows))
    input_ids = torch.full((len(rows), length), PAD, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for index, ids in enumerate(rows):
        input_ids[index, length - len(ids):] = torch.tensor(ids)
        attention_mask[index, length - len(ids):] = 1
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
    if family == "llava_next":
        tiles = max((p.shape[0] for p in pixels), default=1)
        inputs["pixel_values"] = torch.stack([torch.cat([p, p.new_zeros(tiles - len(p), 3, 8, 8)])
                                              for p in pixels]) if pixels else \
            torch.zeros(0, tiles, 3, 8, 8)
        inputs["image_sizes"] = torch.tensor(sizes, dtype=torch.long).reshape(-1, 2)
    elif family == "qwen2_vl":
        inputs["pixel_values"] = torch.cat(pixels) if pixels else torch.zeros(0, 24)
        inputs["image_grid_thw"] = torch.tensor(sizes, dtype=torch.long).reshape(-1, 3)
        inputs["mm_token_type_ids"] = (input_ids == IMAGE).to(torch.int32)
    else:
        inputs["pixel_values"] = torch.stack(pixels) if pixels else torch.zeros(0, 3, 8, 8)
    labels = input_ids.masked_fill((attention_mask == 0) | (input_ids == IMAGE), -100)
    return inputs, labels


def reference_step(model, inputs: dict, labels):
    """The unsplit model on the whole batch, on one process: its token-mean loss (the pipeline's
    step loss) and every parameter's gradient (``None`` ones left out)."""
    model.zero_grad(set_to_none=True)
    given = dict(inputs)
    if given["pixel_values"].shape[0] == 0:  # the model's own path for a batch without images
        given = {k: v for k, v in given.items() if k not in ("pixel_values", "image_sizes",
                                                               "image_grid_thw")}
    loss = causal_lm_loss(model(**given).logits, labels)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters(remove_duplicate=False)
             if p.grad is not None}
    return loss.detach(), grads


def pipeline_case(family: str, schedule: str, layout: str = "pp", images=(1, 0, 2, 3, 0, 1, 0, 2),
                  microbatch: int = 1, fqns=None, order=None, freeze=None) -> dict:
    """One pipelined step on 4 ranks vs the unsplit model on the whole batch, on every rank.

    ``layout``: ``pp`` (two pp2 pipelines side by side, each on the whole batch), ``dp`` (pp2 x
    FSDP2 dp2: each dp rank its half of the batch, cut by the media seam) or ``tp`` (pp2 x tp2,
    the vision tower replicated). ``order``: the samples permuted before the step (and for the
    reference alike), so other samples - and images - meet in each microbatch. ``freeze``:
    parameter-name prefixes frozen before the split. Returns the loss and worst gradient error
    (gradients of the summed microbatch losses, as the pipeline leaves them: ``M`` times the
    global loss's) and the names compared."""
    import copy

    import torch.distributed as dist

    from pp_core import PipelineConfig, build_pipeline
    from pp_core.app.factories import dp_slice
    from pp_core.parallel import parallelize
    from pp_core.runtime.microbatch import kwargs_chunk_dims
    from tests.cases.meshes import meshes

    run_meshes = meshes(pp=2, tp=2) if layout == "tp" else meshes(pp=2, dp_shard=2)
    reference = tiny_vlm(family)
    for name, param in reference.named_parameters():
        if freeze and name.startswith(tuple(freeze)):
            param.requires_grad_(False)
    model = copy.deepcopy(reference)
    inputs, labels = batch(family, images)
    if order is not None:
        inputs, labels = permuted(family, inputs, labels, order)
    dp = 2 if layout == "dp" else 1
    local = len(images) // dp
    config = PipelineConfig(pp_schedule=schedule, pp_batch_size=local,
                            pp_microbatch_size=microbatch, loss_fn=causal_lm_loss,
                            module_fqns_per_model_part=fqns)
    if layout == "pp":  # side by side: the dp ranks are two pipelines, nothing shared
        pipe = build_pipeline(model, config, pp_group=run_meshes.pp)
    else:
        pipe = build_pipeline(model, config, meshes=run_meshes)
        parallelize(pipe, run_meshes)
    rank = run_meshes.dp_rank if layout == "dp" else 0
    mine = dp_slice(inputs, rank, dp, len(images), kwargs_chunk_dims(pipe.model_parts[0], inputs))
    loss = pipe.step(mine, target=dp_slice(labels, rank, dp, len(images)))
    expected, grads = reference_step(reference, inputs, labels)
    loss_err = None
    if loss is not None:
        if layout == "dp":
            dist.all_reduce(loss, group=run_meshes.data_parallel_mesh().get_group())
        loss_err = abs(loss.item() / dp - expected.item())
    scale = config.num_microbatches
    worst, compared = 0.0, []
    for part in pipe.model_parts:
        for name, param in part.named_parameters(remove_duplicate=False):
            grad = param.grad
            if hasattr(grad, "full_tensor"):
                grad = grad.full_tensor()
            want = grads.get(name)
            if want is None:
                assert grad is None or not grad.any(), f"{name}: a gradient the model has not"
                continue
            worst = max(worst, (grad - want * scale).abs().max().item())
            compared.append(name)
    sharded = {stage: sorted(n for n, p in part.named_parameters() if hasattr(p, "device_mesh"))
               for stage, part in zip(pipe.stage_indices, pipe.model_parts)}
    return {"loss_err": loss_err, "grad_err": worst, "names": compared, "sharded": sharded,
            "stages": pipe.stage_indices, "actions": _backward_actions(pipe)}


def _backward_actions(pipe) -> dict:
    """Backward actions (B, I, W) per local stage in this rank's program."""
    counts: dict = {}
    for action in pipe.program.rank(pipe.rank).actions:
        if action.kind.value in ("B", "I", "W"):
            counts[action.stage] = counts.get(action.stage, 0) + 1
    return counts


def permuted(family: str, inputs: dict, labels, order):
    """The batch with its samples in ``order``, each sample's images moved with it."""
    from pp_core.runtime.microbatch import kwargs_samples

    owners = kwargs_samples(tiny_vlm(family), inputs)
    order = torch.as_tensor(order)
    out = {}
    for key, value in inputs.items():
        if key in owners:
            rows = torch.cat([(owners[key] == sample).nonzero().flatten() for sample in order])
            out[key] = value[rows]
        else:
            out[key] = value[order]
    return out, labels[order]


def save_processor(family: str, directory) -> str:
    """A processor matching :func:`tiny_vlm` (a word-level tokenizer of ``VOCAB`` ids, the
    placeholder ``<image>`` = ``IMAGE``, Pillow image processing), saved to ``directory``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(4, IMAGE)] + \
        ["<image>"] + [f"x{i}" for i in range(IMAGE + 1, VOCAB)]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>",
                                        bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                        extra_special_tokens={"image_token": "<image>"})
    size = {"shortest_edge": 8}, {"height": 8, "width": 8}
    common = dict(patch_size=4, vision_feature_select_strategy="default",
                  num_additional_image_tokens=1)
    if family == "llava":
        images = transformers.LlavaImageProcessorPil(size=size[0], crop_size=size[1])
        processor = transformers.LlavaProcessor(image_processor=images, tokenizer=tokenizer,
                                                **common)
    else:
        images = transformers.LlavaNextImageProcessorPil(size=size[0], crop_size=size[1],
                                                         image_grid_pinpoints=PINPOINTS)
        processor = transformers.LlavaNextProcessor(image_processor=images, tokenizer=tokenizer,
                                                    **common)
    processor.save_pretrained(str(directory))
    return str(directory)


def write_images_dataset(directory, images=(1, 0, 2, 3), seed: int = 0, words: int = 5) -> str:
    """``data.jsonl`` in ``directory``: sample ``i`` holds ``images[i]`` PNGs (random sizes,
    in ``img/``), its text ``words`` words around one ``<image>`` per image."""
    import json
    import random
    from pathlib import Path

    import numpy as np
    from PIL import Image

    directory = Path(directory)
    (directory / "img").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    lines = []
    for index, count in enumerate(images):
        paths = []
        for k in range(count):
            name = f"img/{index}_{k}.png"
            size = (rng.choice([6, 8, 12, 16]), rng.choice([6, 8, 12, 16]))
            pixels = np.random.default_rng(seed + 31 * index + k).integers(0, 255, (*size, 3))
            Image.fromarray(pixels.astype(np.uint8)).save(directory / name)
            paths.append(name)
        text = " ".join(f"w{rng.randrange(4, IMAGE)}" for _ in range(words))
        text += "".join(f" <image> w{rng.randrange(4, IMAGE)}" for _ in range(count))
        lines.append(json.dumps({"text": text, "images": paths}))
    (directory / "data.jsonl").write_text("\n".join(lines) + "\n")
    return str(directory / "data.jsonl")

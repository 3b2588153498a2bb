"""Padded vs packed rows through a 2-rank pipeline, and the token cache's start-up.

A corpus of documents whose lengths are log-normal around ``seq_len / 4`` (median ``seq_len /
4``, sigma 1, clipped to [8, 4 * seq_len]) - the skewed shape real corpora have - written as
``.jsonl`` and read by the ``tokenized_text`` dataset with the byte tokenizer:

* ``pack: false`` - one document per row, padded to ``seq_len`` (padding never counted);
* ``pack: true`` - documents end to end, attention blocked across documents (the demo GPT's
  document mask, from the position ids).

The demo GPT (dim 128, 4 blocks, 4 heads; vocab 256) as a 1F1B pipeline over 2 gloo ranks (one
thread each), batch 16 in 8 microbatches; per mode the median step time over the measured steps
after warm-up, the valid (non-padding) target tokens per step and per second, and the ratio
packed / padded. Then the cache: the first ``tokenized_text`` start (hash, tokenize, write) and
the second (hash, open) on a larger corpus.

    python benchmarks/bench_packing.py [--seq-len 256] [--steps 6] [--docs 4000] [--json out]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _common import options, write_json  # noqa: E402

BATCH, MICROBATCH = 16, 2


def write_corpus(path: str, num_docs: int, seq_len: int, seed: int = 0) -> dict:
    """``num_docs`` documents of log-normal lengths (bytes = tokens with the byte tokenizer)."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(seq_len / 4), 1.0, num_docs), 8, 4 * seq_len)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz     ", dtype=np.uint8)
    with open(path, "w") as handle:
        for length in lengths.astype(int):
            text = letters[rng.integers(0, len(letters), length)].tobytes().decode()
            handle.write(json.dumps({"text": text.strip() or "x"}) + "\n")
    return {"docs": num_docs, "median_len": float(np.median(lengths)),
            "mean_len": float(lengths.mean())}


def pipeline_case(corpus: str, cache: str, pack: bool, seq_len: int, steps: int,
                  warmup: int) -> dict:
    """On every rank: train ``warmup + steps`` steps; step times and valid tokens per step."""
    import torch

    from pp_core import PipelineConfig, build_pipeline
    from pp_core_builtins.models.gpt import GPT
    from pp_core_builtins.models.tokenized import tokenized_text

    torch.manual_seed(0)
    model = GPT(vocab_size=256, dim=128, num_layers=4, num_heads=4, max_seq_len=seq_len)
    config = PipelineConfig(pp_schedule="1f1b", pp_batch_size=BATCH,
                            pp_microbatch_size=MICROBATCH, loss_fn="cross_entropy",
                            scale_grads_in_schedule=True)
    pipe = build_pipeline(model, config)
    optimizer = torch.optim.AdamW([p for part in pipe.model_parts for p in part.parameters()],
                                  lr=1e-3)
    data = iter(tokenized_text([corpus], "bytes", seq_len, pack, batch_size=BATCH,
                               cache_dir=cache))
    times, valid = [], []
    for step in range(warmup + steps):
        inputs, target = next(data)
        torch.distributed.barrier()
        start = time.perf_counter()
        pipe.step(inputs, target=target)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.distributed.barrier()
        if step >= warmup:
            times.append(time.perf_counter() - start)
            valid.append(int((target != -100).sum()))
    return {"step_s": statistics.median(times), "valid_tokens": statistics.mean(valid),
            "padding_fraction": 1 - statistics.mean(valid) / target.numel()}


def cache_startup(directory: str, num_docs: int, seq_len: int) -> dict:
    from pp_core_builtins.models.tokenized import tokenized_text

    corpus = os.path.join(directory, "big.jsonl")
    write_corpus(corpus, num_docs, seq_len, seed=1)
    cache = os.path.join(directory, "cache-startup")
    result = {"corpus_mb": os.path.getsize(corpus) / 2**20}
    for name in ("first_s", "second_s"):
        start = time.perf_counter()
        tokenized_text([corpus], "bytes", seq_len, True, batch_size=BATCH, cache_dir=cache)
        result[name] = time.perf_counter() - start
    return result


def main(argv=None) -> dict:
    args = options(__doc__, seq_len=256, steps=6, warmup=2, docs=2000, cache_docs=40000,
                   json=None).parse_args(argv)
    from bench_packing import pipeline_case as case  # importable by name in the ranks

    from pp_core.testing import DistPool

    results: dict = {"seq_len": args.seq_len, "batch": BATCH, "microbatches": BATCH // MICROBATCH}
    with tempfile.TemporaryDirectory() as directory:
        corpus = os.path.join(directory, "corpus.jsonl")
        results["corpus"] = write_corpus(corpus, args.docs, args.seq_len)
        cache = os.path.join(directory, "cache")
        with DistPool(2, timeout=1800) as pool:
            for pack in (False, True):
                rank0 = pool.run(case, corpus, cache, pack, args.seq_len, args.steps,
                                 args.warmup)[0]
                rank0["valid_tokens_per_s"] = rank0["valid_tokens"] / rank0["step_s"]
                results["packed" if pack else "padded"] = rank0
        results["ratio_valid_tokens_per_s"] = (results["packed"]["valid_tokens_per_s"]
                                               / results["padded"]["valid_tokens_per_s"])
        results["ratio_step_time"] = results["packed"]["step_s"] / results["padded"]["step_s"]
        results["cache"] = cache_startup(directory, args.cache_docs, args.seq_len)
    print(json.dumps(results, indent=1))
    print(f"\n{'mode':8} {'step ms':>9} {'valid tok/step':>15} {'padding':>8} {'valid tok/s':>12}")
    for mode in ("padded", "packed"):
        r = results[mode]
        print(f"{mode:8} {r['step_s'] * 1000:9.1f} {r['valid_tokens']:15.0f} "
              f"{r['padding_fraction']:8.1%} {r['valid_tokens_per_s']:12.0f}")
    print(f"packed / padded: valid tokens/s x{results['ratio_valid_tokens_per_s']:.2f}, "
          f"step time x{results['ratio_step_time']:.2f}")
    c = results["cache"]
    print(f"token cache ({c['corpus_mb']:.1f} MB corpus): first start {c['first_s']:.2f} s, "
          f"second {c['second_s']:.2f} s")
    write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()

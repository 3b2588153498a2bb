"""What the token cache's content check costs when a run opens a built cache.

    python benchmarks/bench_token_cache_open.py [--mib 64] [--repeats 3] [--json out.json]

Writes a corpus of ``--mib`` MiB of text (documents of a few hundred words drawn from the text
pp-core ships), builds its ``tokenized_text`` cache once with the byte tokenizer (four bytes of
``tokens.bin`` per byte of text: the largest cache a corpus of that size gets; a BPE tokenizer's
is about a quarter of it), then opens it ``--repeats`` times, each in a fresh process (the first
open of a run), page cache warm. Each open is split into its parts: the corpus hashed for the
cache key (what every open paid before), the sha256 of ``tokens.bin`` and ``offsets.npy`` (the
content check, new), and the rest. The median of each, and the check against the corpus hash.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _common import write_json  # noqa: E402

OPEN = """
import json, sys, time
from pp_core_builtins.models import token_cache
timed = {"key_s": 0.0, "digest_s": 0.0}
def clocked(name, function):
    def call(*args, **kwargs):
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            timed[name] += time.perf_counter() - start
    return call
token_cache._cache_key = clocked("key_s", token_cache._cache_key)
token_cache._digest = clocked("digest_s", token_cache._digest)
from pp_core_builtins.models.tokenized import tokenized_text
start = time.perf_counter()
data = tokenized_text(files=[sys.argv[1]], tokenizer="bytes", seq_len=256, batch_size=8,
                      cache_dir=sys.argv[2])
timed["open_s"] = time.perf_counter() - start
timed["tokens_bytes"] = data.cache.tokens.nbytes
print(json.dumps(timed))
"""


def write_corpus(path: str, mib: int) -> int:
    from pp_core_builtins.models.datasets import DEFAULT_TEXT

    words = DEFAULT_TEXT.read_text(encoding="utf-8").split()
    with open(path, "w", encoding="utf-8") as out:
        index = 0
        while out.tell() < mib << 20:
            length = 200 + index * 37 % 400
            start = index * 101 % max(1, len(words) - length)
            out.write(" ".join(words[start:start + length]) + "\n\n")
            index += 1
    return os.path.getsize(path)


def open_once(corpus: str, cache: str) -> dict:
    done = subprocess.run([sys.executable, "-c", OPEN, corpus, cache], capture_output=True,
                          text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="pp-core-cache-open-") as root:
        corpus, cache = os.path.join(root, "corpus.txt"), os.path.join(root, "cache")
        size = write_corpus(corpus, args.mib)
        start = time.perf_counter()
        open_once(corpus, cache)  # builds it
        build_s = time.perf_counter() - start
        runs = [open_once(corpus, cache) for _ in range(args.repeats)]
    median = {k: statistics.median(r[k] for r in runs) for k in ("open_s", "key_s", "digest_s")}
    result = {"corpus_bytes": size, "tokens_bytes": runs[0]["tokens_bytes"], "build_s": build_s,
              **median, "digest_over_key": median["digest_s"] / median["key_s"],
              "open_before_s": median["open_s"] - median["digest_s"],
              "open_ratio": median["open_s"] / (median["open_s"] - median["digest_s"]),
              "runs": runs}
    print(f"corpus {size / 2**20:.0f} MiB, tokens.bin {result['tokens_bytes'] / 2**20:.0f} MiB; "
          f"built in {build_s:.1f} s")
    print("| open of a built cache (median of %d fresh processes) | s |" % args.repeats)
    print("|---|---|")
    print(f"| corpus hashed for the key (paid before too) | {median['key_s']:.2f} |")
    print(f"| cache files hashed (the content check) | {median['digest_s']:.2f} |")
    print(f"| whole open, now | {median['open_s']:.2f} |")
    print(f"| whole open without the check | {result['open_before_s']:.2f} |")
    print(f"check / corpus hash: {result['digest_over_key']:.2f}x; open now / before: "
          f"{result['open_ratio']:.2f}x")
    write_json(args.json, result)


if __name__ == "__main__":
    main()

"""What checkpoint checksums cost: seconds per GiB to save and to load, with and without them.

    python benchmarks/checksum_cost.py [--gib 1.0] [--repeats 3] [--dir /path/on/the/disk]

One process saves a state dict of ``--gib`` GiB of float32 tensors (64 MiB each) with
:func:`pp_core.checkpoint.save_checkpoint` - with its checksums (sha256 computed while DCP
writes each file), and with DCP's plain writer in its place - then reads it back with ``read_model_state_dict`` with
``verify=True`` and ``verify=False``. Each figure is the best of ``--repeats`` runs; the page cache
is not dropped (the load figures are what a checkpoint written moments ago costs; a cold read
adds the disk's time to both). docs/yaml.md quotes the result.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import tempfile
import time
import warnings

import torch
from torch import nn

from torch.distributed.checkpoint import FileSystemWriter

from pp_core.checkpoint import save as checkpoint_save
from pp_core.checkpoint import read_model_state_dict, save_checkpoint


class Blob(nn.Module):
    def __init__(self, gib: float):
        super().__init__()
        count = max(1, round(gib * 16))  # 64 MiB tensors
        self.weights = nn.ParameterList(nn.Parameter(torch.randn(16 << 20), requires_grad=False)
                                        for _ in range(count))


def best(repeats: int, call) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: the temp dir)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    model = Blob(args.gib)
    gib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2 ** 30
    root = tempfile.mkdtemp(prefix="pp-core-checksum-", dir=args.dir)
    try:
        saved = []

        def save():
            shutil.rmtree(os.path.join(root, "ckpt"), ignore_errors=True)
            saved[:] = [save_checkpoint(os.path.join(root, "ckpt"), 1, [model], [None])]

        def without_checksums(path):  # the same save, through DCP's own writer
            writer = FileSystemWriter(path)
            writer.digests = {}
            return writer

        save()  # warm: the first save imports what DCP's state_dict helpers need
        hashing = checkpoint_save.hashing_writer
        checkpoint_save.hashing_writer = without_checksums
        t_plain = best(args.repeats, save)
        checkpoint_save.hashing_writer = hashing
        t_hashed = best(args.repeats, save)
        os.environ.pop("PP_CORE_VERIFIED_CHECKPOINTS", None)

        def load(verify):
            def call():
                os.environ.pop("PP_CORE_VERIFIED_CHECKPOINTS", None)
                read_model_state_dict(saved[0], verify=verify)
            return call

        t_unverified = best(args.repeats, load(False))
        t_verified = best(args.repeats, load(True))
        data = os.urandom(256 << 20)
        t_sha = best(args.repeats, lambda: hashlib.sha256(data).digest()) * 4
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{gib:.2f} GiB of float32, best of {args.repeats}, in {args.dir or 'the temp dir'}")
    print(f"sha256 alone (memory)    {t_sha:6.2f} s/GiB")
    print(f"save without checksums   {t_plain / gib:6.2f} s/GiB")
    print(f"save with checksums      {t_hashed / gib:6.2f} s/GiB  (+{(t_hashed - t_plain) / gib:.2f})")
    print(f"load, verify: false      {t_unverified / gib:6.2f} s/GiB")
    print(f"load, verify: true       {t_verified / gib:6.2f} s/GiB  "
          f"(+{(t_verified - t_unverified) / gib:.2f})")


if __name__ == "__main__":
    main()

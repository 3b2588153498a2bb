"""Checkpoints through ``torch.distributed.checkpoint`` (DCP), keyed by the model's own names.

A checkpoint is a DCP directory ``<dir>/step_00000100`` holding

- ``model.<name>``: every parameter and buffer under its name in the *unsplit* model (a model
  part keeps the original names, so no stage prefix ever enters the file);
- ``optim.state.<name>.<slot>`` / ``optim.param_groups.<name>.<option>``: the optimizer state,
  flattened per parameter name by ``torch.distributed.checkpoint.state_dict``;
- ``trainer.step``: the last completed step;

and beside them what the checkpoint says about itself: the record of what it was written for and
the checksums of every file (:mod:`pp_core.checkpoint.record`, the one module naming those files).

Because every key is a parameter name, a checkpoint written with one pipeline layout loads into
any other (pp=4 -> pp=2, or the unsplit model): each rank asks DCP for the keys its parts hold.
Parts sharded by FSDP2 / HSDP need nothing more: their parameters and optimizer moments are
DTensors, which DCP writes shard by shard under the same keys (with the whole shape) and reads
back into whatever shards or whole tensors the loading layout has (docs/data_parallel.md).

Crash-safe: a checkpoint is written beside its final place (``step_00000100.tmp-<id>``); once
every rank has finished, rank 0 moves an existing ``step_00000100`` aside, renames the new one in,
points the ``latest`` file at it (written to a temporary file, then ``os.replace``) and only then
removes the old one. A process killed at any instant leaves the previous checkpoint of that step
intact and ``latest`` naming a complete checkpoint; leftovers (``*.tmp-*``, ``*.old-*``) are never
taken for a checkpoint. A checkpoint that is incomplete or corrupt all the same (copied in part,
truncated, a byte changed: every file's sha256, recorded while it was written, is checked at
resume, load and export - :mod:`pp_core.checkpoint.checksums`) is refused with one message
naming its directory. A save the disk refuses (full, read-only) is removed on every rank and
named in one line; the previous checkpoint stays.

Safe by default: a checkpoint from elsewhere is data. DCP's reader unpickles its ``.metadata``
file and ``torch.load``\\ s non-tensor items with ``weights_only=False``; here the metadata goes
through an unpickler that only admits DCP's own metadata classes and torch dtypes/sizes, and
non-tensor items load with ``weights_only=True``.
"""


from pp_core.checkpoint.directory import checkpoint_path, latest_checkpoint, resume_checkpoint
from pp_core.checkpoint.load import (export_checkpoint, load_checkpoint, load_into_model,
                                     read_model_state_dict, read_tensors)
from pp_core.checkpoint.safe_reader import SafeLoadPlanner, SafeReader
from pp_core.checkpoint.save import save_checkpoint

__all__ = ["checkpoint_path", "latest_checkpoint", "resume_checkpoint", "save_checkpoint",
           "load_checkpoint", "read_tensors", "read_model_state_dict", "load_into_model",
           "export_checkpoint", "SafeReader", "SafeLoadPlanner"]

"""Every private torch internal pp-core relies on, in one place.

The rest of pp-core uses torch's public API only. What follows reaches behind it, either for
speed or because torch offers no public way; each shim says what it is for, what it does when
torch lacks the internal, and the torch releases it was checked on. A torch release that moves
one of them breaks here, not across the code base.

"Checked on" names the releases where the shim ran: 2.13.0 (CI, the oldest supported), 2.14.1
and 2.15.0 ran the whole suite (README, Install: what passed). 2.11 and 2.12 are outside the range:
both lack ``FSDPState._reset_iter_state`` (``fsdp_reset``), and 2.11's runtime hangs on pp-core's
V-placed compute_comms exports. A new release: ``bash scripts/test-torch.sh VERSION``, then add it
here, to ``pyproject.toml``'s range and to README.

torch 2.15's new public pipelining APIs (pre-split microbatches in ``step``,
``register_forward_context``, ``analyze_pipeline_activation_liveness``, per-edge P2P groups) serve
torch's own schedule classes, which pp-core's runtime does not use; none replaces a shim here, so
none is used (pp-core splits microbatches, prepares per-microbatch resources and plans buffer
lifetimes itself).

Nothing here imports ``torch.distributed`` at import time (importing :mod:`pp_core.runtime` must
not); those shims import on first use.
"""

from __future__ import annotations

import contextlib
import sys
import socket
from functools import partial
from typing import Callable, Optional

import torch
import torch.distributed as dist

__all__ = ["engine_run_backward", "ACCUMULATE_GRAD", "process_group_store", "set_state_dict_item",
           "dcp_metadata_path", "consolidate_hf_safetensors", "tcp_stores_listening_on_their_host",
           "failed_ranks_stopped_within", "nn_init_skipped",
           "donated_buffers_on", "donated_buffers_off", "disable_donated_buffers",
           "allow_forward_side_effects_under_checkpoint",
           "fsdp_reduce_and_reshard", "fsdp_reset", "ddp_arm_reducer", "fsdp_replicate",
           "profiler_enabled", "TorchDispatchMode", "flatten_mesh", "linear_style_functions",
           "CPU_FLASH_ATTENTION"]

# -------------------------------------------------------------------------- autograd (backward.py)

try:  # The engine entry point under torch.autograd.backward/grad, without their argument
    # normalisation (~80 us per call with GradientEdge roots: a third of a small W's time).
    # Signature (roots, grads, retain_graph, create_graph, inputs, *, allow_unreachable,
    # accumulate_grad); checked on 2.13, 2.14, 2.15.0. Missing: None, and backward.py calls the
    # public torch.autograd.backward/grad, which do the same, slower.
    from torch.autograd.graph import _engine_run_backward as engine_run_backward
except ImportError:  # pragma: no cover - a torch without it
    engine_run_backward = None

DYNAMO_MODULE = "torch._dynamo"
"""The module torch imports on a process's first optimizer (``Optimizer.__init__`` calls a
``torch._disable_dynamo`` function) and first elementwise op on meta tensors: seconds of a rank's
start, which a warm fork server imports ahead (``pp_core.app.launch.warm``). Checked on 2.13."""

# The autograd node type of a leaf tensor (its ``.variable`` is the leaf). backward.py tells leaf
# nodes apart by type, since ``getattr(node, "variable")`` raises, slowly, on every other node.
# Checked on 2.13, 2.14, 2.15.0. Missing: None, and backward.py falls back to that getattr.
ACCUMULATE_GRAD = getattr(getattr(torch._C, "_functions", None), "AccumulateGrad", None)

# SDPA's CPU flash kernel and its backward, the ops ``scaled_dot_product_attention`` dispatches to
# on CPU (it passes a boolean mask as an additive float one). runtime/prefix_attention.py calls
# them itself, so a sequence slice's attention saves the per-slice keys and values and not their
# concatenation without recomputing the attention in the backward. Checked on 2.13. Missing:
# None, and that module recomputes the attention forward in the backward instead.
CPU_FLASH_ATTENTION = (getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None),
                       getattr(torch.ops.aten,
                               "_scaled_dot_product_flash_attention_for_cpu_backward", None))
if None in CPU_FLASH_ATTENTION:  # pragma: no cover - a torch without them
    CPU_FLASH_ATTENTION = None

# ---------------------------------------------------------------------------------- c10d (comm.py)


def process_group_store(group):
    """The key-value store behind ``group``, where a failing rank publishes why it failed so
    its peers can say it (:mod:`pp_core.runtime.p2p`). torch has no public getter; this is
    ``distributed_c10d._get_process_group_store``, checked on 2.13, 2.14, 2.15.0."""
    from torch.distributed.distributed_c10d import _get_process_group_store  # lazy: private API

    return _get_process_group_store(group)


# ----------------------------------------------------------------------------- DCP (checkpoint.py)


def set_state_dict_item(state_dict: dict, path, value) -> None:
    """Put ``value`` at a flattened key's ``path`` in a nested state dict, as DCP's own load
    planner does (``torch.distributed.checkpoint._traverse.set_element``; checked on 2.13,
    2.14, 2.15.0). Used by the safe load planner of :mod:`pp_core.checkpoint`."""
    from torch.distributed.checkpoint._traverse import set_element  # lazy: private torch API

    set_element(state_dict, path, value)


def dcp_metadata_path(reader, rank: Optional[int]):
    """The path of a ``FileSystemReader``'s ``.metadata`` file (its private
    ``_get_metadata_path``; checked on 2.13, 2.14, 2.15.0), which the safe reader of
    :mod:`pp_core.checkpoint` opens itself so it can unpickle with an allow-list."""
    return reader._get_metadata_path(rank)


def consolidate_hf_safetensors(input_dir: str, output_dir: str, index_of: dict,
                               process_group=None, distributed: bool = False) -> None:
    """torch's consolidation of DCP-sharded safetensors files into whole tensors, one output
    file per index of ``index_of`` (``model-0000i-of-0000N.safetensors`` and torch's index):
    ``consolidate_safetensors_files`` (or its ``..._on_every_rank`` form, each rank a share of
    the files), public names in the private module ``_consolidate_hf_safetensors`` that
    ``HuggingFaceStorageWriter`` itself calls. Checked on 2.13."""
    from torch.distributed.checkpoint import _consolidate_hf_safetensors as hf  # lazy: DCP

    if distributed:
        hf.consolidate_safetensors_files_on_every_rank(input_dir, output_dir, index_of,
                                                       process_group=process_group)
    else:
        hf.consolidate_safetensors_files(input_dir, output_dir, index_of)


# ---------------------------------------------------------------------------- launcher (launch.py)


@contextlib.contextmanager
def tcp_stores_listening_on_their_host(local: Callable[[str], bool]):
    """Make every server-side TCPStore created meanwhile for a host ``local(host)`` accepts
    listen on that address only.

    torch's TCPStore server binds every interface whatever host it is given; the elastic agent
    creates two (the c10d rendezvous store and the store it shares with the workers). Here a
    server for such a host is handed a socket already bound to it (the ``master_listen_fd``
    argument), by replacing ``TCPStore`` where the agent looks it up: ``torch.distributed`` and
    ``torch.distributed.elastic.rendezvous.c10d_rendezvous_backend``. Checked on 2.13, 2.14,
    2.15.0.
    """
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend  # lazy: elastic

    real = dist.TCPStore

    class LocalTCPStore(real):
        def __init__(self, host_name, port, *args, **kwargs):
            is_master = kwargs.get("is_master", args[1] if len(args) > 1 else False)
            if is_master and local(str(host_name)) and kwargs.get("master_listen_fd") is None:
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                try:
                    sock.bind(("127.0.0.1" if host_name == "localhost" else host_name, port))
                    sock.listen(128)
                except OSError as exc:  # torch's callers expect RuntimeError (port in use)
                    sock.close()
                    raise RuntimeError(f"cannot listen on {host_name}:{port}: {exc}") from None
                port = sock.getsockname()[1]
                kwargs["master_listen_fd"] = sock.detach()  # the store owns the socket now
            super().__init__(host_name, port, *args, **kwargs)

    targets = [(dist, "TCPStore"), (c10d_rendezvous_backend, "TCPStore")]
    saved = [(module, name, getattr(module, name)) for module, name in targets]
    try:
        for module, name in targets:
            setattr(module, name, LocalTCPStore)
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


@contextlib.contextmanager
def failed_ranks_stopped_within(seconds: float):
    """Meanwhile, once a rank has failed, the others get ``seconds`` after SIGTERM, then SIGKILL.

    torch's elastic agent watches its ranks through ``torch.multiprocessing``'s
    ``ProcessContext.join``, which, when a rank has failed, sends the others SIGTERM and waits
    30 s (its fixed default) before SIGKILL: a rank that cannot answer SIGTERM (SIGSTOPped, hung
    in C) held every restart 30 s. Here that wait (``_join_procs_with_timeout``) is at most
    ``seconds``, the time the agent's own stop gives (``shutdown_timeout``). Checked on 2.13.
    """
    from torch.multiprocessing.spawn import ProcessContext  # lazy: only the launcher

    real = getattr(ProcessContext, "_join_procs_with_timeout", None)
    if real is None:  # pragma: no cover - a torch without it: its own wait stands
        yield
        return

    def join_within(self, timeout: float):
        return real(self, min(timeout, seconds))

    ProcessContext._join_procs_with_timeout = join_within
    try:
        yield
    finally:
        ProcessContext._join_procs_with_timeout = real


# -------------------------------------------------------------------------- nn.init (preflight.py)


@contextlib.contextmanager
def nn_init_skipped():
    """Make ``torch.nn.init``'s in-place initialisers (the public names ending in ``_``) no-ops
    while a model is built on the meta device.

    Meta tensors hold no values, so initialising them is pointless, and the first ``normal_`` on
    the meta device costs seconds (torch imports its decompositions for it). Modules call the
    initialisers through the ``torch.nn.init`` module, so replacing its attributes reaches them.
    Checked on 2.13, 2.14, 2.15.0.
    """
    names = [n for n in dir(torch.nn.init) if n.endswith("_") and not n.startswith("_")
             and callable(getattr(torch.nn.init, n))]
    saved = {n: getattr(torch.nn.init, n) for n in names}
    try:
        for name in names:
            setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


# ------------------------------------------ compiled backward (backward.py, parallel/compile.py)
# ``torch._functorch.config.donated_buffer``: when on, a torch.compile'd backward may free
# ("donate") its saved buffers and then refuses ``retain_graph=True``, which the split backward's
# input pass needs (pytorch#161904). Checked on 2.13, 2.15.0. Missing: donation cannot be asked about or
# turned off, so these say "off" and do nothing.


def donated_buffers_on() -> bool:
    """Whether compiled backwards may donate their buffers (torch's default: yes)."""
    try:
        from torch._functorch import config  # lazy: private torch API
    except ImportError:  # pragma: no cover - a torch without it
        return False
    return bool(config.donated_buffer)


def donated_buffers_off():
    """A context in which compiled backwards keep their buffers (for a retained backward pass)."""
    try:
        from torch._functorch import config  # lazy: private torch API
    except ImportError:  # pragma: no cover - a torch without it
        return contextlib.nullcontext()
    return config.patch(donated_buffer=False)


def disable_donated_buffers() -> None:
    """Turn buffer donation off for the process (every compile from here on)."""
    try:
        from torch._functorch import config  # lazy: private torch API
    except ImportError:  # pragma: no cover - a torch without it
        return
    config.donated_buffer = False


def allow_forward_side_effects_under_checkpoint() -> None:
    """Let dynamo trace a checkpointed block whose forward changes Python state (for the
    process): without it such a block breaks the graph inside ``torch.utils.checkpoint`` and
    runs as eager selective checkpointing, which refuses the second backward of a split
    ``I``/``W`` ("Trying to backward an extra time"). transformers 5.25 routes every attention
    forward through the ``kernels`` library, which sets a context variable there. The side
    effect then runs once, in the forward, not again in the recompute - as in any compiled
    function (torch's documented switch, ``torch._dynamo.config``)."""
    try:
        from torch._dynamo import config  # lazy: private torch API
    except ImportError:  # pragma: no cover - a torch without it
        return
    config.skip_fwd_side_effects_in_bwd_under_checkpoint = True


# ---------------------------------------- data parallelism (runtime/dp_sync.py): data_parallel.py

from pp_core._torch_compat.data_parallel import (  # noqa: E402 - the shims' second chapter
    ddp_arm_reducer, fsdp_process_groups, fsdp_replicate, fsdp_reduce_and_reshard, fsdp_reset)


def flatten_mesh(mesh):
    """A 1-D DeviceMesh over every rank of a multi-dimensional one (an HSDP dp mesh, for the
    token count's all-reduce, runtime/token_loss.py). torch has no public flatten; ``_flatten``
    is what torchtitan uses. Checked on 2.13.0, 2.15.0."""
    return mesh._flatten()


def composable_engines(module) -> tuple[str, ...]:
    """The composable engines (``fully_shard``, ``replicate``, ...) managing ``module``, read
    from their registry without importing them (nothing registered: the module is not wrapped;
    runtime/build_checks.py). Checked on 2.13.0, 2.15.0. Missing: ``()``, and the FSDPModule / DDP type
    checks alone find wrapped models."""
    contract = sys.modules.get("torch.distributed._composable.contract")
    registry = getattr(contract, "_get_registry", None) if contract is not None else None
    return tuple(registry(module) or {}) if registry is not None else ()


def compile_backends() -> list[str]:
    """Every backend name ``torch.compile`` accepts, as ``torch._dynamo.list_backends`` gives
    them (parallel/compile_options.py; there is no public list). Importing dynamo takes seconds,
    so only when a backend is named. Checked on 2.13.0, 2.15.0."""
    import torch._dynamo  # lazy: seconds to import, only when a backend is named

    return sorted(torch._dynamo.list_backends(exclude_tags=()))


def inductor_options() -> set[str]:
    """Every option name ``torch.compile(options=...)`` passes to inductor, as
    ``torch._inductor.list_options`` gives them (parallel/compile_options.py; no public list;
    checked on 2.13.0); an empty set where it is missing (nothing is then refused)."""
    import torch._inductor  # lazy: seconds to import, only when options are given

    lister = getattr(torch._inductor, "list_options", None)
    return set(lister()) if callable(lister) else set()


def linear_style_functions(style, desired_input_layouts) -> tuple:
    """A Colwise/RowwiseParallel's ``(partition, input_fn, output_fn)`` as its ``_apply`` gives
    them to ``distribute_module``, for a PEFT layer (parallel/lora_tp.py). Ran on 2.13, 2.15."""
    return (style._partition_linear_fn,
            partial(style._prepare_input_fn, style.input_layouts, desired_input_layouts),
            partial(style._prepare_output_fn, style.output_layouts, style.use_local_output))


# ------------------------------------------------------------------ the profiler (runtime/observers.py)

def profiler_enabled() -> bool:
    """Whether a torch profiler records now: the flag ``record_function`` reads (under a us;
    entering it costs ~10 us, bench_seam.py). Missing: always profiled. Checked on 2.13-2.15."""
    enabled = getattr(torch.autograd, "_profiler_enabled", None)
    return True if enabled is None else bool(enabled())


# ------------------------------------------------------------ allocations (runtime/transient.py)

try:  # A mode that sees every aten op below autograd, forward and backward alike: the profiler
    # counts the tensors a unit creates and frees with it (its transient peak). Torch's public
    # profiler records allocations too, but only as a trace to parse after the fact. Checked on
    # 2.13.0, 2.15.0. Missing: None, and profiles record a transient peak of 0 (the old prediction).
    from torch.utils._python_dispatch import TorchDispatchMode
except ImportError:  # pragma: no cover - a torch without it
    TorchDispatchMode = None

"""pp_core._torch_compat is the one place that reaches behind torch's public API: every shim
resolves on the installed torch (no silent fallback), and no other module uses a private one."""

import re
import sys
from pathlib import Path

import torch

from pp_core import _torch_compat as compat

ROOT = Path(__file__).resolve().parents[2]
PRIVATE = re.compile(
    r"torch(\.\w+)*\._[a-z]\w*"                    # torch._C, torch.distributed.x._y, ...
    r"|from torch[\w.]* import [^#\n]*\b_[a-z]\w*"  # from torch.x import _private
    r"|\b(_get_process_group_store|_get_metadata_path|_engine_run_backward|master_listen_fd)\b"
    r"|setattr\(torch\b")


def test_no_module_but_the_compat_one_uses_a_private_torch_internal():
    found = []
    for path in sorted([*(ROOT / "pp_core").rglob("*.py"), *(ROOT / "plugins").rglob("*.py")]):
        if "_torch_compat" in path.relative_to(ROOT).parts[:2] or path.name == "_torch_compat.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if PRIVATE.search(code) and '``' not in code:
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, "move these behind pp_core/_torch_compat/:\n" + "\n".join(found)


def test_the_autograd_shims_resolve_on_this_torch():
    """Both have a public fallback; the suite must still notice when a torch release drops one."""
    assert compat.engine_run_backward is not None
    leaf = torch.ones(3, requires_grad=True)
    out = (leaf * 2).sum()
    [(mul, _)] = out.grad_fn.next_functions
    assert type(mul.next_functions[0][0]) is compat.ACCUMULATE_GRAD
    assert mul.next_functions[0][0].variable is leaf
    compat.engine_run_backward((out,), (torch.tensor(1.0),), False, False, (),
                               allow_unreachable=True, accumulate_grad=True)
    assert torch.equal(leaf.grad, torch.full((3,), 2.0))


def test_nn_init_is_skipped_inside_and_restored_after():
    weight = torch.zeros(4)
    normal = torch.nn.init.normal_
    with compat.nn_init_skipped():
        assert torch.nn.init.normal_(weight) is weight and not weight.any()
        torch.nn.Linear(2, 2, device="meta")  # what preflight builds; nothing initialised
    assert torch.nn.init.normal_ is normal
    torch.nn.init.normal_(weight)
    assert weight.any()


def test_the_data_parallel_shims_resolve_on_this_torch():
    """What runtime/dp_sync.py and parallel/data_parallel.py reach for exists on this torch
    (the multi-rank behaviour is tests/parallel/test_fsdp_pipeline.py)."""
    from torch.distributed._composable_state import _get_module_state
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    from torch.nn.parallel.distributed import _find_tensors

    assert callable(_get_module_state) and callable(_find_tensors)
    assert callable(FSDPParamGroup.post_backward)
    assert callable(FSDPState._root_post_backward_final_callback)
    assert callable(FSDPState._reset_iter_state)
    replicate = compat.fsdp_replicate()
    assert callable(replicate)
    assert issubclass(sys.modules[replicate.__module__].ReplicateModule, FSDPModule)


def test_the_cpu_flash_attention_ops_resolve_and_match_sdpa():
    """What runtime/prefix_attention.py calls on CPU: SDPA's own kernel (same values), and its
    backward gives SDPA's gradients."""
    import torch.nn.functional as functional

    assert compat.CPU_FLASH_ATTENTION is not None
    forward, backward = compat.CPU_FLASH_ATTENTION
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=gen, requires_grad=True) for _ in range(3))
    want = functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    want.backward(torch.ones_like(want))
    out, lse = forward(q.detach(), k.detach(), v.detach(), 0.0, True)
    torch.testing.assert_close(out, want.detach())
    grads = backward(torch.ones_like(out), q.detach(), k.detach(), v.detach(), out, lse, 0.0, True)
    for got, leaf in zip(grads, (q, k, v)):
        torch.testing.assert_close(got, leaf.grad)

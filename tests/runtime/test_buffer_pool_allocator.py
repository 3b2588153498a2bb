"""The pool allocator on its own: reuse, copy-out safety, growth, views, reporting, the hook."""

import pytest
import torch

import pp_core_builtins.buffer_pool
from pp_core_builtins.buffer_pool import RecvBufferPool
from pp_core import PipelineConfig
from pp_core.errors import PipelineError
from pp_core.plugin_manager import load_plugins
from pp_core.schedule import RECV_B, RECV_F, build_schedule
from pp_core.schedule.lower import lower
from pp_core.runtime.wire import TensorMeta


def _program(name="1f1b", num_ranks=4, num_microbatches=8, rank=1):
    return lower(build_schedule(name, num_ranks=num_ranks,
                                num_microbatches=num_microbatches)).rank(rank)


def _meta(*shape, dtype=torch.float32):
    return TensorMeta(tuple(shape), dtype, dtype.is_floating_point)


def _run_program(pool, program, metas_of, use_consume=True):
    """Drive the pool in program order, as the executor does; return every message's tensors."""
    by_posted = {lt.posted: i for i, lt in enumerate(program.recv_lifetimes)}
    by_consumed = {lt.consumed: i for i, lt in enumerate(program.recv_lifetimes)}
    by_released: dict[int, list] = {}
    for i, lt in enumerate(program.recv_lifetimes):
        by_released.setdefault(lt.released, []).append(i)
    buffers, delivered = {}, {}
    for index in range(len(program.actions)):
        if index in by_posted:
            i = by_posted[index]
            buffers[i] = pool.allocate(i, metas_of(program.recv_lifetimes[i].action))
            value = float(i + 1)
            for t in buffers[i]:
                t.fill_(value)  # "the message arrives"
        if index in by_consumed:
            i = by_consumed[index]
            tensors = buffers[i]
            delivered[i] = pool.consume(i, tensors) if use_consume else tensors
        for i in by_released.get(index, ()):
            # Everything this receive delivered is still intact until its release.
            intact = all(torch.all(t == float(i + 1)) for t in delivered[i])
            assert intact, program.recv_lifetimes[i]
            pool.release(i)
    pool.reset()
    return delivered


@pytest.mark.parametrize("name", ["1f1b", "gpipe", "interleaved_1f1b", "zb_h2", "dualpipe_v"])
@pytest.mark.parametrize("use_consume", [True, False])
def test_pool_never_overwrites_a_message_in_use(name, use_consume):
    program = _program(name, rank=1)
    pool = RecvBufferPool(program, "cpu", slack=1)
    _run_program(pool, program, lambda action: [_meta(2, 3), _meta(4, dtype=torch.int64)],
                 use_consume)
    overflow = sum(row["overflow"] for row in pool.report())
    if use_consume:
        assert overflow == 0  # exactly the planned number of sets
    assert all(row["pool_sets"] <= row["default_sets"] + row["planned_sets"]
               for row in pool.report())


def test_1f1b_middle_stage_needs_one_set_plus_slack_per_direction():
    program = _program("1f1b", num_ranks=4, num_microbatches=16, rank=1)
    pool = RecvBufferPool(program, "cpu", slack=2)
    _run_program(pool, program, lambda action: [_meta(8, 16)])
    rows = {(r["stage"], r["direction"]): r for r in pool.report()}
    for direction in "FB":
        row = rows[(1, direction)]
        assert (row["lower_bound"], row["pool_sets"], row["overflow"]) == (1, 3, 0)
        assert row["default_bytes"] == 16 * 8 * 16 * 4
        assert row["pool_bytes"] == 3 * 8 * 16 * 4
        assert row["pool_sets"] <= 4 - 1 + 2  # NeMo AutoModel's ring


def test_consume_returns_independent_copies():
    program = _program()
    pool = RecvBufferPool(program, "cpu", slack=0)
    first = next(i for i, lt in enumerate(program.recv_lifetimes) if lt.action.kind is RECV_F)
    second = next(i for i, lt in enumerate(program.recv_lifetimes)
                  if lt.action.kind is RECV_F and i != first)
    (buffer,) = pool.allocate(first, [_meta(3)])
    buffer.fill_(1.0)
    (copy,) = pool.consume(first, [buffer])
    (reused,) = pool.allocate(second, [_meta(3)])
    assert reused.data_ptr() == buffer.data_ptr()  # slack 0: the same set again
    reused.fill_(2.0)
    assert torch.equal(copy, torch.ones(3))
    assert copy.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr()


def test_sets_grow_to_the_largest_shape_and_serve_views():
    program = _program()
    pool = RecvBufferPool(program, "cpu", slack=0)
    lifetimes = [i for i, lt in enumerate(program.recv_lifetimes) if lt.action.kind is RECV_B]
    small = pool.allocate(lifetimes[0], [_meta(2, 4)])[0]
    pool.release(lifetimes[0])
    big = pool.allocate(lifetimes[1], [_meta(2, 9), _meta(5, dtype=torch.bfloat16)])
    assert [tuple(t.shape) for t in big] == [(2, 9), (5,)]
    assert big[1].dtype == torch.bfloat16 and all(t.is_contiguous() for t in big)
    assert big[0].data_ptr() != small.data_ptr()  # grew: a new, larger buffer
    pool.release(lifetimes[1])
    again = pool.allocate(lifetimes[2], [_meta(3, 3)])[0]
    assert again.data_ptr() == big[0].data_ptr()  # smaller: a view of the grown buffer
    assert pool.nbytes == 2 * 9 * 4 + 5 * 2


def test_pool_grows_instead_of_reusing_a_live_buffer():
    program = _program("gpipe", num_microbatches=4)
    pool = RecvBufferPool(program, "cpu", slack=0)
    forward = [i for i, lt in enumerate(program.recv_lifetimes) if lt.action.kind is RECV_F]
    tensors = [pool.allocate(i, [_meta(1)])[0] for i in forward]  # never consumed nor released
    assert len({t.data_ptr() for t in tensors}) == 4
    row = next(r for r in pool.report() if r["direction"] == "F")
    assert row["overflow"] == 4 - row["planned_sets"]


def test_allocating_a_receive_twice_is_an_error_naming_it():
    program = _program()
    pool = RecvBufferPool(program, "cpu")
    pool.allocate(0, [_meta(1)])
    with pytest.raises(PipelineError, match=rf"receive {program.recv_lifetimes[0].action} was "
                                            r"allocated twice"):
        pool.allocate(0, [_meta(1)])
    with pytest.raises(PipelineError, match="not in this rank's program"):
        pool.allocate(999, [_meta(1)])


def test_hook_answers_only_when_the_pool_is_enabled():
    program = _program()
    plugins = load_plugins(entry_points=False, plugins=[pp_core_builtins.buffer_pool])
    off = PipelineConfig()
    on = PipelineConfig(pp_recv_buffer_pool=True, pp_recv_buffer_pool_slack=0)
    assert plugins.recv_buffer_allocator(off, program, 1, torch.device("cpu")) is None
    pool = plugins.recv_buffer_allocator(on, program, 1, torch.device("cpu"))
    assert isinstance(pool, RecvBufferPool) and pool.slack == 0
    assert "RecvBufferPool(rank=1, slack=0" in repr(pool)


def test_pool_is_an_allocator_the_runtime_accepts():
    from pp_core.runtime.allocator import RecvBufferAllocator, make_recv_buffer_allocator

    program = _program()
    plugins = load_plugins(entry_points=False, plugins=[pp_core_builtins.buffer_pool])
    config = PipelineConfig(pp_recv_buffer_pool=True)
    allocator = make_recv_buffer_allocator(plugins, config, program, 1, torch.device("cpu"))
    assert isinstance(allocator, RecvBufferPool)
    assert isinstance(allocator, RecvBufferAllocator)
    assert RECV_B in {lt.action.kind for lt in program.recv_lifetimes}

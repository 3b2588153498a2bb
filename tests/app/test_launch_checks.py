"""What ``pp-core run`` settles before any process starts, and how it ends.

The device for this machine's ranks (a pure rule of three numbers, so a CPU machine tests what a
GPU machine meets), the rendezvous endpoint (a port held by another program, a bind-all address,
nodes that never come — each ends fast with the key to change, never a hang),
``$PP_CORE_TIMEOUT``, and the exit codes of Ctrl-C and SIGTERM. Real sockets, real stores, real
``pp-core`` processes.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from pp_core.app.machine import local_ranks
from pp_core.devices import choose_device
from pp_core.errors import ConfigError, PipelineError
from pp_core.app.launch import launch
from pp_core.app.rendezvous import _wait_for_listener, prepare_endpoint
from pp_core.app.spec import SpecError, parse_spec
from pp_core.app.spec.sections import DistributedSpec
from pp_core_builtins.models import GPT
from tests.cases.specs import tiny_gpt_spec
from tests.cases.warm import warm_launch

ROOT = Path(__file__).resolve().parents[2]
TINY = tiny_gpt_spec(distributed={"dp_size": 1, "device": "cpu"})


def distributed(**values) -> DistributedSpec:
    return parse_spec({**TINY, "distributed": {**TINY["distributed"], **values}},
                      "t.yaml").distributed


def start(tmp_path, *sets: str, env=None) -> subprocess.Popen:
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(TINY))
    args = [sys.executable, "-m", "pp_core", "run", str(path)]
    for item in sets:
        args += ["--set", item]
    # PYTHONFAULTHANDLER: a hung run is stopped with SIGABRT, which then prints every thread
    return subprocess.Popen(args, cwd=ROOT, env={**os.environ, "PYTHONFAULTHANDLER": "1",
                                                 **(env or {})}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=_as_from_a_terminal)


def _as_from_a_terminal() -> None:
    """Ctrl-C as a terminal delivers it. A suite started in the background of a
    non-interactive shell (``bash -c '... &'``) inherits SIGINT ignored, and so would the run:
    rightly - a background job ignores Ctrl-C - but then the Ctrl-C tests send it in vain."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def finish(process: subprocess.Popen, timeout: float = 90) -> tuple[int, str, str]:
    """Its exit code and output; a process still running after ``timeout`` s is a hang."""
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGABRT)  # the faulthandler's stacks: where it hung
        try:
            out, err = process.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            out, err = process.communicate()
        pytest.fail(f"pp-core run hung for {timeout} s: {out[-500:]} {err[-4000:]}")
    return process.returncode, out, err


@pytest.fixture
def foreign_listener():
    """Another program's service: it accepts connections and never answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        yield sock.getsockname()[1]


# ----------------------------------------------------------------------------- the device


@pytest.mark.parametrize("requested, ranks, gpus, device, backend", [
    ("auto", 2, 0, "cpu", "gloo"),
    ("auto", 2, 1, "cpu", "gloo"),  # was cuda, then "invalid device ordinal" on rank 1
    ("auto", 2, 2, "cuda", "nccl"),
    ("auto", 1, 1, "cuda", "nccl"),
    ("cpu", 4, 8, "cpu", "gloo"),
    ("cuda", 2, 2, "cuda", "nccl"),
])
def test_the_device_is_a_rule_of_ranks_and_gpus(requested, ranks, gpus, device, backend):
    choice = choose_device(requested, ranks, gpus)
    assert (choice.device, choice.backend) == (device, backend)
    if requested == "auto":
        assert choice.reason.startswith("auto: ")


def test_auto_says_why_it_chose_the_cpu():
    assert choose_device("auto", 2, 1).reason == (
        "auto: 2 ranks on this machine but only 1 GPU; set device: cuda with fewer ranks per node")
    assert choose_device("auto", 2, 0).reason == "auto: no GPU"


@pytest.mark.parametrize("gpus, fix", [
    (1, "use device: cpu, or at most 1 rank(s) per node (pp_size x dp_size / nnodes <= 1)"),
    (0, "use device: cpu (or auto)"),
])
def test_cuda_with_fewer_gpus_than_ranks_is_refused(gpus, fix):
    with pytest.raises(ConfigError) as info:
        choose_device("cuda", 2, gpus)
    assert str(info.value).startswith(
        f"distributed.device: cuda needs one GPU per rank: 2 ranks on this machine need 2 GPUs; "
        f"found {gpus}: ")
    assert fix in str(info.value)


def test_nccl_on_the_cpu_auto_chose_is_refused():
    with pytest.raises(ConfigError, match=r"distributed.backend: nccl needs CUDA tensors, but "
                                          r"the ranks run on the cpu \(auto: 2 ranks"):
        choose_device("auto", 2, 1, backend="nccl")


def test_local_ranks_count_this_machine_only():
    assert local_ranks(distributed(pp_size=4, dp_size=2), environ={}) == 8
    assert local_ranks(distributed(pp_size=4, dp_size=2, nnodes=2, master_port=29500),
                       environ={}) == 4
    assert local_ranks(distributed(pp_size=4), environ={"LOCAL_WORLD_SIZE": "2"}) == 2


@pytest.mark.cli
@pytest.mark.ranks
def test_run_refuses_cuda_without_gpus_before_starting_ranks(tmp_path):
    code, out, err = finish(start(tmp_path, "distributed.device=cuda",
                                  env={"CUDA_VISIBLE_DEVICES": ""}))
    assert code == 1, err[-2000:]
    assert "distributed.device: cuda needs one GPU per rank: 2 ranks on this machine need 2 " \
           "GPUs; found 0: use device: cpu (or auto)" in err
    assert "starting" not in out and "Traceback" not in err


# ----------------------------------------------------------------------------- the rendezvous


@pytest.mark.parametrize("key, value, expected", [
    ("master_port", 99999, "a TCP port 1..65535"),
    ("master_port", -1, "a TCP port 1..65535"),
    ("master_addr", "0.0.0.0", "0.0.0.0 is a bind-all address"),
    ("master_addr", "::", ":: is a bind-all address"),
    ("master_addr", "127.0.0.1:29500", "without a port (the port goes in master_port)"),
    ("master_addr", "not a host", "a host name or IP address"),
    ("master_addr", "300.1.1.1", "a host name or IP address"),
    ("rdzv_endpoint", "127.0.0.1", "host:port"),
    ("rdzv_endpoint", "127.0.0.1:http", "host:port"),
    ("rdzv_endpoint", "127.0.0.1:70000", "a TCP port 1..65535"),
    ("rdzv_endpoint", "0.0.0.0:29500", "0.0.0.0 is a bind-all address"),
    ("rdzv_endpoint", "::1:29500", "an IPv6 host in brackets"),
])
def test_bad_rendezvous_keys_are_refused_with_the_key(key, value, expected):
    with pytest.raises(SpecError) as info:
        distributed(**{key: value})
    assert f"distributed.{key}: expected " in str(info.value)
    assert expected in str(info.value)


@pytest.mark.parametrize("key, value", [
    ("master_addr", "localhost"), ("master_addr", "node-0.cluster.example"),
    ("master_addr", "::1"), ("rdzv_endpoint", "[::1]:29500"), ("rdzv_endpoint", "node0:29500"),
    ("master_port", 29500),
])
def test_good_rendezvous_keys_pass(key, value):
    assert getattr(distributed(**{key: value}), key) == value


def test_one_node_hosts_the_store_on_a_free_port():
    endpoint = prepare_endpoint(distributed())
    assert endpoint.is_host and endpoint.host == "127.0.0.1" and endpoint.port > 0


def test_a_port_another_program_holds_is_refused(foreign_listener):
    with pytest.raises(ConfigError) as info:
        prepare_endpoint(distributed(master_port=foreign_listener))
    assert str(info.value) == (
        f"distributed.master_port: port {foreign_listener} on 127.0.0.1 is in use by another "
        f"program: choose another master_port or leave it unset for a free one")


def test_several_nodes_tell_a_foreign_service_from_another_nodes_store(foreign_listener):
    """With nnodes > 1 a held port may be another node's agent on this machine: it hosts."""
    import torch.distributed as dist

    begin = time.monotonic()
    with pytest.raises(ConfigError, match="is in use by another program: choose another "
                                          "rdzv_endpoint$"):
        prepare_endpoint(distributed(nnodes=2, rdzv_endpoint=f"127.0.0.1:{foreign_listener}"))
    assert time.monotonic() - begin < 30  # torch's own client waits forever here
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    endpoint = prepare_endpoint(distributed(nnodes=2, master_port=store.port))
    assert not endpoint.is_host and endpoint.port == store.port


def test_an_address_of_another_machine_is_refused_on_one_node():
    with pytest.raises(ConfigError, match=r"distributed.master_addr: 192.0.2.1 is not an address "
                                          r"of this machine, but with nnodes: 1"):
        prepare_endpoint(distributed(master_addr="192.0.2.1"))  # TEST-NET-1: never local


def test_a_host_that_never_listens_is_waited_for_at_most_timeout_s():
    endpoint = prepare_endpoint(distributed())  # a free port nobody listens on
    begin = time.monotonic()
    with pytest.raises(PipelineError, match=r"nothing listens on the rendezvous endpoint "
                                            r"127.0.0.1:\d+ after distributed.timeout_s = 1 s"):
        _wait_for_listener(endpoint, 1)
    assert time.monotonic() - begin < 10


@pytest.mark.cli
@pytest.mark.ranks
def test_run_refuses_a_port_in_use_instead_of_hanging(tmp_path, foreign_listener, capsys):
    """It used to stay at "starting 2 rank(s)" forever, talking to the foreign service. The
    command in this process (:func:`pp_core.app.cli.main`): refused before any rank starts, it
    needs no interpreter of its own."""
    from pp_core.app import cli

    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(TINY))
    begin = time.monotonic()
    code = cli.main(["run", str(path), "--set", f"distributed.master_port={foreign_listener}"])
    out, err = capsys.readouterr()
    assert code == 1 and time.monotonic() - begin < 60
    assert err.strip() == (f"pp-core: error: distributed.master_port: port {foreign_listener} on "
                           f"127.0.0.1 is in use by another program: choose another master_port "
                           f"or leave it unset for a free one")
    assert "starting" not in out


@pytest.mark.cli
@pytest.mark.ranks
def test_nodes_that_never_come_end_the_run_after_timeout_s(tmp_path):
    """c10d reads join_timeout, not timeout: it used to wait 600 s whatever timeout_s said."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    code, out, err = finish(start(tmp_path, "distributed.nnodes=2", "distributed.timeout_s=2",
                                  "distributed.rdzv_endpoint=127.0.0.1:" + str(_free_port()),
                                  env={"TMPDIR": str(temp)}), timeout=90)
    assert code == 1, err[-2000:]
    assert "did not complete within distributed.timeout_s = 2 s: expected 2 nodes" in err
    assert "Traceback" not in err
    # no torchelastic_* log dir or error file left behind (torch's compile cache may stay: it is
    # made on purpose, by the meta forward validate runs)
    left = [p.name for p in temp.iterdir() if p.name.startswith(("torchelastic_", "pytorch-"))]
    assert left == []


def _free_port() -> int:
    return prepare_endpoint(distributed()).port


@pytest.mark.cli
@pytest.mark.ranks
@pytest.mark.parametrize("sig, phase, code", [
    (signal.SIGINT, "rendezvous", 130),  # waiting for a node that does not come
    (signal.SIGTERM, "training", 143),  # was 130, as if it were Ctrl-C
])
def test_a_signal_ends_the_run_at_once_with_its_exit_code(tmp_path, sig, phase, code):
    if phase == "rendezvous":
        process = start(tmp_path, "distributed.nnodes=2", f"distributed.master_port={_free_port()}")
        assert process.stdout.readline().startswith("pp-core: starting 1 rank(s)")
        time.sleep(1)
    else:
        process = start(tmp_path, "train.steps=100000", "train.log_every=1",
                        "output.progress=plain")
        assert process.stdout.readline().startswith("pp-core: starting 2 rank(s)")
        line = process.stdout.readline()
        while line.startswith("pp-core: "):  # the phases announced before training
            line = process.stdout.readline()
        assert line.split()[:2] == ["step", "1/100000"]
    sent = time.monotonic()
    process.send_signal(sig)
    returncode, _, err = finish(process, timeout=30)
    assert time.monotonic() - sent < 10
    assert returncode == code, err[-2000:]
    assert f"pp-core: interrupted by {sig.name}; the ranks were stopped" in err


# ----------------------------------------------------------------------------- PP_CORE_TIMEOUT


@pytest.mark.parametrize("value", ["nan", "inf", "-5", "0", "ten"])
def test_a_bad_pp_core_timeout_is_refused_before_any_rank_starts(monkeypatch, value):
    monkeypatch.setenv("PP_CORE_TIMEOUT", value)
    spec = parse_spec(TINY, "t.yaml")
    with pytest.raises(ConfigError) as info:
        launch(spec)
    assert str(info.value) == (f"PP_CORE_TIMEOUT={value!r} must be a positive, finite number of "
                               f"seconds (e.g. 600), or unset")


# ----------------------------------------------------------------------------- a stuck rank


class Stuck(GPT):
    """Rank 1 stops answering in its second forward (as if stopped, or deadlocked)."""

    calls = 0

    def forward(self, x):
        Stuck.calls += 1
        if os.environ.get("RANK") == "1" and Stuck.calls == 2:
            time.sleep(600)
        return super().forward(x)


@pytest.mark.ranks
def test_a_stuck_rank_is_reported_with_the_seconds_waited_and_the_key():
    spec = parse_spec({**TINY, "model": {"target": f"{__name__}:Stuck",
                                         "args": TINY["model"]["args"]},
                       "distributed": {**TINY["distributed"], "timeout_s": 3}}, "stuck.yaml")
    with pytest.raises(PipelineError) as info:
        warm_launch(spec)  # its ranks forked from the fork server, not spawned cold
    message = str(info.value)
    assert "rank 0 waited longer than 3 s for rank 1, which is stuck or much slower; if it is " \
           "just slow, raise distributed.timeout_s" in message, message
    assert "Traceback" not in message  # pp-core's own error says all


def test_validate_refuses_a_one_node_host_this_machine_cannot_resolve(tmp_path, capsys):
    from pp_core.app import cli

    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(TINY))
    assert cli.main(["validate", str(path), "--set",
                     "distributed.master_addr=no-such-host.invalid"]) == 1
    assert "distributed.master_addr: cannot resolve 'no-such-host.invalid'" in \
        capsys.readouterr().err

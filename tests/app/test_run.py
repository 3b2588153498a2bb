"""``pp-core run`` end to end, as a user runs it: the README's demo (loss falls, summary prints),
a rank that fails ends the run with its error instead of hanging, two "nodes" meeting through
torchrun's c10d rendezvous on loopback, and a model from a pip-installed third-party plugin."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pp_core_builtins.models import GPT
from tests.cases.specs import TINY, free_port, pp_core, write_spec

ROOT = Path(__file__).resolve().parents[2]
@pytest.mark.cli
@pytest.mark.ranks
def test_the_readme_demo_trains_and_prints_a_summary(tmp_path):
    """What CI runs: the README's main command with a small step count."""
    out = tmp_path / "demo"
    result = pp_core("run", "examples/demo.yaml", "--set", "train.steps=16",
                     "--set", "train.log_every=4", "--set", "train.eval_every=16",
                     "--set", f"checkpoint.dir={out / 'checkpoints'}",
                     "--set", f"output.metrics={out / 'metrics.jsonl'}",
                     "--set", f"output.trace={out / 'trace.json'}",
                     "--set", f"output.schedule_image={out / 'schedule.svg'}",
                     env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})  # cpu on a GPU machine too
    assert result.returncode == 0, result.stderr[-3000:]
    text = result.stdout
    assert "starting 2 rank(s) on this machine (pp 2 x dp 1) on cpu (auto: no GPU)" in text
    assert "pp-core run summary: examples/demo.yaml" in text
    assert "schedule v_schedule, pp 2 x dp 1, 4 stages" in text
    assert "bubble (measured)" in text and "bubble (simulated)" in text
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [line["loss"] for line in lines if "loss" in line]
    assert {"step", "loss", "tokens_per_s", "step_time_s"} <= set(lines[0])
    assert losses[-1] < losses[0] - 1.0, losses  # ln(256) = 5.5 -> visibly lower in 16 steps
    assert any("eval_loss" in line for line in lines)
    trace = json.loads((out / "trace.json").read_text())["traceEvents"]
    names = {event["name"] for event in trace if event["ph"] == "X"}
    assert {"0F0", "3I0", "1W0"} <= names and {e["pid"] for e in trace} == {0, 1}
    picture = (out / "schedule.svg").read_text()  # the run measured, above it simulated
    assert picture.startswith("<svg") and "measured, step " in picture and "simulated (" in picture
    assert picture.count("% measured</text>") == picture.count("% simulated</text>") == 2
    assert (out / "checkpoints" / "step_00000016" / ".metadata").is_file()


class Exploding(GPT):
    """Rank 1 raises (``PP_TEST_FAILURE=raise``) or dies without a word (``=exit``)."""

    def forward(self, x):
        if os.environ.get("RANK") == "1":
            if os.environ.get("PP_TEST_FAILURE") == "raise":
                raise RuntimeError("boom from rank 1")
            if os.environ.get("PP_TEST_FAILURE") == "exit":
                os._exit(3)
        return super().forward(x)


@pytest.mark.cli
@pytest.mark.ranks
@pytest.mark.parametrize("mode, expected", [
    ("raise", "RuntimeError: boom from rank 1"),
    ("exit", "rank 1 failed: the process exited with code 3"),
])
def test_a_failing_rank_ends_the_run_with_its_error(tmp_path, monkeypatch, capsys, mode,
                                                    expected):
    """The command in this process (:func:`pp_core.app.cli.main`, its ranks forked warm, the
    variables below adopted by them): what is checked is how the launcher ends, which the
    README's demo and the runs beside it check end to end."""
    import tempfile

    from pp_core.app import cli

    model = {"target": f"{__name__}:Exploding", "args": TINY["model"]["args"]}
    spec = write_spec(tmp_path / "fail.yaml", TINY, model=model)
    temp = tmp_path / "tmp"
    temp.mkdir()
    for key, value in {"PP_CORE_TIMEOUT": "60", "PP_TEST_FAILURE": mode,
                       "TMPDIR": str(temp)}.items():
        monkeypatch.setenv(key, value)  # a hang fails at PP_CORE_TIMEOUT
    monkeypatch.setattr(tempfile, "tempdir", str(temp))  # read once, then kept
    capsys.readouterr()
    assert cli.main(["run", str(spec)]) == 1
    stderr = capsys.readouterr().err
    assert stderr.startswith("pp-core: error: rank "), stderr[-2000:]
    assert expected in stderr, stderr[-2000:]
    # torch's launcher leaves a torchelastic_* log dir per run and an error file per failed rank
    left = [p.name for p in temp.iterdir() if p.name.startswith(("torchelastic_", "pytorch-"))]
    assert left == []


@pytest.mark.cli
@pytest.mark.ranks
def test_two_nodes_meet_through_torchrun_rendezvous_on_loopback(tmp_path):
    """Node A is ``pp-core run`` (torch's elastic launcher API), node B is ``torchrun`` whose
    processes each run ``pp-core run`` as one rank; 2 x 2 ranks form one pp=2 x dp=2 job."""
    spec = write_spec(tmp_path / "two_nodes.yaml", TINY,
                      distributed={"pp_size": 2, "dp_size": 2, "device": "cpu"},
                      output={"progress": "plain", "metrics": str(tmp_path / "m.jsonl")})
    endpoint = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
    sets = ["--set", "distributed.nnodes=2", "--set", f"distributed.rdzv_endpoint={endpoint}",
            "--set", "distributed.rdzv_id=two-nodes"]
    node_a = subprocess.Popen([sys.executable, "-m", "pp_core", "run", str(spec), *sets],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    node_b = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
         "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "two-nodes",
         "-m", "pp_core", "run", str(spec), *sets],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out_a, err_a = node_a.communicate(timeout=240)
        out_b, err_b = node_b.communicate(timeout=240)
    finally:
        for node in (node_a, node_b):
            if node.poll() is None:
                node.kill()
    assert node_a.returncode == 0, err_a[-3000:]
    assert node_b.returncode == 0, err_b[-3000:]
    summary = out_a + out_b
    assert summary.count("pp-core run summary") == 1  # printed by global rank 0 only
    assert "pp 2 x dp 2" in summary
    table = summary[summary.index("rank  stages"):]
    assert all(f"\n  {rank}     " in table for rank in range(4)), table
    steps = [json.loads(line)["step"] for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]


@pytest.fixture(scope="module")
def example_plugin_installed():
    """pip-install the third-party example package, as a user would (no network needed)."""
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                    "--no-build-isolation", "--disable-pip-version-check",
                    str(ROOT / "examples" / "pp_example_plugin")],
                   check=True, capture_output=True, text=True)


@pytest.mark.cli
@pytest.mark.ranks
def test_plugins_in_a_real_run_a_third_party_model_and_metrics_hooks(example_plugin_installed,
                                                                      tmp_path):
    """One ``pp-core run`` for three entry-point plugins (was two runs: the model, then the
    hooks on the tiny GPT). A pipeline names a model and a dataset from a pip-installed
    third-party package; of two ``pp_report_metrics`` plugins, one gets the loss of every step
    (the values of output.metrics, on the first rank only) and one that raises is logged once,
    the run goes on."""
    from tests.cases.plugin_packages import make_dist

    site = tmp_path / "site"
    site.mkdir()
    make_dist(site, "pp-metrics-probe", {"pp_metrics_probe": PROBE, "pp_metrics_broken": BROKEN},
              {"pp_metrics_probe": "pp_metrics_probe", "pp_metrics_broken": "pp_metrics_broken"})
    received, metrics = tmp_path / "received.jsonl", tmp_path / "metrics.jsonl"
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    result = pp_core("run", "examples/plugin_model.yaml", "--set", "train.steps=4",
                     "--set", "distributed.device=cpu", "--set", "output.progress=plain",
                     "--set", "train.log_every=1", "--set", "train.eval_every=2",
                     "--set", "train.eval_steps=1", "--set", f"output.metrics={metrics}",
                     env={**os.environ, "PYTHONPATH": path, "PP_TEST_METRICS": str(received)})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "example_mlp" in result.stdout and "on example_regression" in result.stdout
    assert "step 4/4" in result.stdout
    got = [json.loads(line) for line in received.read_text().splitlines()]
    written = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in got if "loss" in r] == [1, 2, 3, 4]
    assert [r["step"] for r in got if "eval_loss" in r] == [2, 4]
    assert {r["rank"] for r in got} == {"0"}
    assert [{k: v for k, v in r.items() if k != "rank"} for r in got] == written
    assert result.stderr.count("raised in pp_report_metrics") == 1, result.stderr[-3000:]
    assert "plugin 'pp_metrics_broken' raised in pp_report_metrics at step 1: ConnectionError: " \
           "dashboard unreachable" in result.stderr


def _listening_addresses(port: int) -> set[str]:
    """Local addresses (hex, as in /proc/net/tcp*) of sockets listening on ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            local, state = row.split()[1], row.split()[3]
            address, _, hexport = local.partition(":")
            if state == "0A" and int(hexport, 16) == port:  # 0A = LISTEN
                found.add(address)
    return found


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux /proc/net/tcp")
def test_launcher_stores_listen_on_loopback_only():
    """torch's TCPStore server binds every interface; inside the launcher it binds 127.0.0.1."""
    import torch.distributed as dist

    from pp_core._torch_compat import tcp_stores_listening_on_their_host
    from pp_core.app.launch import is_loopback

    with tcp_stores_listening_on_their_host(is_loopback):
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        assert _listening_addresses(store.port) == {"0100007F"}  # 127.0.0.1
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False)
        client.set("key", "value")
        assert store.get("key") == b"value"
        with pytest.raises(RuntimeError, match=r"cannot listen on 127.0.0.1"):
            dist.TCPStore("127.0.0.1", store.port, is_master=True, wait_for_workers=False)
    plain = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    assert _listening_addresses(plain.port) != {"0100007F"}  # what torch does on its own


PROBE = '''
import json, os
from pp_core import hookimpl

@hookimpl
def pp_report_metrics(step, metrics):
    with open(os.environ["PP_TEST_METRICS"], "a") as fh:
        fh.write(json.dumps({"step": step, "rank": os.environ.get("RANK"), **metrics}) + "\\n")
'''
BROKEN = '''
from pp_core import hookimpl

@hookimpl
def pp_report_metrics(step, metrics):
    raise ConnectionError("dashboard unreachable")
'''

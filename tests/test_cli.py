"""The command line: `keras-distrib test`'s table, `env` tells what a bug report needs.

`keras-distrib test` and the demo on a machine without the optional
components run in tests/test_users_machine.py.
"""

import os
import re
import sys
import types

import pytest

from keras_distrib.cluster import network
from keras_distrib.commands import cli
from keras_distrib.commands import environment
from keras_distrib.commands import selftest
from tests import _harness

@pytest.mark.cluster
def test_the_gpu_check_runs_its_logic_on_cpu_devices():
    # No GPU here: the same checks on 2 logical CPU devices, NCCL's row
    # replaced by RING collectives and saying so.
    code, output = _harness.run_script("gpu_check.py", timeout=240)
    assert code == 0, output[-4000:]
    rows = _harness.check_rows(output)
    assert sorted(rows) == sorted([
        "devices", "all-reduce, 2 replicas (RING, NCCL's stand-in on CPU)",
        "training: float32, RING vs one device", "training: mixed_float16 vs one device",
        "training: jit_compile=True vs one device"]), output
    assert all(" PASS " in row for row in rows.values()), output
    assert "no GPU: the GPU path's logic on 2 logical CPU devices" in rows["devices"]
    assert "NCCL all-reduces GPU memory only" in rows["all-reduce, 2 replicas (RING, NCCL's stand-in on CPU)"]
    assert "(tolerance 0.005)" in rows["training: mixed_float16 vs one device"]
    assert "All 5 checks passed" in output
    assert _harness.results_of(output)[0]["seconds"] < 300


def test_the_gpu_check_without_a_gpu_says_so(capsys):
    assert cli.main(["test", "--gpu"]) == selftest.NO_GPU
    output = capsys.readouterr().out
    assert "keras-distrib test --gpu: TensorFlow finds no GPU here" in output
    assert "or `keras-distrib test` for the CPU checks" in output


def test_a_skipped_row_is_neither_passed_nor_failed(capsys):
    checks = [selftest.Check("devices", True, "1 GPU", 0.1),
              selftest.Check("all-reduce, 2 GPU replicas (NCCL)", True, "NCCL refused 2 logical GPUs", 0.2,
                             skipped=True),
              selftest.Check("training: float32, RING vs one GPU", False, "weights differ", 1.0)]
    selftest.print_table(checks, 3.0)
    output = capsys.readouterr().out
    assert re.search(r"^all-reduce, 2 GPU replicas \(NCCL\)\s+SKIP\s+0.2 s\s+NCCL refused", output, re.M)
    assert "1 of 2 checks FAILED (1 skipped)" in output
    selftest.print_table(checks[:2], 1.0)
    assert "All 1 checks passed (1 skipped)" in capsys.readouterr().out


def test_self_test_failure_gives_a_failing_row_and_exit_code(monkeypatch, capsys):
    monkeypatch.setattr(selftest, "local_checks", lambda: [selftest.Check("devices", True, "CPU", 0.1)])
    monkeypatch.setattr(selftest, "launched_checks", lambda **options: [
        selftest.Check("start 2 worker processes", False, "timed out: no answer", 120.0)])
    assert cli.main(["test"]) == 1
    output = capsys.readouterr().out
    assert re.search(r"^start 2 worker processes\s+FAIL\s+120.0 s\s+timed out: no answer$", output, re.M), output
    assert "1 of 2 checks FAILED" in output


def test_env_names_versions_devices_cluster_and_auto(monkeypatch, capsys):
    monkeypatch.setenv("TF_CONFIG", '{"cluster": {"worker": ["localhost:1", "localhost:2"]}, '
                                    '"task": {"type": "worker", "index": 1}}')
    assert cli.main(["env"]) == 0
    output = capsys.readouterr().out
    facts = dict(line.split(None, 1) for line in output.splitlines() if line.strip())
    for name in ("keras_distrib", "python", "keras", "tensorflow", "numpy", "devices", "cluster"):
        assert name in facts, (name, output)
    assert facts["cluster"].startswith("TF_CONFIG: 2 worker; this process is worker 1"), output
    assert facts["make_strategy('auto')"] == "multi_worker"
    monkeypatch.delenv("TF_CONFIG")
    rows = dict(environment.facts())
    assert rows["cluster"] == "none (no TF_CONFIG, Slurm step, Kubernetes Job or TPU): a single process"


@pytest.mark.parametrize("argv", [
    ["launch", "--verbose", "--workers", "2", "train.py"],
    ["demo", "--quick", "--verbose"],
    ["demo", "--network", "offline"],
    ["test", "--workers", "3", "--timeout", "30", "--verbose"],
    ["test", "--network", "open"],
    ["launch", "--network", "auto", "--workers", "2", "train.py"],
    ["test", "--gpu"],
    ["env"],
])
def test_commands_parse(argv):
    options = cli.build_parser().parse_args(argv)
    assert options.command == argv[0]


def test_the_checkpoint_check_sees_a_left_scratch_directory(tmp_path):
    # What a worker that is not the chief writes goes to scratch directories
    # of its own (files.make_scratch); one left behind fails the check.
    import tensorflow as tf

    from keras_distrib import files

    strategy = tf.distribute.get_strategy()
    for epoch in range(1, selftest.EPOCHS + 1):
        (tmp_path / f"model-{epoch}.keras").write_bytes(b"")
    before = set(os.listdir(files.tempfile.gettempdir()))
    assert selftest._checkpoints(strategy, str(tmp_path), before).endswith("wrote " + ", ".join(
        f"model-{epoch}.keras" for epoch in range(1, selftest.EPOCHS + 1)))
    left = files.make_scratch("worker1")
    try:
        with pytest.raises(selftest._Failed, match="left temporary directories: .*worker1"):
            selftest._checkpoints(strategy, str(tmp_path), before)
    finally:
        files.remove_scratch(left)


def _no_route_out(c):
    _harness.hide_routes_out(c.monkeypatch)


def _no_namespaces(c):
    c.monkeypatch.setattr(network, "PrivateNetwork", _harness.NoNamespaceHere)


def _bad_tf_config(c):
    c.monkeypatch.setenv("TF_CONFIG", '{"cluster": ')


def _no_keras(c):
    c.monkeypatch.setitem(sys.modules, "keras", None)  # `import keras` raises ModuleNotFoundError


def _untested_keras(c):
    import keras

    # kd's compat layer checks the versions as it is imported.
    c.monkeypatch.setattr(keras, "__version__", "3.0.0")
    c.monkeypatch.delitem(sys.modules, "keras_distrib._keras_compat")


# (argv, what is wrong on this machine, the last line of stderr). {tmp}: an
# empty folder; {file}: a file in it; {script}: a script in it.
BAD_INVOCATIONS = [
    ([], None, r"^keras-distrib: error: the following arguments are required: command$"),
    (["lanch"], None, r"^keras-distrib: error: argument command: invalid choice: 'lanch'"),
    (["launch", "--workers", "x", "{script}"], None, r"argument --workers: invalid int value: 'x'$"),
    (["launch", "--workers", "0", "--timeout", "-1", "{script}"], None,
     r"^keras-distrib launch: Invalid launch request: `workers`=0: expected a whole number >= 1; "
     r"`timeout`=-1.0: expected a finite number of seconds > 0, or None for no limit\.$"),
    (["launch", "--workers", "2", "{tmp}/missing.py"], None,
     r"^keras-distrib launch: `target`='.*/missing.py' is not a file\. Pass the path of a Python script"),
    (["launch", "--workers", "2", "--per-node", "2", "{script}"], None,
     r"^keras-distrib launch: `--per-node` is for the per-node agent .*; on one machine give `--workers N`\.$"),
    (["launch", "--workers", "2", "--network", "private", "{script}"], _no_route_out,
     r"^keras-distrib launch: `private_network`: .*kd-no-such-slirp4netns or kd-no-such-pasta, "
     r"neither of which is installed here: install one \(Debian/Ubuntu: `apt-get install "
     r"slirp4netns`, or `apt-get install passt` for pasta;.*`--network offline`.*`--network open`"),
    (["launch", "--workers", "2", "{script}"], _no_namespaces,
     r"^keras-distrib launch: `private_network`: .* this machine makes no network namespace \(EPERM\): "
     r"run as root, or allow unprivileged user namespaces .*`--network open`"),
    (["tf-config"], _bad_tf_config, r"^keras-distrib tf-config: `TF_CONFIG` is not valid JSON"),
    (["demo", "--out", "{file}"], None,
     r"^keras-distrib demo: `--out`='.*/file' exists and is not a directory: give the path of a directory\.$"),
    (["demo", "--network", "wide"], None, r"argument --network: invalid choice: 'wide'"),
    (["demo"], _no_keras,
     r"^keras-distrib demo: keras is not installed in this Python \(.*\), and the command needs it: "
     r"reinstall keras_distrib"),
    (["env"], _untested_keras,
     r"^keras-distrib env: keras_distrib is tested with Keras .* and found Keras 3\.0\.0\. Install the "
     r"tested versions"),
    (["test", "--workers", "0", "--timeout", "nan"], None,
     r"^keras-distrib test: `--workers`=0: expected a whole number >= 1; `--timeout`=nan: expected a "
     r"finite number of seconds > 0\.$"),
    (["test"], _bad_tf_config, r"^keras-distrib test: `TF_CONFIG` is not valid JSON"),
    (["bench", "--json", "{tmp}/missing/bench.json"], None,
     r"^keras-distrib bench: error: `--json`='.*/missing/bench.json': its folder '.*/missing' does not "
     r"exist: create it, or give another path$"),
    (["bench", "--network", "--json", "{tmp}"], None,
     r"^keras-distrib bench --network: error: `--json`='.*' exists and is not a file"),
    (["bench", "--first-step", "--json", "{file}/x.json"], None,
     r"^keras-distrib bench --first-step: error: `--json`='.*/file/x.json': its folder '.*/file' does "
     r"not exist"),
]


@pytest.mark.parametrize("argv, machine, said", [
    pytest.param(*row, id=" ".join(row[0]) + (f" ({row[1].__name__[1:]})" if row[1] else ""))
    for row in BAD_INVOCATIONS])
def test_a_bad_invocation_or_a_missing_component_ends_in_one_sentence_and_exit_code_2(
        argv, machine, said, tmp_path, monkeypatch, capsys):
    """No traceback (an exception out of `cli.main` fails here), nothing written, one line."""
    monkeypatch.delenv("TF_CONFIG", raising=False)
    (tmp_path / "file").write_text("kept")
    (tmp_path / "train.py").write_text("print('trained')\n")
    if machine is not None:
        machine(types.SimpleNamespace(monkeypatch=monkeypatch))
    argv = [a.format(tmp=tmp_path, file=tmp_path / "file", script=tmp_path / "train.py") for a in argv]
    try:
        code = cli.main(argv)
    except SystemExit as stop:  # argparse's usage error
        code = stop.code
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert code == 2, (code, captured)
    assert re.search(said, lines[-1]), lines
    if ": error: " not in lines[-1]:  # kd's own: that one line, nothing else
        assert len(lines) == 1 and not captured.out.strip(), captured
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "train.py"]
    assert (tmp_path / "file").read_text() == "kept"


def test_bench_without_a_private_network_skips_its_launch_timing_naming_no_option(monkeypatch):
    """`keras-distrib bench` has no `--network open` (its `--network` is another benchmark): where
    no namespace can be made its 2-worker launch timing is not run, saying why, with no advice."""
    from keras_distrib.commands import bench

    monkeypatch.setattr(network, "PrivateNetwork", _harness.NoNamespaceHere)
    assert bench._launch_to_first_step(1) == ([], "this machine makes no network namespace (EPERM)")


def test_demo_and_test_asked_for_a_route_out_they_cannot_have_name_the_command_that_runs_them(
        monkeypatch, tmp_path):
    """`--network private` without slirp4netns or pasta: the worker rows say why, and the offline
    command."""
    from keras_distrib.commands import demo

    _harness.hide_routes_out(monkeypatch)
    code, said, _ = demo._run_stage("kd_workers", str(tmp_path), 1, 10, False, dict(os.environ),
                                    "private")
    assert (code, said) == (None, "not run: neither kd-no-such-slirp4netns nor kd-no-such-pasta is "
                            "installed here; `keras-distrib demo --network offline` runs them in a "
                            "private network without a route out")
    (row,) = selftest.launched_checks(network="private")
    assert (row.name, row.ok, row.skipped) == ("start 2 worker processes", True, True)
    assert row.detail == ("not run: neither kd-no-such-slirp4netns nor kd-no-such-pasta is installed "
                          "here; `keras-distrib test --network offline` runs them in a private "
                          "network without a route out")
    for command, text in (("demo", said), ("test", row.detail)):
        (advised,) = re.findall(r"`(keras-distrib [^`]*)`", text)
        assert cli.build_parser().parse_args(advised.split()[1:]).command == command
    assert list(tmp_path.iterdir()) == []


def test_the_demos_local_stages_share_a_process_and_one_it_did_not_reach_fails_with_its_last_line(
        tmp_path, monkeypatch):
    # The local stages run in one process, each row printed as its stage ends;
    # a process that dies after the first leaves the others failed, not lost.
    from keras_distrib.commands import demo

    (tmp_path / "one_device.npz").write_bytes(b"")
    started = []

    class Dies:
        def __init__(self, argv, **kwargs):
            started.append(argv)
            self.stdout = iter(["loading\n", "kd-demo: said by the first\n", f"{demo._DONE}one_device\n",
                                "Segmentation fault (core dumped)\n"])
            self.returncode = -11

        def poll(self):
            return self.returncode

        def kill(self):
            raise AssertionError("an ended process is not killed")

        def wait(self):
            return self.returncode

    monkeypatch.setattr(demo.subprocess, "Popen", Dies)
    ended = list(demo._local_stages(["one_device", "kd_mirrored", "kd_loop"], str(tmp_path), 1, 10,
                                    False, {}))
    assert len(started) == 1 and started[0][-2:] == ["--stage", "one_device,kd_mirrored,kd_loop"]
    assert ended == [
        ("one_device", 0, "loading\nkd-demo: said by the first\n", ["said by the first"]),
        ("kd_mirrored", -11, "Segmentation fault (core dumped)\n", []),
        ("kd_loop", -11, "", []),
    ]
    assert demo._failure(str(tmp_path), "kd_mirrored", ended[1][2]) == "Segmentation fault (core dumped)"

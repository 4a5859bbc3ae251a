"""The command line: `keras-distrib test`'s table, `env` tells what a bug report needs.

`keras-distrib test` and the demo on a machine without the optional
components run in tests/test_users_machine.py.
"""

import os
import re

import pytest

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
    rows = {line.split("  ")[0]: line for line in output.splitlines() if re.search(r"\s(PASS|FAIL|SKIP)\s", line)}
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

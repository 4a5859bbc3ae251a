"""The README's first command and `keras-distrib test` on a user's machine, not only on CI's.

CI installs slirp4netns, pasta, Chromium and Slurm (`.ci/run`); a user's machine may
have none of them, nor a way to make network namespaces (a container whose
seccomp profile refuses unshare, a kernel without unprivileged user
namespaces). tests/scripts/users_machine.py hides those components for real
in a mount namespace of its own (kd looks in the system directories too, so
PATH alone would not do), and, for the second situation, makes network
namespaces unavailable for real (the kernel's per-user-namespace limits set
to 0). Each situation is one process run: `keras-distrib launch`, `keras-distrib
demo --quick` (the README's first command, fewer epochs) and `keras-distrib
test`. Both must finish with exit code 0, every kd row that ran matching one
device, and no traceback; what could not run says why and names a command that
runs it. On the bare machine the demo runs as a user without root, installed
by that user: tests/test_reliability.py's unprivileged user hides the same
components and checks it with `check_bare_demo`.

The demo's numbers are checked against plain Keras on one device retrained
here, not against the demo's own reference row.
"""

import functools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import numpy as np
import pytest

from keras_distrib.commands import cli
from keras_distrib.commands import demo
from tests import _harness

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.long,
    pytest.mark.xdist_group("users_machine"),  # one worker runs each situation once
    pytest.mark.skipif(os.getuid() != 0 or not shutil.which("unshare"),
                       reason="needs root (it hides components in mount namespaces) and `unshare`: run the "
                              "tests as root, with util-linux installed (`apt-get install util-linux`)"),
]

SCRIPT = os.path.join(_harness.SCRIPTS, "users_machine.py")
# Plain Keras's own noise, and Python's: none reaches a user of these commands.
NOISE = ("I0000", "E0000", "W0000", "oneDNN", "cuInit", "absl::InitializeLog", "Traceback")


def _situation(out, *, no_namespaces, demo):
    env = _harness._env()
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)  # the commands' own default: TensorFlow's notices hidden
    argv = ["unshare", "--mount", "--propagation", "private"]
    if no_namespaces:
        argv += ["--user", "--map-root-user"]
    probe = subprocess.run([*argv, "true"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:  # a container without CAP_SYS_ADMIN, say
        pytest.skip(f"`{' '.join(argv)}` is refused here ({probe.stderr.strip()}): a container needs "
                    "CAP_SYS_ADMIN (`docker run --cap-add SYS_ADMIN`)"
                    + (", and `sysctl user.max_user_namespaces` above 0" if no_namespaces else ""))
    process = subprocess.Popen([*argv, sys.executable, "-u", SCRIPT, str(out)]
                               + (["--no-namespaces"] if no_namespaces else [])
                               + ([] if demo else ["--no-demo"]),
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    try:
        output, _ = process.communicate(timeout=900)
    finally:
        _harness.kill_groups([process])
    results = _harness.results_of(output)
    assert process.returncode == 0 and len(results) == 1, output[-4000:]
    report = results[0]
    # The components are really absent: found nowhere kd or a user would look.
    assert report["left"] == [], report["left"]
    assert report["namespaces"] is not no_namespaces, report
    return report


@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    """Root on a machine without slirp4netns, pasta, Chromium or Slurm (its demo: `check_bare_demo`)."""
    out = tmp_path_factory.mktemp("bare")
    return out, _situation(out, no_namespaces=False, demo=False)


@pytest.fixture(scope="module")
def no_namespaces(tmp_path_factory):
    """The same, where no network namespace can be made."""
    out = tmp_path_factory.mktemp("no_namespaces")
    return out, _situation(out, no_namespaces=True, demo=True)


@functools.lru_cache  # the same in every test of this process that checks a demo
def _one_device_reference(epochs, rows):
    import keras

    x, y = demo.make_data(rows)
    model = demo.build(keras.Model)
    model.fit(x, y, batch_size=demo.GLOBAL_BATCH, epochs=epochs, shuffle=False, verbose=0)
    return model.get_weights()


def _check_demo_runs(out, runs):
    reference = _one_device_reference(epochs=2, rows=449)
    for run in runs:
        weights, _, _ = demo._load(str(out), run)
        gap = max(float(np.max(np.abs(a - b))) for a, b in zip(weights, reference))
        assert gap <= 1e-5, (run, gap)


def _commands_it_names(output, command):
    """The `keras-distrib ...` commands `output` advises (a wrapped one joined back); each must
    parse as `command` takes it."""
    named = [" ".join(found.split()) for found in re.findall(r"`(keras-distrib [^`]*)`", output)]
    for line in named:
        argv = shlex.split(line)[1:]
        assert argv[0] == command, line
        cli.build_parser().parse_args(argv)  # an option the command lacks exits 2 here
    return named


def _clean_output(report, command):
    """`command`'s output, after checking it succeeded and printed none of `NOISE` (start-up logs, a
    traceback)."""
    result = report[command]
    assert result["code"] == 0, result["output"][-4000:]
    return _without_noise(result["output"])


def _without_noise(output):
    for noise in NOISE:
        assert noise not in output, (noise, output)
    return output


def check_bare_demo(out, output):
    """`keras-distrib demo --quick --out OUT` on a machine without slirp4netns, pasta, Chromium or
    Slurm, where network namespaces can be made: its files in `out` and its `output` (exit code 0)."""
    _without_noise(output)
    table = {row["run"]: row for row in json.loads((out / "demo_table.json").read_text())}
    _check_demo_runs(out, ("one_device", "kd_mirrored", "kd_workers", "kd_loop"))
    for run in ("kd_mirrored", "kd_workers", "kd_loop"):
        assert table[run]["max_weight_diff"] <= 1e-5, table[run]
        assert abs(table[run]["loss"] - table["one_device"]["loss"]) <= 1e-5
    # The contrast: plain Keras is measurably off on the 1-row last batch...
    assert table["plain_mirrored"]["max_weight_diff"] > 1e-4, table["plain_mirrored"]
    # ...and does not run on 2 workers at all: its error in one line.
    assert table["plain_workers"]["failed"].startswith("ValueError: "), table["plain_workers"]
    assert "PerReplica" in table["plain_workers"]["failed"]
    # Only the chief's files persist.
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["model-01.keras", "model-02.keras"]
    events = [f for _, _, files in os.walk(out / "tensorboard") for f in files]
    assert len(events) == 1 and events[0].startswith("events.out.tfevents")
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["checkpoints", "tensorboard"]
    # The network the workers got, in one line: the most private this machine allows.
    assert re.search(r"^  network: private, without a route out \(neither slirp4netns nor pasta is "
                     r"installed here\)", output, re.M), output
    # A person can read it: one screen (no TensorFlow start-up logs, no traceback: `_without_noise`).
    assert len(output.splitlines()) <= 40, output
    assert "[worker 0] chief: wrote 2 checkpoints" in output
    assert "[worker 1] not the chief" in output
    assert "  ValueError: Attempt to convert a value (PerReplica:{…})" in output


def test_a_launch_on_a_bare_machine_is_private_without_a_route_out_and_says_so(bare):
    _, report = bare
    result = report["launch"]
    lines = result["output"].splitlines()
    assert result["code"] == 0, lines
    assert lines[0] == ("[launcher] network: private, without a route out (neither slirp4netns nor "
                        "pasta is installed here): the tasks reach each other and nothing else; "
                        "slirp4netns or pasta would give them one"), lines
    assert sorted(line for line in lines if "hello" in line) == [
        "[worker 0] hello from worker 0", "[worker 1] hello from worker 1"], lines


def test_a_launch_without_namespaces_is_refused_in_one_sentence_naming_the_ways_out(no_namespaces):
    _, report = no_namespaces
    result = report["launch"]
    assert result["code"] == 2, result
    (line,) = result["output"].splitlines()
    assert re.fullmatch(r"keras-distrib launch: `private_network`: kd keeps a local launch's tasks in "
                        r"a network namespace of their own \(TensorFlow's servers have no "
                        r"authentication\), and this machine makes no network namespace \(.*No space "
                        r"left on device\): run as root, or allow unprivileged user namespaces .*; or "
                        r"launch with `private_network=False` \(`--network open`\), which opens the "
                        r"tasks' ports to this host's network \(firewall them\)\.", line), line


def test_keras_distrib_test_passes_on_a_bare_machine(bare):
    _, report = bare
    output = _clean_output(report, "test")
    rows = _harness.check_rows(output)
    assert sorted(rows) == sorted([
        "devices", "all-reduce, 2 replicas (mirrored)", "training: mirrored vs one device",
        "start 2 worker processes", "all-reduce, 2 worker processes",
        "training: 2 workers vs one device", "data sharding, 2 workers x 1 replica",
        "chief-only checkpoint write"]), output
    assert all(" PASS " in row for row in rows.values()), output
    assert rows["start 2 worker processes"].endswith("in a private network without a route out"), output
    assert "All 8 checks passed" in output
    assert rows["chief-only checkpoint write"].endswith(
        "worker 0 (chief) wrote model-1.keras, model-2.keras; worker 1 kept no file"), output


def test_the_demo_without_namespaces_runs_every_stage_it_can_and_says_why_not_the_others(no_namespaces):
    out, report = no_namespaces
    output = _clean_output(report, "demo")
    out = out / "demo"
    table = {row["run"]: row for row in json.loads((out / "demo_table.json").read_text())}
    _check_demo_runs(out, ("one_device", "kd_mirrored", "kd_loop"))
    assert table["plain_mirrored"]["max_weight_diff"] > 1e-4, table["plain_mirrored"]
    # The worker stages: not run, why, and the one command that runs them.
    assert set(table["kd_workers"]) == {"run", "not_run"}, table["kd_workers"]
    assert re.search(r"^kd, 2 worker processes \(launcher\)\s+not run\s", output, re.M), output
    assert re.search(r"^  this machine makes no network namespace \(.*unshare: No space left on "
                     r"device\); `keras-distrib demo --network open` runs them on this host's "
                     r"network", output, re.M), output
    assert _commands_it_names(output, "demo") == ["keras-distrib demo --network open"]
    assert set(table["plain_workers"]) == {"run", "not_run"}, table["plain_workers"]
    assert not (out / "checkpoints").exists()
    assert "the 2-worker stages did not run here (see above)" in output


def test_keras_distrib_test_without_namespaces_skips_the_workers_saying_why(no_namespaces):
    _, report = no_namespaces
    output = _clean_output(report, "test")
    rows = _harness.check_rows(output)
    assert sorted(rows) == sorted(["devices", "all-reduce, 2 replicas (mirrored)",
                                   "training: mirrored vs one device", "start 2 worker processes"])
    assert re.search(r"^start 2 worker processes\s+SKIP\s+\S+ s\s+not run: this machine makes no "
                     r"network namespace \(.*\); `keras-distrib test --network open` runs them",
                     rows["start 2 worker processes"]), output
    assert _commands_it_names(output, "test") == ["keras-distrib test --network open"]
    assert "All 3 checks passed (1 skipped)" in output

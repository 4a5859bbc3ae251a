"""tools/suite_cpu.py's tables, from lines written as its plugin writes them."""

import json
import os
import runpy
import subprocess
import sys

import pytest

from tests import _project

TOOL = runpy.run_path(os.path.join(_project.REPO, "tools", "suite_cpu.py"))


def test_the_tables_add_up_each_tests_cpu_and_the_cores_idle_time(tmp_path):
    tests = [
        {"test": "tests/test_a.py::test_one", "cpu": 30.0, "wall": 40.0, "began": 1000.0, "worker": "gw0"},
        {"test": "tests/test_a.py::test_two", "cpu": 5.0, "wall": 10.0, "began": 1040.0, "worker": "gw0"},
        {"test": "tests/test_b.py::test_three", "cpu": 20.0, "wall": 20.0, "began": 1000.0, "worker": "gw1"},
    ]
    (tmp_path / "gw0.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tests[:2]))
    (tmp_path / "gw1.jsonl").write_text(json.dumps(tests[2]) + "\n")
    table = TOOL["summarize"](str(tmp_path))
    assert "| tests/test_a.py | 35 | 50 |" in table and "| **3 tests** | **55** | 70 |" in table, table
    # The machine: all its cores busy for the first 20 s, then half of them for 30 s
    # (busy and all jiffies, summed over the cores, as /proc/stat counts them).
    cores = os.cpu_count()
    busy = all_ = 0
    lines = []
    for second in range(51):
        lines.append(f"{1000 + second} {busy} {all_}\n")
        all_ += 100 * cores
        busy += 100 * cores if second < 20 else 50 * cores
    (tmp_path / "machine.txt").write_text("".join(lines))
    table = TOOL["windows"](str(tmp_path), seconds=20)
    rows = [line for line in table.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [row.split(" | ")[1] for row in rows] == [f"{cores:.2f}", f"{cores / 2:.2f}", f"{cores / 2:.2f}"], table
    assert rows[0].split(" | ")[2].startswith("test_one (0.75 CPU s/s); test_three (1.00 CPU s/s)"), table
    # Half the cores for 30 of the 50 s.
    assert table.endswith(f"cores stood idle {cores * 30 / 2:.0f} core-seconds of it."), table


@pytest.mark.cluster
def test_the_plugin_counts_a_tests_children_and_takes_its_cgroups_back(tmp_path):
    """The plugin as the page runs it, in a pytest of its own: a test whose CPU is a child's."""
    if not os.access(TOOL["CGROUPS"], os.W_OK):
        pytest.skip(f"needs write access to {TOOL['CGROUPS']} (root, cgroup v1), as the plugin does")
    (tmp_path / "test_child.py").write_text(
        "import subprocess, sys\n\n"
        "def test_child():\n"
        "    subprocess.run([sys.executable, '-c', 'sum(range(30_000_000))'], check=True)\n")
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "KD_SUITE_CPU_DIR": str(out),
           "PYTHONPATH": os.path.join(_project.REPO, "tools")}
    run = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "suite_cpu", "-p", "no:cacheprovider",
                          "test_child.py"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    try:
        output = run.communicate(timeout=120)[0]
    finally:
        run.kill()
    assert run.returncode == 0, output[-3000:]
    (line,) = (out / "main.jsonl").read_text().splitlines()
    test = json.loads(line)
    assert test["test"] == "test_child.py::test_child" and test["cpu"] > 0.2, test
    # The run's cgroups (under its pytest's pid) are gone with it.
    assert not os.path.exists(os.path.join(TOOL["CGROUPS"], "kd_suite_cpu", str(run.pid)))

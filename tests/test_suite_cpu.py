"""tools/suite_cpu.py's tables, from lines written as its plugin writes them."""

import json
import os
import runpy

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

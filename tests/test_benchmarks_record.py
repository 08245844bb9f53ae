"""benchmarks/_record.py: a benchmark's section of docs/benchmarks.md is replaced in place,
stamped with the date, the machine and the command, and nothing else in the file changes."""

from __future__ import annotations

import os
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest
import torch
from rich.table import Table
from conftest import benchmark_modules

ROOT = Path(__file__).resolve().parents[1]
_record, readme_compare, solvers_script = benchmark_modules("_record", "readme_compare", "solvers")

NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
TABLE = "| a | b |\n|:---|---:|\n| x | 1 |"
HEAD = "# Benchmarks\n\nProse the scripts must not touch.\n\n## solvers\n\n"
OTHER = ("\n\n## other\n\n<!-- begin other -->\nan older table, kept byte for byte\n"
         "<!-- end other -->\n\nTrailing prose.\n")


def doc(tmp_path: Path, solvers_body: str = "the old solvers table") -> Path:
    path = tmp_path / "benchmarks.md"
    path.write_text(f"{HEAD}<!-- begin solvers -->\n{solvers_body}\n<!-- end solvers -->{OTHER}")
    return path


def section(text: str, name: str) -> str:
    return text.split(f"<!-- begin {name} -->\n", 1)[1].split(f"\n<!-- end {name} -->", 1)[0]


def test_record_replaces_only_its_section_and_stamps_it(tmp_path):
    path = doc(tmp_path)
    command = "python benchmarks/solvers.py --budgets 0.5 --write"
    _record.record("solvers", TABLE, device="cpu", command=command, path=path, now=NOW)
    text = path.read_text()
    assert text.startswith(HEAD + "<!-- begin solvers -->\n")
    assert text.endswith("\n<!-- end solvers -->" + OTHER)
    body = section(text, "solvers")
    assert "the old solvers table" not in text
    assert body.startswith(f"Recorded 2026-01-02 03:04 UTC on host {platform.node()} (")
    for fragment in (f"{os.cpu_count()} cores", f"torch {torch.__version__} with "
                     f"{torch.get_num_threads()} thread(s)", "device cpu",
                     f"```bash\n{command}\n```"):
        assert fragment in body
    assert body.endswith("\n\n" + TABLE)
    assert [p.name for p in tmp_path.iterdir()] == ["benchmarks.md"]  # no temporary left


def test_record_twice_keeps_one_section(tmp_path):
    path = doc(tmp_path)
    for table in ("| first |\n|:---|", TABLE):
        _record.record("solvers", table, device="cpu", command="python x.py", path=path, now=NOW)
    text = path.read_text()
    assert text.count("<!-- begin solvers -->") == 1 and "first" not in text
    assert section(text, "solvers").endswith(TABLE)


def test_a_new_section_is_appended_and_a_missing_file_created(tmp_path):
    path = doc(tmp_path)
    before = path.read_text()
    _record.record("overhead", TABLE, device="cpu", command="python o.py", path=path, now=NOW)
    text = path.read_text()
    assert text.startswith(before.rstrip("\n") + "\n\n<!-- begin overhead -->\nRecorded 2026-01-02")
    assert text.endswith(TABLE + "\n<!-- end overhead -->\n")
    fresh = tmp_path / "sub" / "new.md"
    _record.record("gpt_half", TABLE, device="cpu", command="python g.py", path=fresh, now=NOW)
    assert fresh.read_text().startswith("<!-- begin gpt_half -->\nRecorded 2026-01-02 03:04 UTC")


@pytest.mark.parametrize("broken", [
    "<!-- begin solvers -->\na\n<!-- end solvers -->\n<!-- begin solvers -->\nb\n<!-- end solvers -->",
    "<!-- begin solvers -->\nno end marker\n",
    "<!-- end solvers -->\n<!-- begin solvers -->\n",
])
def test_broken_markers_are_an_error_and_leave_the_file(tmp_path, broken):
    path = tmp_path / "benchmarks.md"
    path.write_text(broken)
    with pytest.raises(ValueError, match="solvers"):
        _record.record("solvers", TABLE, device="cpu", command="python x.py", path=path, now=NOW)
    assert path.read_text() == broken


def test_an_interrupted_write_leaves_the_old_file(tmp_path, monkeypatch):
    path = doc(tmp_path)
    before = path.read_text()

    def fail(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(_record.os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        _record.record("solvers", TABLE, device="cpu", command="python x.py", path=path, now=NOW)
    assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["benchmarks.md"]


def test_markdown_table_of_a_rich_table():
    table = Table(title="two rows")
    table.add_column("name")
    table.add_column("ms", justify="right")
    table.add_row("a|b", "1.5")
    table.add_row("c", "22")
    assert _record.markdown_table(table) == ("two rows\n\n| name | ms |\n|:---|---:|\n"
                                             "| a\\|b | 1.5 |\n| c | 22 |")


def test_command_line(monkeypatch):
    script = ROOT / "benchmarks" / "solvers.py"
    assert _record.command_line(script, ["--budgets", "0.5", "a b.json"]) == \
        "python benchmarks/solvers.py --budgets 0.5 'a b.json'"
    monkeypatch.setattr(sys, "argv", ["benchmarks/gpt_half.py", "--runs", "3", "--write"])
    assert _record.command_line(script, None) == "python benchmarks/gpt_half.py --runs 3 --write"


def test_solvers_script_writes_its_section(tmp_path, monkeypatch, capsys):
    path = doc(tmp_path)
    monkeypatch.setattr(_record, "DOC", path)
    argv = [str(ROOT / "graphs" / "mlp.json"), "--budgets", "0.9", "--solvers", "none,greedy",
            "--time-limit", "1", "--write"]
    assert solvers_script.main(argv) == 0
    text = path.read_text()
    assert text.startswith(HEAD) and text.endswith("\n<!-- end solvers -->" + OTHER)
    body = section(text, "solvers")
    assert "```bash\npython benchmarks/solvers.py " in body
    rows = [line for line in body.splitlines() if line.startswith("| mlp (42) ")]
    assert [r.split(" | ")[2] for r in rows] == ["none", "greedy"]


def test_readme_table_keeps_the_named_columns_in_order():
    full = ("| strategy | budget | status | fits | peak measured |\n|:---|---:|:---|:---|---:|\n"
            "| auto (relax) | 70% (12.04 MiB) | OPTIMAL | yes / yes | 11.95 MiB |")
    assert readme_compare.select_columns(full, ("strategy", "peak measured", "status")) == (
        "| strategy | peak measured | status |\n|:---|---:|:---|\n"
        "| auto (relax) | 11.95 MiB | OPTIMAL |")
    with pytest.raises(KeyError, match="'gap'"):
        readme_compare.select_columns(full, ("gap",))

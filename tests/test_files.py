"""Files are written whole or not at all, and never over a file of another kind."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from scheduler.files import check_destination, write_atomic
from scheduler.ir.graph import CostGraph
from scheduler.ir.schedule import Schedule
from scheduler.testing.synthetic import random_graph
from tests._cli import run

ROOT = Path(__file__).resolve().parents[1]


def test_a_write_cut_short_leaves_the_old_file(tmp_path):
    """What the issue measured with ``ulimit -f 2`` (here 4 KiB): a write past the file-size limit used to
    leave a truncated graph; now the good file stays and no temporary file is left behind."""
    good = tmp_path / "g.json"
    small = random_graph(3)
    small.save(good)
    before = good.read_bytes()
    assert len(before) < 4096
    script = textwrap.dedent(f"""
        import resource, signal, sys
        sys.path.insert(0, {str(ROOT)!r})
        from scheduler.testing.synthetic import random_graph
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
        try:
            random_graph(200).save({str(good)!r})
        except OSError as e:
            print("failed:", e.errno)
        else:
            print("written")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert "failed:" in out.stdout, out.stdout + out.stderr
    assert good.read_bytes() == before
    assert CostGraph.load(good) == small
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.json"]


def test_write_atomic_replaces_and_keeps_the_mode(tmp_path):
    p = tmp_path / "s.json"
    p.write_text("{}")
    os.chmod(p, 0o640)
    write_atomic(p, '{"a": 1}')
    assert p.read_text() == '{"a": 1}'
    assert p.stat().st_mode & 0o777 == 0o640
    new = tmp_path / "new.json"
    write_atomic(new, b"[]")
    assert new.read_bytes() == b"[]"


def test_refuses_to_write_over_a_file_of_another_kind(tmp_path):
    src = tmp_path / "mycopy.py"
    src.write_text("import torch\n\ndef build():\n    ...\n")
    with pytest.raises(ValueError, match="exists and is not a JSON file; refusing"):
        Schedule([]).save(src)
    with pytest.raises(ValueError, match="refusing"):
        random_graph(3).save(src)
    assert src.read_text().startswith("import torch")
    png = tmp_path / "plot.png"
    png.write_text("not an image")
    with pytest.raises(ValueError, match="is not a PNG image"):
        check_destination(png, "png")
    ok = tmp_path / "old.json"
    ok.write_text('{"old": true}')
    assert check_destination(ok, "json") == ok  # a JSON file is replaced


def test_bad_destinations_are_named(tmp_path):
    with pytest.raises(ValueError, match="is a directory"):
        check_destination(tmp_path, "json")
    a_file = tmp_path / "f"
    a_file.write_text("x")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        check_destination(a_file / "sub" / "s.json", "json")
    made = check_destination(tmp_path / "new" / "dir" / "s.json", "json")
    assert made.parent.is_dir()


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0,
                    reason="permissions do not bind root")
def test_an_unwritable_folder_is_named(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    os.chmod(locked, 0o500)
    try:
        with pytest.raises(ValueError, match="cannot be written: creating a file in"):
            check_destination(locked / "s.json", "json")
    finally:
        os.chmod(locked, 0o700)


def test_cli_out_over_the_models_source_fails_before_profiling(tmp_path):
    """``--out mycopy.py`` used to overwrite the model's own source with JSON after solving."""
    model = tmp_path / "mycopy.py"
    source = textwrap.dedent("""
        from examples.mlp import build as _build

        def small():
            return _build(batch=16, dim=8, depth=2)
    """)
    model.write_text(source)
    code, _, err = run(["solve", f"{model}:small", "--budget", "70%", "--out", str(model)])
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert "refusing to write over it" in lines[0] and "mycopy.py" in lines[0]
    assert model.read_text() == source


@pytest.mark.skipif(not os.path.isdir("/sys/kernel"), reason="needs Linux's /sys")
def test_a_folder_where_no_file_can_be_made_is_named_before_any_work(tmp_path):
    """``--out /sys/x.json`` (run as root, as CI does, ``os.access`` says yes) profiled and
    solved for 42 s before it said it could not write: the destination is tried first."""
    with pytest.raises(ValueError, match="cannot be written: creating a file in '/sys'"):
        check_destination("/sys/x.json", "json")
    model = tmp_path / "m.py"
    model.write_text("def small():\n    raise AssertionError('the model was built')\n")
    code, _, err = run(["solve", f"{model}:small", "--budget", "70%", "--out", "/sys/x.json"])
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert "'/sys/x.json' cannot be written" in lines[0]

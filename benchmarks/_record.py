"""Writing a benchmark's results into ``docs/benchmarks.md``, with when, where and how it ran.

Each benchmark script owns one section of that file, between ``<!-- begin NAME -->`` and
``<!-- end NAME -->``. With ``--write`` a script calls `record`, which replaces the text
between its markers with its table, stamped with the date (UTC), the machine (host name,
processor, core count, load average, torch version and threads, device) and the exact
command line; every other byte of the file stays as it was. The file is written atomically
(a temporary file in the same folder, then ``os.replace``), so an interrupted run leaves
either the old file or the new one. A section whose markers are missing is appended at the
end of the file (the file is created if need be).

The benchmarks are scripts, not part of the package; this module is imported by them with
their folder on ``sys.path`` (``python benchmarks/NAME.py`` puts it there).
"""

from __future__ import annotations

import os
import platform
import shlex
import sys
import tempfile
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

__all__ = ["DOC", "ROOT", "add_write_option", "command_line", "machine", "markdown_table",
           "record", "replace_section", "stamp"]

ROOT = Path(__file__).resolve().parents[1]
#: the file the benchmarks write their sections into
DOC = ROOT / "docs" / "benchmarks.md"


def add_write_option(parser: Any) -> None:
    """Add the ``--write`` flag every benchmark script shares to an argparse parser."""
    parser.add_argument("--write", action="store_true",
                        help="also replace this script's section of docs/benchmarks.md "
                             "with the table, the date, the machine and this command line")


def markdown_table(table: Any) -> str:
    """A rich ``Table`` as GitHub markdown: its title (when it has one) as a line of text,
    then the header row and a row per table row; right-justified columns are right-aligned.
    A ``|`` inside a cell is escaped."""
    def cell(value: Any) -> str:
        text = value.plain if hasattr(value, "plain") else str(value)
        return " ".join(text.split()).replace("|", "\\|")

    columns = list(table.columns)
    head = "| " + " | ".join(cell(c.header) for c in columns) + " |"
    rule = "|" + "|".join("---:" if c.justify == "right" else ":---" for c in columns) + "|"
    cells = [list(c.cells) for c in columns]
    rows = ["| " + " | ".join(cell(col[i]) for col in cells) + " |"
            for i in range(table.row_count)]
    title = f"{cell(table.title)}\n\n" if table.title else ""
    return title + "\n".join([head, rule, *rows])


def command_line(script: str | Path, argv: Sequence[str] | None) -> str:
    """The command that ran the benchmark: ``sys.argv`` as given when ``argv`` is None (the
    script was run from the shell), else ``script`` (relative to the repository when it is
    inside it) with ``argv`` (its ``main`` was called with them)."""
    if argv is None:
        return shlex.join(["python", *sys.argv])
    path = Path(script).resolve()
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    return shlex.join(["python", str(shown), *argv])


def machine(device: str) -> str:
    """Where the benchmark ran: host name, processor, cores, load average, torch version and
    threads, and ``device`` (what the models ran on, as the script knows it)."""
    import torch

    processor = platform.processor() or platform.machine() or "unknown processor"
    load = f", load average {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""
    return (f"host {platform.node() or 'unknown'} ({processor}, {os.cpu_count()} cores{load}), "
            f"torch {torch.__version__} with {torch.get_num_threads()} thread(s), "
            f"device {device}")


def stamp(*, device: str, command: str, now: datetime | None = None,
          inline: bool = False) -> str:
    """The text that heads a recorded section: date (UTC), machine and command, the command in
    a code block (``inline``: in one sentence)."""
    now = now or datetime.now(timezone.utc)
    where = f"Recorded {now.astimezone(timezone.utc):%Y-%m-%d %H:%M} UTC on {machine(device)}"
    if inline:
        return f"{where}, by `{command}`."
    return f"{where}, by:\n\n```bash\n{command}\n```"


def replace_section(text: str, name: str, body: str) -> str:
    """``text`` with what lies between the markers of section ``name`` replaced by ``body``
    (the section is appended when it has no markers yet).

    Raises:
        ValueError: the markers are there more than once, only one of them is, or they are
            in the wrong order (the message says which; fix the file by hand).
    """
    begin, end = f"<!-- begin {name} -->", f"<!-- end {name} -->"
    n_begin, n_end = text.count(begin), text.count(end)
    if n_begin == n_end == 0:
        head = text.rstrip("\n") + "\n\n" if text.strip() else ""
        return f"{head}{begin}\n{body.strip()}\n{end}\n"
    if n_begin != 1 or n_end != 1:
        raise ValueError(f"section {name!r} needs exactly one {begin!r} and one {end!r}; found "
                         f"{n_begin} and {n_end}: fix the file so that each appears once")
    head, rest = text.split(begin, 1)
    if end not in rest:
        raise ValueError(f"section {name!r}: {end!r} comes before {begin!r}; put it after")
    tail = rest.split(end, 1)[1]
    return f"{head}{begin}\n{body.strip()}\n{end}{tail}"


def record(name: str, body: str, *, device: str, command: str,
           path: str | Path | None = None, now: datetime | None = None) -> Path:
    """Replace section ``name`` of ``path`` with `stamp` and ``body``, atomically.

    Args:
        name: the section's name (its markers are ``<!-- begin NAME -->`` / ``<!-- end NAME -->``).
        body: the results, as markdown (`markdown_table`).
        device: what the models ran on (``"cpu"``, ``"cuda:0 (NVIDIA H200)"``).
        command: the command line (`command_line`).
        path: the markdown file (default: `DOC`, looked up at the call).
        now: the time to stamp (default: now, UTC).

    Returns:
        The path written.
    """
    path = Path(DOC if path is None else path)
    old = path.read_text() if path.exists() else ""
    new = replace_section(old, name, f"{stamp(device=device, command=command, now=now)}\n\n"
                                     f"{body.strip()}")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(new)
            f.flush()
            os.fsync(f.fileno())
        mode = (os.stat(path).st_mode & 0o777) if path.exists() else 0o644
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def publish(name: str, lines: Sequence[str], *, write: bool, device: str) -> None:
    """Print a script's table (its ``lines``) and, with ``write`` (``--write``), record it
    as section ``name`` (`record`), stamped with the command that ran it (`sys.argv`)."""
    table = "\n".join(lines)
    print(table)
    if write:
        record(name, table, device=device, command=command_line(sys.argv[0], None))

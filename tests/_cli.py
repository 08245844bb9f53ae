"""Run the command line in-process and capture what it prints."""

from __future__ import annotations

import contextlib
import io

from scheduler import cli


def run(argv: list[str]) -> tuple[int, str, str]:
    """``(exit code, stdout, stderr)`` of ``scheduler ARGV``."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(argv)
    return code, out.getvalue(), err.getvalue()

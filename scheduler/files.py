"""Writing files without losing any: atomic replacement, and destinations checked first.

`write_atomic` writes to a temporary file in the destination's folder, flushes it to disk and
renames it over the destination (``os.replace``, atomic on POSIX and Windows): a write cut
short (a full disk, a file-size limit, an interrupt) leaves the old file as it was, never a
truncated one. `check_destination` says before any long work whether a path can be written,
and refuses to replace an existing file that is not of the kind being written (a model's
``.py`` given as ``--out``).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["KINDS", "check_destination", "write_atomic"]

#: what an existing file must look like to be replaced: kind -> (description, test of its
#: first bytes)
KINDS = {
    "json": ("a JSON file", lambda head: head.lstrip()[:1] in (b"{", b"[")),
    "csv": ("a CSV file", lambda head: b"\0" not in head and not head.lstrip().startswith(
        (b"{", b"[", b"#!", b"import ", b"from ", b"def ", b"class "))),
    "png": ("a PNG image", lambda head: head.startswith(b"\x89PNG")),
}


def check_destination(path: str | Path, kind: str, *, what: str = "the output") -> Path:
    """Check that ``path`` can be written as a file of ``kind`` (`KINDS`), before work starts.

    Creates missing parent folders. An existing file is accepted only if it already looks
    like ``kind`` (it will be replaced).

    Raises:
        ValueError: the path is a directory, its parent is a file, it cannot be written (no
            permission, a read-only file system), or an existing file there is not of this
            kind; the message names the path and the fix.
    """
    p = Path(path)
    desc, looks_right = KINDS[kind]
    if p.is_dir():
        raise ValueError(f"{what} {str(p)!r} is a directory; give a file path inside it, e.g. "
                         f"{str(p / ('out.' + kind))!r}")
    parent = p.parent
    for up in (parent, *parent.parents):
        if up.exists():
            if not up.is_dir():
                raise ValueError(f"{what} {str(p)!r} cannot be written: {str(up)!r} is a file, "
                                 f"not a folder; choose another path")
            break
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{what} {str(p)!r} cannot be written: cannot create its folder "
                         f"({e.strerror or e}); choose another path") from None
    # (a trial file where `write_atomic` will make its own: ``os.access`` answers yes to root
    # for a read-only mount or a kernel file system such as /sys, where creating one fails)
    try:
        fd, trial = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".check", dir=parent)
    except OSError as e:
        raise ValueError(f"{what} {str(p)!r} cannot be written: creating a file in "
                         f"{str(parent)!r} failed ({e.strerror or e}); choose another path"
                         ) from None
    os.close(fd)
    os.unlink(trial)
    if p.exists():
        if not p.is_file():
            raise ValueError(f"{what} {str(p)!r} is not a regular file (a device or a pipe); "
                             f"give a file path")
        try:
            with open(p, "rb") as f:
                head = f.read(512)
        except OSError as e:
            raise ValueError(f"{what} {str(p)!r} cannot be read to check what it is "
                             f"({e.strerror or e}); choose another path") from None
        if head and not looks_right(head):
            raise ValueError(f"{what} {str(p)!r} exists and is not {desc}; refusing to write "
                             f"over it (is it your own file?): choose another path, or remove "
                             f"it first")
    return p


def write_atomic(path: str | Path, data: str | bytes) -> None:
    """Write ``data`` to ``path`` so that it is either the old file or the whole new one.

    Raises:
        OSError: the write failed (the destination is left as it was).
    """
    p = Path(path)
    payload = data.encode() if isinstance(data, str) else data
    try:
        _write_replace(p, payload)
    except OSError as e:  # name the destination, not the temporary file (or no file at all)
        if e.errno is None or e.filename == str(p):
            raise
        raise OSError(e.errno, e.strerror, str(p)) from e


def _write_replace(p: Path, payload: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent or ".")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        if p.exists():
            try:
                os.chmod(tmp, p.stat().st_mode & 0o7777)
            except OSError:
                pass
        else:
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, p)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


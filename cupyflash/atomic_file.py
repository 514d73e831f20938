"""Atomic file replacement: readers and concurrent writers only ever see complete files."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["write_atomic"]

# mkstemp makes 0600 files; a cache or tuning table written by one user (a container build) must
# be readable by the user who runs the kernels.
FILE_MODE = 0o644


def write_atomic(path: str | os.PathLike, data: bytes, *, durable: bool = False) -> Path:
    """Write `data` to a unique temporary file beside `path`, then rename it over `path`.

    durable: fsync before the rename, so that a crash never leaves a renamed file whose data is
    not on disk (cache entries); plain reports skip it.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name[:24]}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), FILE_MODE)
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path

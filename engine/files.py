"""Writing output files whole: a reader never sees a half-written file, and a
full disk or a killed run leaves no truncated one behind."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path


def _temp_beside(path: Path, text: str) -> Path:
    """`text` in a new temporary file in `path`'s directory (so a rename is atomic)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return Path(tmp)


def write_text_atomic(path: str | Path, text: str) -> None:
    """Replace `path` with `text` in one step."""
    path = Path(path)
    tmp = _temp_beside(path, text)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_new(path: str | Path, text: str) -> None:
    """Create `path` holding `text`; FileExistsError if it exists (a second writer is refused, never merged)."""
    path = Path(path)
    tmp = _temp_beside(path, text)
    try:
        os.link(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)

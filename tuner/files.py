"""Writing a file whole or not at all, and never through a link planted at a name tuner
writes: the bytes go to a new file created exclusively beside the target, then are
renamed onto it (a rename replaces a link at the target, it does not follow it). A name
that holds a device, a pipe or a socket is refused: the rename would replace it with a file."""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path

from tuner.errors import TunerError


def _umask() -> int:
    # read by setting it and putting it back: os has no other way to ask
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _what(mode: int) -> str:
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a pipe"),
             (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"), (stat.S_ISSOCK, "a socket"))
    return next((name for test, name in kinds if test(mode)), "a special file")


def refuse_special(path: Path) -> None:
    """TunerError in one line where path holds a directory, a device, a pipe or a socket:
    a file renamed onto it would replace it."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as e:
        raise TunerError(f"cannot write {path}: {e.strerror or e}") from None
    if not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
        raise TunerError(f"cannot write {path}: it is {_what(mode)}, not a regular file")


def write_atomically(path: str | Path, data: bytes) -> None:
    """data as the file at path (its directory must exist), or TunerError in one line and
    path as it was. The file gets the mode a plain create would give (0666 less the umask),
    not mkstemp's private 0600."""
    path = Path(path)
    refuse_special(path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name[:100]}.", suffix=".tmp", dir=path.parent)
    except OSError as e:
        raise TunerError(f"cannot write {path}: {e.strerror or e}") from None
    done = False
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o666 & ~_umask())
            f.write(data)
        os.replace(tmp, path)
        done = True
    except OSError as e:
        raise TunerError(f"cannot write {path}: {e.strerror or e}") from None
    finally:
        if not done:
            with contextlib.suppress(OSError):
                os.unlink(tmp)

"""Reading a user's JSON file, with every way it can be bad turned into one line; a name
ending in .gz is gzip-compressed JSON (both ways), and "-" is standard input. No read goes
past settings.MAX_JSON_BYTES of text, from the file or out of its decompression."""

from __future__ import annotations

import contextlib
import gzip
import json
import sys
import zlib
from pathlib import Path
from typing import IO, Any, Callable, Iterator

from tuner import settings
from tuner.errors import TunerError

GZIP_SUFFIX = ".gz"
STDIN = "-"  # the name that reads standard input (a pipe from `tuner export --out -`, say)
_CHUNK = 1 << 20  # read in pieces: one read of the whole bound would reserve it all up front


GZIP_MAGIC = b"\x1f\x8b"


def is_gzip(path: str | Path) -> bool:
    return Path(path).suffix.lower() == GZIP_SUFFIX


def is_stdio(path: str | Path) -> bool:
    """Whether a name means standard input or output ("-"), as the command line's convention has it."""
    return str(path) == STDIN


@contextlib.contextmanager
def _opened(path: Path) -> Iterator[IO[bytes]]:
    if is_stdio(path):  # (not closed: it is the process's); gzip where its first bytes say so
        stdin = sys.stdin.buffer
        peek = getattr(stdin, "peek", None)
        yield gzip.GzipFile(fileobj=stdin, mode="rb") if peek is not None and peek(2)[:2] == GZIP_MAGIC else stdin
        return
    with (gzip.open(path, "rb") if is_gzip(path) else open(path, "rb")) as f:
        yield f


def read_json(path: str | Path, error: type[TunerError] = TunerError, what: str = "file",
              object_pairs_hook: Callable[[list[tuple[str, Any]]], Any] | None = None) -> Any:
    path = Path(path)
    limit = settings.MAX_JSON_BYTES
    named = f"{what} on standard input" if is_stdio(path) else f"{what} {path}"
    try:
        with _opened(path) as f:
            raw = bytearray()
            while len(raw) <= limit:  # at most limit + 1 bytes, however much the stream holds
                chunk = f.read(min(_CHUNK, limit + 1 - len(raw)))
                if not chunk:
                    break
                raw += chunk
        if len(raw) > limit:
            raise error(f"{named} holds more than {limit / 2**20:g} MiB of text"
                        f"{' once decompressed' if is_gzip(path) else ''}, more than tuner reads")
        text = raw.decode("utf-8-sig")  # (a byte-order mark, as some Windows editors write, is not text)
    except UnicodeDecodeError:
        raise error(f"{named} is not UTF-8 text") from None
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:  # BadGzipFile before OSError: it is one
        raise error(f"{named} is not a whole gzip file: {e or 'it ends early'}") from None
    except OSError as e:
        raise error(f"cannot read {named}: {e.strerror or e}") from None
    try:
        return json.loads(text, object_pairs_hook=object_pairs_hook)
    except RecursionError:
        raise error(f"{named} is nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, and an integer past Python's digit limit (whose
        # message suggests a Python call)
        if not isinstance(e, json.JSONDecodeError) and "digits" in str(e):
            raise error(f"{named} holds an integer of thousands of digits, more than tuner reads") from None
        raise error(f"{named} is not valid JSON: {e}") from None


def file_bytes(path: str | Path, text: str) -> bytes:
    """text as a file of that name holds it: UTF-8, gzip-compressed where the name ends in
    .gz (with no time in its header, so the same text gives the same bytes)."""
    data = text.encode("utf-8")
    return gzip.compress(data, compresslevel=9, mtime=0) if is_gzip(path) else data

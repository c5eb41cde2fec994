"""Reading a user's JSON file, with every way it can be bad turned into one line; a name
ending in .gz is gzip-compressed JSON (both ways). No read goes past
settings.MAX_JSON_BYTES of text, from the file or out of its decompression."""

from __future__ import annotations

import gzip
import json
import zlib
from pathlib import Path
from typing import Any, Callable

from tuner import settings
from tuner.errors import TunerError

GZIP_SUFFIX = ".gz"
_CHUNK = 1 << 20  # read in pieces: one read of the whole bound would reserve it all up front


def is_gzip(path: str | Path) -> bool:
    return Path(path).suffix.lower() == GZIP_SUFFIX


def read_json(path: str | Path, error: type[TunerError] = TunerError, what: str = "file",
              object_pairs_hook: Callable[[list[tuple[str, Any]]], Any] | None = None) -> Any:
    path = Path(path)
    limit = settings.MAX_JSON_BYTES
    try:
        with (gzip.open(path, "rb") if is_gzip(path) else open(path, "rb")) as f:
            raw = bytearray()
            while len(raw) <= limit:  # at most limit + 1 bytes, however much the stream holds
                chunk = f.read(min(_CHUNK, limit + 1 - len(raw)))
                if not chunk:
                    break
                raw += chunk
        if len(raw) > limit:
            raise error(f"{what} {path} holds more than {limit / 2**20:g} MiB of text"
                        f"{' once decompressed' if is_gzip(path) else ''}, more than tuner reads")
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise error(f"{what} {path} is not UTF-8 text") from None
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:  # BadGzipFile before OSError: it is one
        raise error(f"{what} {path} is not a whole gzip file: {e or 'it ends early'}") from None
    except OSError as e:
        raise error(f"cannot read {what} {path}: {e.strerror or e}") from None
    try:
        return json.loads(text, object_pairs_hook=object_pairs_hook)
    except RecursionError:
        raise error(f"{what} {path} is nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, and integers past Python's digit limit
        raise error(f"{what} {path} is not valid JSON: {e}") from None


def file_bytes(path: str | Path, text: str) -> bytes:
    """text as a file of that name holds it: UTF-8, gzip-compressed where the name ends in
    .gz (with no time in its header, so the same text gives the same bytes)."""
    data = text.encode("utf-8")
    return gzip.compress(data, compresslevel=9, mtime=0) if is_gzip(path) else data

"""Reading a user's JSON file, with every way it can be bad turned into one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from tuner.errors import TunerError


def read_json(path: str | Path, error: type[TunerError] = TunerError, what: str = "file",
              object_pairs_hook: Callable[[list[tuple[str, Any]]], Any] | None = None) -> Any:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise error(f"{what} {path} is not UTF-8 text") from None
    except OSError as e:
        raise error(f"cannot read {what} {path}: {e.strerror or e}") from None
    try:
        return json.loads(text, object_pairs_hook=object_pairs_hook)
    except RecursionError:
        raise error(f"{what} {path} is nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, and integers past Python's digit limit
        raise error(f"{what} {path} is not valid JSON: {e}") from None

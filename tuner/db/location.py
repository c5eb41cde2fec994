"""Where the tuning DB lives: a SQLAlchemy URL, a file path, $TUNER_DB, or the default."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import parse_qsl, quote, unquote, urlsplit

from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError

from tuner import settings
from tuner.errors import TunerError

DB_FILENAME = "tuner.db"
# SQLite's application id in the header of every DB file tuner creates ("tunr"): how
# --force tells tuner's own damaged file from anything else at the path
APPLICATION_ID = 0x74756E72


class DBError(TunerError):
    """The tuning DB cannot be opened or used; the message says why in one line."""


class MissingDBError(DBError):
    """No tuning DB exists there yet (opened for reading only)."""


class BusyDBError(DBError):
    """Another writer held the tuning DB past the wait: the same write may succeed later."""


class DamagedDBError(DBError):
    """The tuning DB is there but damaged (no schema version, a missing table, a file SQLite
    calls malformed): nothing reads or writes it; doctor reports it, exit code 1."""


def default_db_path() -> Path:
    """tuning_cache/tuner.db in a source checkout, else the user's cache directory."""
    root = Path(__file__).resolve().parents[2]
    if (root / "tuning_cache").is_dir() and (root / "pyproject.toml").is_file():
        return root / "tuning_cache" / DB_FILENAME
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "tuner" / DB_FILENAME


def resolve_db_url(target: str | os.PathLike | None = None) -> tuple[URL, bool]:
    """(URL, is_default) for an explicit target, else $TUNER_DB, else the default file."""
    is_default = False
    if target is None or str(target) == "":
        target = settings.env_db()
    if target is None:
        target, is_default = default_db_path(), True
    text = str(target)
    if text.startswith("file:"):  # SQLite's own URI form (file:PATH?immutable=1, ...)
        database, _, query = text.partition("?")
        return URL.create("sqlite", database=database, query={**dict(parse_qsl(query)), "uri": "true"}), False
    if "://" in text:
        try:
            url = make_url(text)
        except (ArgumentError, ValueError):
            raise DBError(f"not a valid SQLAlchemy URL: {text!r}") from None
        # a plain postgresql:// URL takes the driver tuner-attn[postgres] installs, not psycopg2
        return (url.set(drivername="postgresql+psycopg") if url.drivername == "postgresql" else url), False
    path = Path(text).expanduser().resolve()
    return URL.create("sqlite", database=str(path)), is_default


SQLITE_HEADER = b"SQLite format 3\x00"


def sqlite_file(url: URL) -> Path | None:
    """The file a SQLite URL names, plain (sqlite:///PATH) or in SQLite's URI form
    (sqlite:///file:PATH?immutable=1&uri=true); None for a memory DB or another backend."""
    database = url.database
    if url.get_backend_name() != "sqlite" or database in (None, "", ":memory:"):
        return None
    if database.startswith("file:"):
        return Path(unquote(urlsplit(database).path)).expanduser().resolve()
    return Path(database)


def is_read_only_url(url: URL) -> bool:
    """A SQLite URI the user opened read-only (mode=ro or immutable=1)."""
    return url.query.get("mode") == "ro" or url.query.get("immutable") in ("1", "true")


def on_read_only_media(path: Path) -> bool:
    """A DB file in a directory this process cannot write, with no shared-memory file beside
    it: SQLite cannot open its write-ahead log there except as an immutable file."""
    return path.is_file() and not os.access(path.parent, os.W_OK) and not path.with_name(path.name + "-shm").exists()


def read_only_url(path: Path) -> URL:
    """The URL that reads a DB file on read-only media: immutable (no locks, no -shm)."""
    return URL.create("sqlite", database=f"file:{quote(str(path))}",
                      query={"mode": "ro", "immutable": "1", "uri": "true"})


def is_tuners_file(path: Path) -> bool:
    """A regular file that tuner made: SQLite's header with tuner's application id, or (a
    file made before the id) a schema that SQLite can still list holding tuner's tables only."""
    import sqlite3

    from tuner.db.schema import Base

    if path.is_symlink() or not path.is_file():
        return False
    try:
        with path.open("rb") as f:
            header = f.read(100)
    except OSError:
        return False
    if len(header) < 100 or not header.startswith(SQLITE_HEADER):
        return False
    if int.from_bytes(header[68:72], "big") == APPLICATION_ID:
        return True
    tables = Base.metadata.tables
    try:
        conn = sqlite3.connect(f"file:{quote(str(path))}?mode=ro", uri=True, timeout=1)
        try:
            names = [row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
            if not names or "records" not in names or not set(names) <= set(tables):
                return False
            # each table's columns tuner's own (another application's "records" is not)
            return all({row[1] for row in conn.execute("SELECT * FROM pragma_table_info(?)", (name,))}
                       <= set(tables[name].columns.keys()) for name in names)
        finally:
            conn.close()
    except sqlite3.Error:
        return False


def set_aside(target: str | os.PathLike | None) -> Path:
    """Rename tuner's own damaged SQLite file (and its -wal/-shm) to
    NAME.unreadable-TIMESTAMP beside it, under the write lock, so a new DB can take its
    place; nothing is deleted. Anything else at the path (another application's DB, a text
    file, a device) is never touched, nor are server DBs (PostgreSQL, ...): those are their
    owners' call."""
    from datetime import datetime, timezone

    from filelock import FileLock, Timeout

    url, _ = resolve_db_url(target)
    if url.get_backend_name() != "sqlite" or url.database in (None, "", ":memory:"):
        raise DBError(f"--force sets aside SQLite files only; repair or drop {url.render_as_string(hide_password=True)} yourself")
    path = Path(url.database)
    if not is_tuners_file(path):
        raise DBError(f"{path} is not a tuning DB file that tuner made; --force leaves it alone: move it "
                      "yourself or give another --db")
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
    aside = path.with_name(f"{path.name}.unreadable-{stamp}")
    try:
        with FileLock(str(path) + ".lock", timeout=10):  # no tuner writer is inside a transaction
            for suffix in ("-wal", "-shm"):
                side = path.with_name(path.name + suffix)
                if side.exists():
                    side.replace(aside.with_name(aside.name + suffix))
            path.replace(aside)
    except Timeout:
        raise DBError(f"cannot set aside {path}: another process holds its write lock") from None
    except OSError as e:
        raise DBError(f"cannot set aside {path}: {e.strerror or e}") from None
    return aside

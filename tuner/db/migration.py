"""The schema in a DB: its state (ready, empty, unfinished, partial), its creation in one
transaction, and what a DB made by an older tuner gains when opened for writing."""

from __future__ import annotations

from dataclasses import dataclass, field

from sqlalchemy import Inspector, inspect, literal, select, text, type_coerce
from sqlalchemy.orm import Session
from sqlalchemy.types import NullType

from tuner.db.location import APPLICATION_ID, DamagedDBError, DBError
from tuner.db.schema import OPTIONAL_COLUMNS, OPTIONAL_INDEXES, OPTIONAL_TABLES, SCHEMA_VERSION, Base, Meta

# the columns added since schema version 1, as constant DDL (SQLite and PostgreSQL alike)
_ADD_COLUMN = {("measurements", "rung"): "ALTER TABLE measurements ADD COLUMN rung INTEGER",
               ("misses", "length_calls"): "ALTER TABLE misses ADD COLUMN length_calls BIGINT",
               **{("misses", c): f"ALTER TABLE misses ADD COLUMN {c} FLOAT"
                  for c in ("length_mean_sum", "length_max_sum", "length_spread_sum")}}
# a PRAGMA takes no bound parameter: the one constant statement that writes tuner's id
_STAMP_APPLICATION_ID = text("PRAGMA application_id = 1953853042")
assert APPLICATION_ID == 1953853042
CREATE_LOCK_KEY = 0x74756E6572  # "tuner": the advisory lock that serialises schema creation and upgrades


@dataclass
class SchemaGaps:
    """What a DB made by an older tuner lacks of this schema: optional tables, (table,
    column) and (table, index) pairs, and, for SQLite, tuner's application id."""

    tables: set[str] = field(default_factory=set)
    columns: set[tuple[str, str]] = field(default_factory=set)
    indexes: set[tuple[str, str]] = field(default_factory=set)
    unstamped: bool = False

    def lacks_table(self, model: type) -> bool:
        return model.__tablename__ in self.tables

    def columns_of(self, model: type) -> frozenset[str]:
        """The optional columns of model's table that the DB lacks."""
        return frozenset(c for t, c in self.columns if t == model.__tablename__)


def lock_schema(session: Session) -> None:
    """PostgreSQL's advisory lock, held to the session's commit: one creator or upgrader at a
    time (a server DB has no file lock)."""
    session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": CREATE_LOCK_KEY})


def schema_state(session: Session, backend: str, display_url: str) -> tuple[str, SchemaGaps]:
    """"ready" (our schema version, every core table), "empty" (no tables), "unfinished"
    (only our tables, empty, no version row: a creation cut short), "partial" (only our
    tables, rows in them, no version row), with what the DB lacks; DBError for anything else."""
    inspector = inspect(session.connection())
    version = None
    if Meta.__tablename__ in inspector.get_table_names():
        version = session.execute(
            select(type_coerce(Meta.value, NullType())).where(Meta.key == "schema_version")).scalar()
    # the tables after the version: a creator commits the version row after its last
    # table, so once the row is seen every table is (listing them first races it)
    inspector = inspect(session.connection())
    tables = set(inspector.get_table_names())
    columns = {t: {c["name"] for c in inspector.get_columns(t)} for t in tables}
    gaps = _gaps(inspector, tables, columns)
    gaps.unstamped = backend == "sqlite" and session.execute(text("PRAGMA application_id")).scalar() != APPLICATION_ID
    foreign = any(t not in Base.metadata.tables or columns[t] != set(Base.metadata.tables[t].columns.keys())
                  - {c for table, c in gaps.columns if table == t} for t in tables)
    if version is not None:
        return _versioned(version, tables, display_url), gaps
    if foreign:
        raise DBError(f"{display_url} is not a tuning DB (it has other tables); give another --db")
    if not tables:
        return "empty", gaps
    has_rows = any(session.execute(select(literal(1)).select_from(Base.metadata.tables[t]).limit(1)).first()
                   for t in tables)
    return ("partial" if has_rows else "unfinished"), gaps


def _gaps(inspector: Inspector, tables: set[str], columns: dict[str, set[str]]) -> SchemaGaps:
    """The optional tables, columns and indexes (of tables present) missing."""
    indexes = {t: {i["name"] for i in inspector.get_indexes(t)} for t in OPTIONAL_INDEXES if t in tables}
    return SchemaGaps(
        tables=OPTIONAL_TABLES - tables,
        columns={(t, c) for t, optional in OPTIONAL_COLUMNS.items() if t in columns
                 for c in optional if c not in columns[t]},
        indexes={(t, i) for t, names in OPTIONAL_INDEXES.items() if t in indexes
                 for i in names if i not in indexes[t]},
    )


def _versioned(version: object, tables: set[str], display_url: str) -> str:
    """"ready" for a DB with a version row: DBError for another version, damage for a missing core table."""
    if str(version) != str(SCHEMA_VERSION):
        raise DBError(f"tuning DB {display_url} has schema version {str(version)!r:.20}; "
                      f"this tuner reads version {SCHEMA_VERSION}")
    missing = sorted(set(Base.metadata.tables) - OPTIONAL_TABLES - tables)
    if missing:
        raise DamagedDBError(f"tuning DB {display_url} is damaged: table {missing[0]} is missing")
    return "ready"


def partial_error(display_url: str) -> DamagedDBError:
    return DamagedDBError(f"tuning DB {display_url} is damaged: it has tuner's tables, with rows, but no "
                          "schema version (sweep --force renames it aside and starts a new DB)")


def create(session: Session, backend: str) -> None:
    """The schema, in an empty or unfinished DB, inside the caller's one transaction: tables,
    SQLite's application id, and the version row last."""
    if backend == "postgresql":
        # no file lock for a server DB: its own lock, held to commit, serialises
        # creators (create_all skips existing tables)
        lock_schema(session)
    Base.metadata.create_all(session.connection())
    if backend == "sqlite":
        session.execute(_STAMP_APPLICATION_ID)
    if session.get(Meta, "schema_version") is None:
        session.add(Meta(key="schema_version", value=str(SCHEMA_VERSION)))


def upgrade(session: Session, backend: str, gaps: SchemaGaps) -> None:
    """Add the tables and columns added since schema version 1, and stamp an unstamped file."""
    if backend == "postgresql":  # as creation: one upgrader at a time
        lock_schema(session)
    Base.metadata.create_all(session.connection(), tables=[Base.metadata.tables[t] for t in sorted(gaps.tables)])
    if gaps.unstamped:  # made before tuner named its files: --force can tell them now
        session.execute(_STAMP_APPLICATION_ID)
    for table, column in sorted(gaps.columns):  # looked at again: another writer may have added it
        present = {c["name"] for c in inspect(session.connection()).get_columns(table)}
        if column in present:
            continue
        session.execute(text(_ADD_COLUMN[(table, column)]))


def add_indexes(session: Session, backend: str, gaps: SchemaGaps) -> None:
    """Build the indexes added since schema version 1 (one builder at a time)."""
    if backend == "postgresql":
        lock_schema(session)
    for table, name in sorted(gaps.indexes):
        index = next(i for i in Base.metadata.tables[table].indexes if i.name == name)
        index.create(session.connection(), checkfirst=True)

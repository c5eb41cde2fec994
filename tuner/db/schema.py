"""The tuning DB's tables (SQLAlchemy 2 typed ORM). Keys are named columns, never packed."""

from __future__ import annotations

from datetime import datetime, timezone

from sqlalchemy import BigInteger, DateTime, Float, ForeignKey, Index, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

SCHEMA_VERSION = 1


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class Base(DeclarativeBase):
    pass


class Meta(Base):
    __tablename__ = "tuner_meta"

    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(Text)


class Fingerprint(Base):
    """An environment (device, driver, library versions); id is a hash of data."""

    __tablename__ = "fingerprints"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    data: Mapped[str] = mapped_column(Text)  # canonical JSON
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class _Keyed:
    """The columns that say which problem, in which environment, a row is about."""

    op: Mapped[str] = mapped_column(String(128), index=True)
    static_key: Mapped[str] = mapped_column(Text)  # canonical JSON
    batch: Mapped[int] = mapped_column(BigInteger)
    max_q_len: Mapped[int] = mapped_column(BigInteger)
    kv_len_bucket: Mapped[int] = mapped_column(BigInteger)
    fingerprint_id: Mapped[str] = mapped_column(String(32), ForeignKey("fingerprints.id"), index=True)


class _Winner:
    """A winner's config and how it won."""

    config: Mapped[str] = mapped_column(Text)  # canonical JSON
    median_us: Mapped[float] = mapped_column(Float)
    spread_us: Mapped[float] = mapped_column(Float)
    samples: Mapped[int] = mapped_column(Integer)
    default_config: Mapped[str] = mapped_column(Text)
    default_median_us: Mapped[float | None] = mapped_column(Float, nullable=True)
    default_spread_us: Mapped[float | None] = mapped_column(Float, nullable=True)
    method: Mapped[str] = mapped_column(Text)  # canonical JSON: timer and its settings


class TuningRecord(_Keyed, _Winner, Base):
    """The winner for one (op, static key, run key, environment), with how it won."""

    __tablename__ = "records"
    __table_args__ = (
        UniqueConstraint("op", "static_key", "batch", "max_q_len", "kv_len_bucket", "fingerprint_id"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Measurement(_Keyed, Base):
    """One candidate config measured (or failed) on one problem; a sweep resumes from these."""

    __tablename__ = "measurements"
    __table_args__ = (
        UniqueConstraint(
            "op", "static_key", "batch", "max_q_len", "kv_len_bucket", "fingerprint_id", "config"
        ),
        # one problem's rows, read on every stored shape a sweep passes, without a scan
        # (docs/decisions.md, "The DB"). Added after schema version 1: a DB opened for writing gains it
        Index("ix_measurements_problem", "op", "static_key", "batch", "max_q_len", "kv_len_bucket",
              "fingerprint_id"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    config: Mapped[str] = mapped_column(Text)
    kv_len: Mapped[int] = mapped_column(BigInteger)  # the length actually measured
    status: Mapped[str] = mapped_column(String(16))  # ok | wrong | error | oom
    median_us: Mapped[float | None] = mapped_column(Float, nullable=True)
    spread_us: Mapped[float | None] = mapped_column(Float, nullable=True)
    samples: Mapped[int] = mapped_column(Integer, default=0)
    max_error: Mapped[float | None] = mapped_column(Float, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    method: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # the search's rung it was measured at (successive halving: 0 quick, 1 full); added after
    # schema version 1: null in older rows, which kept it in method
    rung: Mapped[int | None] = mapped_column(Integer, nullable=True)


class Miss(_Keyed, Base):
    """A run key the runtime served without an exact winner (nearest record or default):
    what `tuner show --misses` lists and `tuner sweep --from-misses` tunes. Added after
    schema version 1 shipped; DBs without this table gain it when opened for writing."""

    __tablename__ = "misses"
    __table_args__ = (
        UniqueConstraint("op", "static_key", "batch", "max_q_len", "kv_len_bucket", "fingerprint_id"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    served: Mapped[str] = mapped_column(String(16))  # nearest | default
    count: Mapped[int] = mapped_column(BigInteger, default=0)
    last_seen: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # the kv lengths of the missed calls whose lengths were known on the host, as sums over
    # those calls (added on every upsert, so processes merge): per call its mean, its longest
    # and the spread (standard deviation) of its lengths. Added after the misses table
    # shipped: null in older rows
    length_calls: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    length_mean_sum: Mapped[float | None] = mapped_column(Float, nullable=True)
    length_max_sum: Mapped[float | None] = mapped_column(Float, nullable=True)
    length_spread_sum: Mapped[float | None] = mapped_column(Float, nullable=True)


class ReplacedRecord(_Keyed, _Winner, Base):
    """A winner that a newer measurement replaced (a sweep with --force, tune mode, an
    import): kept so no measurement is lost. Added after schema version 1 shipped, like
    misses."""

    __tablename__ = "replaced_records"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    replaced_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


# may be absent from a version-1 DB; a DB opened for writing gains them
OPTIONAL_TABLES = {Miss.__tablename__, ReplacedRecord.__tablename__}
MISS_LENGTH_COLUMNS = ("length_calls", "length_mean_sum", "length_max_sum", "length_spread_sum")
OPTIONAL_COLUMNS = {Measurement.__tablename__: ("rung",), Miss.__tablename__: MISS_LENGTH_COLUMNS}
OPTIONAL_INDEXES = {Measurement.__tablename__: ("ix_measurements_problem",)}
# the fields a record carries besides its key
RECORD_FIELDS = ("config", "median_us", "spread_us", "samples", "default_config", "default_median_us",
                 "default_spread_us", "method", "created_at")

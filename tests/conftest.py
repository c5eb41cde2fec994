import os

import pytest
import torch

# the tests never touch a user's DB or mode
os.environ.pop("TUNER_DB", None)
os.environ.pop("TUNER_MODE", None)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def db_path(tmp_path):
    return tmp_path / "tuning.db"


# Set by .ci/run, which starts a local PostgreSQL: the DB suite then runs on both backends.
POSTGRES_URL = os.environ.get("TUNER_TEST_POSTGRES_URL")


@pytest.fixture(params=["sqlite"] + (["postgresql"] if POSTGRES_URL else []))
def make_db(request, tmp_path):
    """make_db(name) -> the target (path or URL) of a new, empty tuning DB on this backend:
    a SQLite file, or a fresh PostgreSQL database dropped after the test."""
    created: list[str] = []

    def make(name: str = "tuning") -> str:
        if request.param == "sqlite":
            return str(tmp_path / f"{name}.db")
        import uuid

        from sqlalchemy import create_engine
        from sqlalchemy.engine import make_url

        dbname = f"tuner_{uuid.uuid4().hex[:16]}"
        admin = create_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.exec_driver_sql(f'CREATE DATABASE "{dbname}"')  # a fixed pattern, not user input
        admin.dispose()
        created.append(dbname)
        return make_url(POSTGRES_URL).set(database=dbname).render_as_string(hide_password=False)

    make.backend = request.param
    yield make
    if created:
        from sqlalchemy import create_engine

        admin = create_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            for dbname in created:
                conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')
        admin.dispose()


@pytest.fixture(autouse=True)
def _isolated_runtime(tmp_path, monkeypatch):
    """Every test starts with a fresh runtime pointed at its own (absent) DB."""
    import tuner

    monkeypatch.setenv("TUNER_DB", str(tmp_path / "runtime.db"))
    monkeypatch.setenv("TUNER_SHIPPED", "off")  # tests that want shipped tunings name their own
    # a test's misses are written when it says so (the timed writer has tests of its own)
    monkeypatch.setattr("tuner.settings.MISS_FLUSH_AFTER_S", 3600.0)
    tuner.configure(db=None, mode="lookup", shipped=None)
    yield
    tuner.configure(db=None, mode="lookup", shipped=None)

# Triton's interpreter must be chosen before triton is first imported, whoever imports it
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

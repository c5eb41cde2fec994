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


@pytest.fixture(autouse=True)
def _isolated_runtime(tmp_path, monkeypatch):
    """Every test starts with a fresh runtime pointed at its own (absent) DB."""
    import tuner

    monkeypatch.setenv("TUNER_DB", str(tmp_path / "runtime.db"))
    tuner.configure(db=None, mode="lookup")
    yield
    tuner.configure(db=None, mode="lookup")

# Triton's interpreter must be chosen before triton is first imported, whoever imports it
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

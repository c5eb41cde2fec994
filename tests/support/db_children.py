"""Targets of child processes that tests kill: light to import (no pytest), so a forkserver
child is up in milliseconds."""

import os

from tuner.db import TuningDB


def create_db(path, ready, go) -> None:
    """Say it is up, wait for the word, then create a tuning DB at path."""
    ready.set()
    go.wait()
    TuningDB(path)
    os._exit(0)

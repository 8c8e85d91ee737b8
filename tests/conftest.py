"""Fixtures shared by every test directory."""

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def _cache_dir(tmp_path_factory):
    """Tokenised corpora are cached under a temporary folder for the session: tests never write to
    the user's cache, and the training and eval tests share one tokenisation."""
    old = os.environ.get("SKIPPIPE_CACHE")
    os.environ["SKIPPIPE_CACHE"] = str(tmp_path_factory.mktemp("skippipe-cache"))
    yield
    if old is None:
        os.environ.pop("SKIPPIPE_CACHE", None)
    else:
        os.environ["SKIPPIPE_CACHE"] = old

"""Shared fixtures: one tokenised corpus per session, cached under a temporary folder."""

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def _cache_dir(tmp_path_factory):
    old = os.environ.get("SKIPPIPE_CACHE")
    os.environ["SKIPPIPE_CACHE"] = str(tmp_path_factory.mktemp("skippipe-cache"))
    yield
    if old is None:
        os.environ.pop("SKIPPIPE_CACHE", None)
    else:
        os.environ["SKIPPIPE_CACHE"] = old


@pytest.fixture(scope="session")
def splits(_cache_dir):
    from node.data import DataConfig, load_splits

    return load_splits(DataConfig())

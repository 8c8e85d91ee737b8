"""Shared fixtures: one tokenised corpus per session, cached under a temporary folder."""

import pytest


@pytest.fixture(scope="session")
def splits(_cache_dir):
    from node.train.data import DataConfig, load_splits

    return load_splits(DataConfig())

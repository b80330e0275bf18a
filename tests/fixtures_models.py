"""Model fixtures: the tiny random model folder (built once per session, offline, < 1 s)."""

import pytest


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    import os

    os.environ.setdefault("TRAJFLOW_CACHE", str(tmp_path_factory.mktemp("trajflow-cache")))
    from backends.modeling.loading import ensure_tiny_random

    return ensure_tiny_random()

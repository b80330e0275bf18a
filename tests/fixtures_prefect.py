"""A real Prefect API for flow tests: one `prefect_test_harness` per session (about 8 s to start)."""

import pytest


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory):
    from prefect.settings import (
        PREFECT_FLOWS_HEARTBEAT_FREQUENCY,
        PREFECT_RESULTS_LOCAL_STORAGE_PATH,
        temporary_settings,
    )
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=90):
        with temporary_settings(updates={
            PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None,
            PREFECT_RESULTS_LOCAL_STORAGE_PATH: tmp_path_factory.mktemp("prefect-results"),
        }):
            yield

"""The flow commands' console set-up, undone after a test that ran a command in this process."""

import pytest


@pytest.fixture
def command_console():
    """Lets a test run `trajflow train|eval` in-process and leave the session's logging as it found it."""
    yield
    from flows.console import reset_console

    reset_console()

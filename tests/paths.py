"""Where the repository is, for tests that start subprocesses in it."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

"""When LocalBackend writes ``run.json``: once step 0 exists, never on a refused request.

A first registration that fails (a typo in base_model, a rank the server cannot serve) leaves the run name free for
the corrected one; a refused registration of a stored run leaves its ``run.json`` byte for byte.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from agents import TrainableModel
from backends.art.local_backend import LocalBackend
from storage.layout import RUN_CONFIG


def register(storage: Path, **fields) -> int:
    """Register in a fresh LocalBackend (as a new script would); the step it is at."""
    async def main():
        backend = LocalBackend(storage=str(storage), device="cpu")
        try:
            model = TrainableModel(**{"name": "agent-001", "project": "my-agent", "base_model": "tiny-random",
                                      **fields})
            await model.register(backend)
            return await model.get_step()
        finally:
            backend.close()

    return asyncio.run(main())


@pytest.mark.parametrize("mistake, error", [
    ({"base_model": "tiny-randon"}, "unknown model 'tiny-randon'"),
    ({"trainer": {"lora_rank": 128}}, "max_lora_rank 64"),
])
def test_a_failed_first_registration_leaves_the_run_name_free(tmp_path, tiny_model_path, mistake, error):
    with pytest.raises(ValueError, match=error):
        register(tmp_path, **mistake)
    assert not (tmp_path / "my-agent" / "agent-001" / RUN_CONFIG).exists()
    assert register(tmp_path) == 0  # the corrected script is not refused


def test_a_refused_registration_leaves_run_json_as_it_was(tmp_path, tiny_model_path, capsys):
    assert register(tmp_path) == 0
    stored = (tmp_path / "my-agent" / "agent-001" / RUN_CONFIG).read_bytes()
    with pytest.raises(ValueError, match="lora_rank: 8 -> 16"):
        register(tmp_path, trainer={"lora_rank": 16})
    with pytest.raises(ValueError, match="'tiny-random', not 'smollm2-135m'"):
        register(tmp_path, base_model="smollm2-135m")
    assert (tmp_path / "my-agent" / "agent-001" / RUN_CONFIG).read_bytes() == stored
    assert register(tmp_path, trainer={"learning_rate": 1e-4}) == 0  # a run may go on with another learning rate
    assert "my-agent/agent-001: at step 0 (the untrained policy) in " in capsys.readouterr().err

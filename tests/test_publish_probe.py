"""The publish probe against the real embedded server: the trainer's own adapter passes, a stale one is refused."""

from types import SimpleNamespace

import openai
import pytest
import torch

from backends.inference_client import InferenceClient
from backends.policy_store import PROBE_MESSAGES, StaleAdapterError, probe_tolerance, publish
from backends.train_config import TrainerConfig
from backends.trainer import GRPOTrainer
from tests.fixtures_server import API_KEY

pytestmark = pytest.mark.usefixtures("single_thread")


async def test_probe_passes_the_trained_adapter_and_refuses_a_stale_one(tiny_server, tiny_model_path,
                                                                        random_adapter, tmp_path):
    trainer = GRPOTrainer(str(tiny_model_path), TrainerConfig(seed=0))
    trainer.save_checkpoint(tmp_path / "ckpt")
    inference = InferenceClient(tiny_server.base_url, API_KEY)
    client = openai.AsyncOpenAI(base_url=tiny_server.base_url, api_key=API_KEY, max_retries=0, timeout=60)
    try:
        metrics = await publish(inference, client, "probe-run@0", None, tmp_path / "ckpt" / "adapter",
                                PROBE_MESSAGES, seed=7, trainer=trainer)
        assert metrics["publish/probe_tolerance"] == 0.05  # float32 trainer, nothing configured
        assert metrics["publish/probe_max_abs_diff"] < 1e-3
        assert metrics["publish/probe_mean_abs_diff"] <= metrics["publish/probe_max_abs_diff"]
        # the server is handed some other adapter under the new name: its answers are not the trainer's
        with pytest.raises(StaleAdapterError, match=r"probe-run@1 differ from the trainer's by up to .*tolerance 0.05"):
            await publish(inference, client, "probe-run@1", None, random_adapter[0], PROBE_MESSAGES, seed=7,
                          trainer=trainer)
    finally:
        await client.close()


def test_tolerance_follows_the_trainer_dtype_unless_configured():
    assert probe_tolerance(SimpleNamespace(dtype=torch.float32), None) == 0.05
    assert probe_tolerance(SimpleNamespace(dtype=torch.bfloat16), None) == 0.25
    assert probe_tolerance(SimpleNamespace(dtype=torch.bfloat16), 0.01) == 0.01

"""The flows people run and deploy: train, evaluate, and the GPU-side train_step.

Importing this package sets defaults (only where unset) that must be in place before Prefect reads its
settings: no telemetry, a generous start-up time for the ephemeral API on busy 2-core machines, and
offline Hugging Face libraries (weights never come from a hub at run time).
"""

import os

for _key, _value in {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",  # Prefect's client-side analytics
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}.items():
    os.environ.setdefault(_key, _value)

"""ART's ``backend.train`` keywords, and what each becomes in trajflow's per-step TrainConfig.

Mapped (an unset one keeps the model's trainer setting for this step, where ART falls back to its own default, e.g.
learning_rate 5e-6): ``learning_rate``; ``loss_fn`` ("cispo", "ppo"; trajflow also has "gspo") -> ``loss``;
``scale_rewards`` and ``normalize_advantages=False`` -> ``scale_rewards``; ``kl_penalty_coef`` -> ``kl_coef``
(KL-shaped advantages against the base model); ``epsilon`` / ``epsilon_high``; ``truncated_importance_sampling`` ->
``tis_cap``. ``verbose`` is accepted.

ART's other keywords are accepted at ART's default value only (:data:`ART_ONLY`): a different value asks for
something trajflow's trainer does not do, and is refused naming the keyword instead of being ignored. Unknown
keywords are a TypeError, as Python's own.
"""

from __future__ import annotations

from typing import Any

from agents.model import TrainConfig

LOSSES = ("cispo", "ppo", "gspo")

# keyword -> ART's default, the one value trajflow accepts (and what it means here)
ART_ONLY: dict[str, Any] = {
    "loss_fn_config": None,
    "adam_params": None,
    "kl_penalty_reference_step": None,  # trajflow's KL reference is the base model
    "kl_ref_adapter_path": None,
    "advantage_balance": 0.0,
    "importance_sampling_level": "token",  # sequence level: loss="gspo" in the model's trainer settings
    "max_negative_advantage_importance_sampling_weight": None,
    "mask_prob_ratio": False,
    "kimi_k2_tau": None,
    "precalculate_logprobs": False,  # trajflow trains on the sampler's logprobs, exact tokens
    "allow_training_without_logprobs": False,
    "plot_tensors": False,
    "scale_learning_rate_by_reward_std_dev": False,
    "logprob_calculation_chunk_size": 1024,  # trajflow's is trainer.logprob_chunk
    "packed_sequence_length": None,  # trajflow packs by trainer.micro_batch_tokens
    "num_trajectories_learning_rate_multiplier_power": 0.0,
    "save_checkpoint": True,  # every trajflow step is a checkpoint: it is how a step exists
}


def train_config(*, learning_rate: float | None = None, loss_fn: str | None = None,
                 normalize_advantages: bool = True, scale_rewards: bool | None = None,
                 kl_penalty_coef: float | None = None, epsilon: float | None = None, epsilon_high: float | None = None,
                 truncated_importance_sampling: float | None = None, verbose: bool = False,
                 **art_only: Any) -> TrainConfig:
    """The TrainConfig of ``backend.train(model, groups, **keywords)`` (module docstring)."""
    for name, value in art_only.items():
        if name not in ART_ONLY:
            raise TypeError(f"backend.train() got an unexpected keyword argument {name!r}")
        if value != ART_ONLY[name]:
            raise ValueError(f"backend.train: {name}={value!r} is not supported by trajflow's trainer (only ART's "
                             f"default {ART_ONLY[name]!r}); see backends/art/train_options.py")
    if loss_fn is not None and loss_fn not in LOSSES:
        raise ValueError(f"backend.train: loss_fn must be one of {', '.join(LOSSES)}, got {loss_fn!r}")
    if not normalize_advantages:
        if scale_rewards:
            raise ValueError("backend.train: normalize_advantages=False contradicts scale_rewards=True")
        scale_rewards = False
    return TrainConfig(learning_rate=learning_rate, loss=loss_fn, scale_rewards=scale_rewards,
                       kl_coef=kl_penalty_coef,
                       epsilon=epsilon, epsilon_high=epsilon_high, tis_cap=truncated_importance_sampling)

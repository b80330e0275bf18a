"""SFTConfig: the knobs of a supervised warm start (backends/training/sft.py), each with its trade-off."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field


class SFTConfig(BaseModel):
    """How demonstrations train the LoRA adapter before GRPO."""

    model_config = ConfigDict(extra="forbid")

    epochs: int = Field(default=3, ge=1, description="passes over the demonstrations; more imitates them more "
                        "closely and, on few demonstrations, memorises them (less room for RL to explore)")
    learning_rate: float = Field(default=1e-4, gt=0, description="AdamW learning rate (constant). LoRA SFT takes "
                                 "1e-5..2e-4; higher learns in fewer epochs but forgets more of the base model")
    batch_size: int = Field(default=8, ge=1, description="conversations per optimizer step (gradient accumulated "
                            "over packed micro-batches); larger is steadier, with fewer steps per epoch")
    micro_batch_tokens: int | None = Field(default=None, ge=1, description="tokens per packed forward; None: the "
                                           "trainer's micro_batch_tokens. Larger is faster, needs more memory")
    max_length: int | None = Field(default=None, ge=2, description="longest conversation in tokens; longer ones are "
                                   "bad lines (refused or skipped). None: the model's max positions")
    on_bad_line: Literal["error", "skip"] = Field(default="error", description="a bad demonstration (malformed, "
                                                  "unknown tool, too long...): `error` stops naming its line, "
                                                  "`skip` counts it (sft/skipped) and trains on the rest")
    seed: int = Field(default=0, description="seeds the order of conversations in each epoch")
    save_every_steps: int = Field(default=0, ge=0, description="also save progress every N optimizer steps (0: at "
                                  "the end of each epoch only); a killed run redoes at most this many steps")
    log_every_steps: int = Field(default=10, ge=0, description="log the loss every N optimizer steps (0: per epoch "
                                 "only)")

    # Settings that do not change what is learned (only where it is saved, what is logged, how tokens are batched
    # up to float rounding): a run may resume under other values.
    NON_IDENTITY_FIELDS: ClassVar[tuple[str, ...]] = ("micro_batch_tokens", "save_every_steps", "log_every_steps")

    def identity(self) -> dict[str, Any]:
        """The settings that define the SFT'd policy."""
        return {k: v for k, v in self.model_dump(mode="json").items() if k not in self.NON_IDENTITY_FIELDS}

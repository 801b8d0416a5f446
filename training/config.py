"""Typed training configuration, validated once at the edge (CLI or JSON file)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from training.losses import LossName


class TrainConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    data_dir: Path
    out_dir: Path
    label_column: str = "label"
    # model
    width: int = Field(default=128, ge=1)
    depth: int = Field(default=2, ge=1)
    dropout: float = Field(default=0.1, ge=0, lt=1)
    # objective and sampling
    loss: LossName = "logit_adjusted"
    tau: float = Field(default=1.0, ge=0)
    focal_gamma: float = Field(default=2.0, ge=0)
    sampler_q: float = Field(default=1.0, ge=0, le=1, description="class draw prob ∝ n_c^q")
    # optimisation
    epochs: int = Field(default=30, ge=1)
    global_batch_size: int = Field(default=256, ge=1)
    lr: float = Field(default=3e-3, gt=0)
    weight_decay: float = Field(default=1e-4, ge=0)
    warmup_fraction: float = Field(default=0.05, ge=0, lt=1)
    grad_clip: float | None = Field(default=1.0, gt=0)
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    patience: int | None = Field(
        default=8, ge=1, description="early stopping on val balanced accuracy; None disables"
    )
    seed: int = 0
    # distributed
    nproc: int = Field(default=1, ge=1)
    speed_balance: bool = True
    slow_rank: int | None = Field(
        default=None, ge=0, description="rank to slow down, to reproduce a mixed fleet"
    )
    slow_factor: float = Field(default=1.0, ge=1.0)
    threads_per_rank: int | None = Field(default=None, ge=1)
    resume: bool = False
    progress: bool = True

    @model_validator(mode="after")
    def _consistent(self) -> TrainConfig:
        if self.global_batch_size < self.nproc:
            raise ValueError(
                f"global_batch_size ({self.global_batch_size}) must be at least nproc ({self.nproc}); "
                "raise --batch-size or lower --nproc"
            )
        if self.slow_rank is not None and self.slow_rank >= self.nproc:
            raise ValueError(
                f"slow_rank {self.slow_rank} does not exist with nproc={self.nproc}; use 0..{self.nproc - 1}"
            )
        return self

    @property
    def checkpoint_dir(self) -> Path:
        return self.out_dir / "checkpoints"

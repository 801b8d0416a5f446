"""Typed training configuration, validated once at the edge (CLI or JSON file)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from training.device import DeviceChoice, PrecisionChoice
from training.losses import LossName

# Measured on the long-tailed synthetic tables (docs/training.md#distillation): T = 1 and an even
# split with the balanced loss agreed best with the teacher (T = 2 or 4, or w = 0.8-0.9, less); the
# labels stay in charge where the teacher is wrong.
DISTILL_WEIGHT = 0.5
DISTILL_TEMPERATURE = 1.0


class TrainConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    data_dir: Path
    out_dir: Path
    label_column: str = "label"
    # data beyond tables (training/images.py, training/shards.py)
    image_size: int | None = Field(
        default=None, ge=1, description="resize images to SIZE x SIZE; None: most common size"
    )
    channels: int | None = Field(
        default=None, description="1 (grey) or 3 (RGB); None: 1 if every image is grey"
    )
    augment: bool = Field(default=True, description="train-time augmentation of images (random shift)")
    skip_bad_files: bool = Field(
        default=False, description="skip (and count) unreadable images instead of failing"
    )
    val_fraction: float | None = Field(
        default=None,
        gt=0,
        lt=1,
        description="tables without a val file: split this share of each class off train",
    )
    data_workers: int | Literal["auto"] = Field(
        default="auto",
        description="DataLoader worker processes per rank; auto: 0 for tables (in memory), else "
        "min(4, cores per rank)",
    )
    # model: a built-in family or a user's MODULE:FACTORY (training/factory.py)
    model: str = Field(default="mlp", min_length=1)
    model_args: dict[str, Any] = Field(default_factory=dict)
    # mlp shortcuts (the same as --model-arg width=... etc.)
    width: int = Field(default=128, ge=1)
    depth: int = Field(default=2, ge=1)
    dropout: float = Field(default=0.1, ge=0, lt=1)
    # objective and sampling
    loss: LossName = "logit_adjusted"
    tau: float = Field(default=1.0, ge=0)
    focal_gamma: float = Field(default=2.0, ge=0)
    sampler_q: float = Field(default=1.0, ge=0, le=1, description="class draw prob ∝ n_c^q")
    # knowledge distillation from a trained artifact (training/distill.py)
    distill_from: Path | None = Field(
        default=None, description="teacher artifact: the student also matches its balanced outputs"
    )
    distill_weight: float = Field(
        default=DISTILL_WEIGHT, ge=0, le=1, description="share of the teacher's soft term in the loss"
    )
    distill_temperature: float = Field(
        default=DISTILL_TEMPERATURE, gt=0, description="softmax temperature of the soft term"
    )
    # optimisation
    epochs: int | None = Field(
        default=None, ge=1, description="train exactly this many epochs (overrides the step budget)"
    )
    max_steps: int | None = Field(
        default=None, ge=1, description="optimizer-step budget; None: max(min_steps, budget_epochs epochs)"
    )
    min_steps: int = Field(
        default=1000, ge=1, description="floor of the automatic budget; no early stop before it"
    )
    budget_epochs: int = Field(default=30, ge=1, description="passes over the data in the automatic budget")
    global_batch_size: int = Field(default=256, ge=1)
    lr: float = Field(default=3e-3, gt=0)
    weight_decay: float | Literal["auto"] = Field(
        default="auto",
        description="AdamW's decoupled decay: each step shrinks weights by lr * weight_decay; "
        "auto: min(3, 6 * sqrt(features / training rows)), twice the auto input noise",
    )
    warmup_fraction: float = Field(default=0.05, ge=0, lt=1)
    input_noise: float | Literal["auto"] = Field(
        default="auto",
        description="std of Gaussian noise added to training inputs, in units of each feature's std; "
        "auto: min(1.5, 3 * sqrt(features / training rows)), strong on small data, near 0 on large",
    )
    grad_clip: float | None = Field(default=1.0, gt=0)
    precision: PrecisionChoice = Field(
        default="auto",
        description="auto: bf16 on GPUs that support it, else fp16 with a gradient scaler; fp32 on CPU",
    )
    device: DeviceChoice = Field(
        default="auto", description="auto: each rank on the CUDA GPU LOCAL_RANK when CUDA is visible"
    )
    patience: int | Literal["auto"] | None = Field(
        default="auto",
        description="early-stopping patience in optimizer steps on smoothed val balanced accuracy; "
        "auto: max(min_steps / 2, a quarter of the budget); None disables",
    )
    early_stop_min_val_rows: int = Field(
        default=200, ge=0, description="below this many val rows early stopping is off (too noisy)"
    )
    checkpoint_every_steps: int = Field(
        default=25, ge=1, description="checkpoint at the first epoch end after this many steps"
    )
    seed: int = 0
    # distributed
    nproc: int = Field(default=1, ge=1, description="ranks per node")
    nnodes: int = Field(default=1, ge=1, description="nodes (torchrun agents) in the job")
    node_rank: int | None = Field(
        default=None, ge=0, description="this node's rank; only with rdzv_backend static"
    )
    rdzv_endpoint: str | None = Field(
        default=None, description="host:port of the rendezvous store, the same on every node"
    )
    rdzv_backend: Literal["c10d", "static"] = "c10d"
    rdzv_id: str = Field(default="skewserve", min_length=1, description="job id shared by all nodes")
    local_addr: str | None = Field(
        default=None, description="address other nodes reach this node at (torchrun --local-addr)"
    )
    max_restarts: int = Field(default=0, ge=0, description="elastic restarts of the whole job")
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
        ranks = f"nproc ({self.nproc})" if self.nnodes == 1 else f"nproc x nnodes ({self.world_size})"
        if self.global_batch_size < self.world_size:
            raise ValueError(
                f"global_batch_size ({self.global_batch_size}) must be at least {ranks}; "
                "raise --batch-size or lower --nproc"
            )
        if self.slow_rank is not None and self.slow_rank >= self.world_size:
            where = f"nproc={self.nproc}" + (f" x nnodes={self.nnodes}" if self.nnodes > 1 else "")
            raise ValueError(
                f"slow_rank {self.slow_rank} does not exist with {where}; use 0..{self.world_size - 1}"
            )
        if self.channels is not None and self.channels not in (1, 3):
            raise ValueError(f"channels must be 1 (grey) or 3 (RGB), got {self.channels}")
        if isinstance(self.data_workers, int) and self.data_workers < 0:
            raise ValueError(f"data_workers must be >= 0 or 'auto', got {self.data_workers}")
        if isinstance(self.weight_decay, float) and self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0 or 'auto', got {self.weight_decay}")
        if isinstance(self.input_noise, float) and self.input_noise < 0:
            raise ValueError(f"input_noise must be >= 0 or 'auto', got {self.input_noise}")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError(
                f"nnodes={self.nnodes} needs rdzv_endpoint (host:port of the rendezvous on one node); "
                "pass --rdzv-endpoint with the same value on every node"
            )
        if self.rdzv_backend == "static" and self.nnodes > 1 and self.node_rank is None:
            raise ValueError("rdzv_backend static needs node_rank (0..nnodes-1) on every node")
        if self.distill_from is None and (
            self.distill_weight != DISTILL_WEIGHT or self.distill_temperature != DISTILL_TEMPERATURE
        ):
            raise ValueError(
                "distill_weight and distill_temperature take effect only with distill_from; "
                "pass --distill-from TEACHER_ARTIFACT or drop them"
            )
        if self.node_rank is not None and self.node_rank >= self.nnodes:
            raise ValueError(
                f"node_rank {self.node_rank} does not exist with nnodes={self.nnodes}; use 0..{self.nnodes - 1}"
            )
        return self

    def factory_args(self, input_noise: float | None = None) -> dict[str, Any]:
        """The model factory's arguments: --model-arg, over the mlp shortcuts (and its input noise)."""
        if self.model != "mlp":
            return dict(self.model_args)
        shortcuts: dict[str, Any] = {"width": self.width, "depth": self.depth, "dropout": self.dropout}
        if input_noise is not None:
            shortcuts["input_noise"] = input_noise
        return shortcuts | self.model_args

    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes

    @property
    def checkpoint_dir(self) -> Path:
        return self.out_dir / "checkpoints"

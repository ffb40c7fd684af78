"""`dist:` how the trainer's ranks are arranged: the process-group backend and the tensor-parallel size.

The data-parallel size is not a key: it is torchrun's world size / `tp`, known only at launch.
"""

from typing import Literal

from pydantic import Field

from graft.config.base import Section


class DistConfig(Section):
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="torch.distributed backend; auto = nccl on GPU, gloo on CPU."
    )
    tp: int = Field(
        1, ge=1,
        description="Tensor-parallel ranks per group: each decoder layer (and its LoRA) is split over tp ranks, "
                    "which see the same rows; the world size / tp data-parallel groups split each batch (FSDP2). "
                    "Must divide the world size, the attention and KV heads and the MLP width; Qwen2 and Llama.",
    )

"""The local trainer: FSDP2 (full or LoRA) under torchrun, or in-process at world size 1.

Public API: `FsdpTrainerClient`, `TrainerConfig`, `LoraSettings`, `CheckpointInfo`, `TrainerError`.
Modules: `config` (settings), `batch` (datums on disk, sharding, collation), `model` (build,
shard, export), `step` (`TrainerCore`, the step code of one rank), `protocol` (client <-> group
files), `worker` (torchrun entry point), `client` (`FsdpTrainerClient`).
"""

from clawbridge_local.trainer.client import CheckpointInfo, FsdpTrainerClient, Nodes
from clawbridge_local.trainer.config import LoraSettings, TrainerConfig
from clawbridge_local.trainer.protocol import TrainerError

__all__ = ["CheckpointInfo", "FsdpTrainerClient", "LoraSettings", "Nodes", "TrainerConfig", "TrainerError"]

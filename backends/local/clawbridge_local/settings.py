"""The local backend's options: TOML `[backends.local]`, environment `CLAWBRIDGE_LOCAL_<OPTION>`.

Invariants:
- Every option the local backend reads that the core does not is here, nowhere else; the
  backend, its trainer and `export-weights` read them with `local_settings(settings)`. Options
  the core also reads (`lora_rank`, `lora_target_modules`, `learning_rate`, ...) stay on `Settings`.
- Each option keeps the environment variable it had when it was a flat option
  (`CLAWBRIDGE_ENGINE`, `CLAWBRIDGE_SGLANG_URL`, ...) as a second name after
  `CLAWBRIDGE_LOCAL_<OPTION>` (the new name wins when both are set); its old flat TOML key is
  refused naming `[backends.local] <option>` (`clawbridge.backend_settings.moved_option`).
- This module imports neither torch nor any other part of the backend: `clawbridge config show`
  lists it through the `clawbridge.backend_settings` entry point without loading the backend.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from clawbridge.backend_settings import backend_section
from clawbridge.config import Settings

NAME = "local"
"""The backend's name: its entry point, its TOML section and its environment prefix."""


def _env(option: str) -> dict[str, Any]:
    """`json_schema_extra` naming the option's variables: the section's own, then the old flat one."""
    return {"env": [f"CLAWBRIDGE_LOCAL_{option.upper()}", f"CLAWBRIDGE_{option.upper()}"]}


def _new_env(option: str) -> dict[str, Any]:
    """`json_schema_extra` of an option added after the move (no old flat name)."""
    return {"env": [f"CLAWBRIDGE_LOCAL_{option.upper()}"]}


class LocalSettings(BaseModel):
    """Options of the local backend (`[backends.local]`)."""

    model_config = ConfigDict(extra="forbid")

    # --- serving
    engine: Literal["auto", "torch", "sglang"] = Field(
        "auto", description="Serving engine: torch (in-process), sglang, or auto (sglang when sglang_url is set or "
        "a GPU and the sglang package are present, else torch).", json_schema_extra=_env("engine"))
    device: str = Field("auto", description="torch engine device: auto, cpu or cuda[:N].",
                        json_schema_extra=_env("device"))
    dtype: str = Field("auto", description="torch engine dtype: auto, float32, bfloat16 or float16.",
                       json_schema_extra=_env("dtype"))
    engine_batch_decode: bool = Field(
        True, description="Torch engine: run the decode steps of concurrent requests as one batched forward (several "
        "times the tokens/s on CPU; logprobs equal unbatched ones to 1e-4; bench/engine_batching.py measures it).",
        json_schema_extra=_env("engine_batch_decode"))
    engine_cuda_graphs: bool = Field(
        True, description="Torch engine on CUDA: replay decode steps from CUDA graphs (per batch and length "
        "bucket) and pack the prefills of a round into one forward; logprobs equal the eager steps' to float "
        "summation order. false: eager steps (as on CPU, where this does nothing).",
        json_schema_extra=_new_env("engine_cuda_graphs"))
    engine_threads: int = Field(
        0, ge=0, description="torch CPU threads of the local backend (0: OMP_NUM_THREADS if set, else one per two "
        "cores; measured in bench/engine_threads.py).", json_schema_extra=_env("engine_threads"))
    max_running_requests: int = Field(8, ge=1, description="Requests decoded at the same time by the engine.",
                                      json_schema_extra=_env("max_running_requests"))
    max_queued_requests: int = Field(64, ge=0, description="Requests waiting for a slot before new ones get 429.",
                                     json_schema_extra=_env("max_queued_requests"))
    kv_budget_tokens: int = Field(
        0, ge=0, description="torch engine: token positions of the preallocated KV cache shared by all requests "
        "(0: auto, kv_memory_fraction of the memory free after the weights and the trainer, at most "
        "max_running_requests x min(context, 2048), at least one whole context); requests wait when it is full; "
        "memory is this x 2 x layers x kv heads x head dim x kv_dtype size (`clawbridge status` shows the figure "
        "and why).", json_schema_extra=_env("kv_budget_tokens"))
    kv_memory_fraction: float = Field(
        0.25, gt=0.0, le=0.95, description="torch engine, kv_budget_tokens 0: the share of the memory free once the "
        "weights are loaded, less the trainer's estimate, that the KV cache may take (as SGLang's "
        "--mem-fraction-static).", json_schema_extra=_new_env("kv_memory_fraction"))
    kv_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="torch engine: the dtype keys and values are kept in (auto: bfloat16 for a float32 "
        "model on the CPU, else the model's dtype; bfloat16 halves the KV cache, logprobs recorded are those of the "
        "keys and values used; docs/engine-memory.md measures the difference).",
        json_schema_extra=_new_env("kv_dtype"))
    malloc_mmap_threshold_kib: int = Field(
        1024, ge=0, description="Allocations of this many KiB or more get memory of their own from the OS, given back "
        "when freed (glibc's M_MMAP_THRESHOLD, fixed): without it the in-process trainer's per-step activations "
        "fragment the heap and the process grows at every training step (0: glibc's default, which raises the "
        "threshold as large blocks are freed; docs/engine-memory.md).",
        json_schema_extra=_new_env("malloc_mmap_threshold_kib"))
    max_loaded_versions: int = Field(
        2, ge=1, description="Committed versions other than the published one kept loaded for `model: NAME@N` and "
        "promotion, least recently used dropped (LoRA: an adapter each, over the one base; torch engine with full "
        "weights: a copy of the model's weights each).",
        json_schema_extra={"env": ["CLAWBRIDGE_LOCAL_MAX_LOADED_VERSIONS"]})

    max_lane_trainers: int = Field(
        2, ge=1, description="per_user_adapters: users' trainers (adapter + optimizer state) kept in memory at once; "
        "the least recently used idle one is closed and restored from its last checkpoint at its user's next step "
        "(lanes train one at a time; docs/users.md).", json_schema_extra=_new_env("max_lane_trainers"))

    # --- sglang
    sglang_url: str = Field("", description="engine sglang: URL of an already running SGLang server to use "
                            "(default: launch one).", json_schema_extra=_env("sglang_url"))
    sglang_urls: list[str] = Field(default_factory=list, description="engine sglang: URLs of several running "
                                   "SGLang servers of the model (replicas): each request goes to the least busy one, and "
                                   "every publish loads on all of them before the new version serves (instead of "
                                   "sglang_url).", json_schema_extra=_new_env("sglang_urls"))
    sglang_port: int = Field(0, ge=0, description="engine sglang: port of the launched server (0: a free one).",
                             json_schema_extra=_env("sglang_port"))
    sglang_tp_size: int = Field(1, ge=1, description="engine sglang: tensor-parallel GPUs per replica (--tp-size).",
                                json_schema_extra=_env("sglang_tp_size"))
    sglang_dp_size: int = Field(1, ge=1, description="engine sglang: data-parallel replicas (--dp-size; LoRA "
                                "publishing needs 1).", json_schema_extra=_env("sglang_dp_size"))
    sglang_mem_fraction: float = Field(0.0, ge=0.0, lt=1.0, description="engine sglang: --mem-fraction-static "
                                       "(0: SGLang's default).", json_schema_extra=_env("sglang_mem_fraction"))
    sglang_max_loras_per_batch: int = Field(
        8, ge=1, description="engine sglang with LoRA: adapters one batch may mix, each in a GPU slot "
        "(--max-loras-per-batch); an adapter without a slot waits until one frees.",
        json_schema_extra=_new_env("sglang_max_loras_per_batch"))
    sglang_max_loaded_loras: int = Field(
        0, ge=0, description="engine sglang with LoRA: adapters the server holds in CPU memory at once "
        "(--max-loaded-loras; 0: the served version + max_loaded_versions + max_user_adapters with per-user adapters, "
        "at least sglang_max_loras_per_batch); clawbridge unloads the least recently used idle one before loading "
        "past it, and loads a kept one again when it is called.",
        json_schema_extra=_new_env("sglang_max_loaded_loras"))
    sglang_lora_eviction_policy: Literal["lru", "fifo"] = Field(
        "lru", description="engine sglang with LoRA: which adapter leaves its GPU slot for another "
        "(--lora-eviction-policy).", json_schema_extra=_new_env("sglang_lora_eviction_policy"))
    sglang_extra_args: list[str] = Field(default_factory=list, description="engine sglang: more "
                                         "`sglang.launch_server` arguments.", json_schema_extra=_env("sglang_extra_args"))
    sglang_startup_timeout_s: float = Field(900.0, gt=0, description="engine sglang: wait this long for the "
                                            "launched server to be healthy.",
                                            json_schema_extra=_env("sglang_startup_timeout_s"))

    # --- training
    max_grad_norm: float = Field(1.0, ge=0.0, description="Clip the global gradient norm to this (0: off).",
                                 json_schema_extra=_env("max_grad_norm"))
    micro_batch_size: int = Field(8, ge=1, description="Datums per forward/backward; larger batches accumulate.",
                                  json_schema_extra=_env("micro_batch_size"))
    activation_checkpointing: Literal["auto"] | bool = Field(
        "auto", description="Recompute each decoder layer's activations in the backward pass instead of keeping "
        "them all from the forward: a step holds about one layer's activations, for one more forward of compute "
        "(both measured in bench/engine_memory.py and bench/train_throughput.py). auto: on CUDA keep them when a "
        "micro-batch's estimate fits half the free GPU memory (recompute after running out), on CPU recompute.",
        json_schema_extra=_new_env("activation_checkpointing"))
    train_world_size: int = Field(
        1, ge=1, description="Trainer processes (torchrun, FSDP2); 1 trains in the proxy's process unless "
        "train_launcher says torchrun.", json_schema_extra=_env("train_world_size"))
    train_launcher: Literal["auto", "inprocess", "torchrun"] = Field(
        "auto",
        description="How the trainer runs at world size 1: inprocess (auto: a thread of the proxy) or torchrun "
        "(its own process). On CPU with the torch engine, torchrun lets decoding and training overlap instead of "
        "taking turns on the GIL (the real demo uses it). Larger world sizes always use torchrun.",
        json_schema_extra=_env("train_launcher"))
    train_nnodes: int = Field(
        1, ge=1, description="Machines the trainer's ranks run on (torchrun --nnodes); this one is node 0 and "
        "each other runs `python -m clawbridge_local.trainer.node --work-dir <state_dir>/trainer/local "
        "--node-rank K`, with the state dir on a filesystem every node mounts at the same path. "
        "train_world_size counts the ranks of all nodes.", json_schema_extra=_new_env("train_nnodes"))
    train_master_addr: str = Field(
        "127.0.0.1", description="With train_nnodes > 1: this machine's address as the other nodes reach it "
        "(torchrun --master-addr).", json_schema_extra=_new_env("train_master_addr"))
    train_master_port: int = Field(
        29500, ge=1, le=65535, description="With train_nnodes > 1: the rendezvous port on this machine "
        "(torchrun --master-port).", json_schema_extra=_new_env("train_master_port"))

    @model_validator(mode="after")
    def _nodes_split_the_world(self) -> LocalSettings:
        if self.sglang_url and self.sglang_urls:
            raise ValueError("set sglang_url (one server) or sglang_urls (replicas), not both")
        if self.train_nnodes > 1:
            if self.train_launcher == "inprocess":
                raise ValueError("train_nnodes > 1 needs train_launcher torchrun (or auto)")
            if self.train_world_size % self.train_nnodes:
                raise ValueError(f"train_world_size {self.train_world_size} does not split over train_nnodes "
                                 f"{self.train_nnodes} (each node runs the same number of ranks)")
        return self


def local_settings(settings: Settings) -> LocalSettings:
    """The local backend's options under `settings` (`clawbridge.backend_settings` says where
    they come from); raises `BackendSettingsError` naming a bad one."""
    return backend_section(settings, NAME, LocalSettings)

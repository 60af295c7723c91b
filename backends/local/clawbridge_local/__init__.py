"""clawbridge's `local` backend: serve (torch engine) and train (FSDP2 / LoRA) on this machine.

Submodules are imported where used (`clawbridge_local.engine`, `clawbridge_local.trainer`), so a
trainer worker process does not pay for the serving engine's imports and vice versa.
"""

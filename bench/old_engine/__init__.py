"""THE OLD TORCH ENGINE, kept only as the baseline of bench/engine_memory.py (issue 22 §1).

A frozen copy of `clawbridge_local.engine` and `clawbridge_local.batching` as they were before the
KV pool (commit 284f33b + the versions change): one transformers `DynamicCache` per request, batched
decode by padding and concatenating every running cache per layer. Nothing in clawbridge imports it.
"""

"""Promotion: a new policy version serves only once it is shown not to be worse.

`evalset` (what versions are scored on), `runner` (greedy answers through the version router,
scored), `stats` (Wilson intervals, the canary's sequential test), `promoter` (the modes, the
trainer's gate, admin promote/rollback). Decisions live in the store (`clawbridge.store.promotion`).
"""

"""Batches on disk, their split across ranks and micro-batches, and collation into tensors.

Invariants:
- The batch file is JSON (no pickle): the exact `Datum` fields (spans too), floats round-trip exactly.
- `shard` is a pure function of (lengths, world_size): every rank computes the same assignment,
  each datum goes to exactly one rank, token counts are balanced greedily (longest first).
- `micro_batches` gives every rank the SAME number of micro-batches (FSDP needs every rank in
  every forward/backward); a rank with fewer datums gets empty micro-batches, which collate to a
  one-position dummy with mask 0 (zero loss, zero gradient, collectives still run).
- Collation right-pads to the longest sequence; padded positions have attention 0 and mask 0.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from clawbridge.backend import Datum, Span, check_datum


def write_batch(path: Path, batch: Sequence[Datum]) -> None:
    """Write `batch` as JSON to `path` (the caller makes the request visible atomically)."""
    path.write_text(json.dumps([asdict(d) for d in batch]))


def read_batch(path: Path) -> list[Datum]:
    """Inverse of `write_batch`, validating per-position lengths."""
    out: list[Datum] = []
    for raw in json.loads(path.read_text()):
        d = Datum(
            tokens=tuple(int(t) for t in raw["tokens"]),
            prompt_len=int(raw["prompt_len"]),
            sampler_logprobs=tuple(float(x) for x in raw["sampler_logprobs"]),
            advantages=tuple(float(x) for x in raw["advantages"]),
            mask=tuple(float(x) for x in raw["mask"]),
            policy_version=int(raw["policy_version"]),
            turn_id=str(raw.get("turn_id", "")),
            spans=tuple(
                Span(int(sp["start"]), int(sp["end"]), int(sp["policy_version"]), str(sp.get("turn_id", "")))
                for sp in raw.get("spans", ())
            ),
        )
        validate_datum(d)
        out.append(d)
    return out


def validate_datum(d: Datum) -> None:
    """Raise ValueError unless the per-position fields and spans line up (`check_datum`)."""
    check_datum(d)


def shard(lengths: Sequence[int], world_size: int) -> list[list[int]]:
    """Datum indices per rank, balancing token counts (deterministic, in original order)."""
    loads = [0] * world_size
    owners: list[list[int]] = [[] for _ in range(world_size)]
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        r = min(range(world_size), key=lambda k: (loads[k], k))
        loads[r] += lengths[i]
        owners[r].append(i)
    return [sorted(o) for o in owners]


def micro_batches(
    batch: Sequence[Datum], rank: int, world_size: int, micro_batch_size: int
) -> list[list[Datum]]:
    """This rank's micro-batches; the same count on every rank (some possibly empty)."""
    if micro_batch_size < 1:
        raise ValueError("micro_batch_size must be >= 1")
    owners = shard([len(d.tokens) for d in batch], world_size)
    count = max(1, max(-(-len(o) // micro_batch_size) for o in owners))
    mine = [batch[i] for i in owners[rank]]
    return [list(mine[k * micro_batch_size : (k + 1) * micro_batch_size]) for k in range(count)]


@dataclass(frozen=True)
class Collated:
    """A padded micro-batch, [B, T] tensors with T = longest len(tokens) - 1."""

    input_ids: torch.Tensor
    """model_input, right-padded with token 0."""
    attention_mask: torch.Tensor
    """1 on real positions."""
    targets: torch.Tensor
    """target_tokens (0 on padding)."""
    sampler_logprobs: torch.Tensor
    """float32, 0 on padding."""
    advantages: torch.Tensor
    """float32, 0 on padding."""
    mask: torch.Tensor
    """float32 loss mask, 0 on padding."""

    def to(self, device: torch.device) -> Collated:
        """The same tensors on `device`."""
        return Collated(*(t.to(device) for t in self.__dict__.values()))


def collate(micro: Sequence[Datum]) -> Collated:
    """Pad `micro` into tensors; an empty list gives the one-position dummy (mask 0)."""
    if not micro:
        z = torch.zeros((1, 1))
        return Collated(z.long(), torch.ones((1, 1), dtype=torch.long), z.long(), z, z.clone(), z.clone())
    width = max(len(d.tokens) - 1 for d in micro)
    shape = (len(micro), width)
    ids, att, tgt = (torch.zeros(shape, dtype=torch.long) for _ in range(3))
    slp, adv, msk = (torch.zeros(shape, dtype=torch.float32) for _ in range(3))
    for b, d in enumerate(micro):
        n = len(d.tokens) - 1
        ids[b, :n] = torch.tensor(d.model_input)
        tgt[b, :n] = torch.tensor(d.target_tokens)
        att[b, :n] = 1
        slp[b, :n] = torch.tensor(d.sampler_logprobs, dtype=torch.float32)
        adv[b, :n] = torch.tensor(d.advantages, dtype=torch.float32)
        msk[b, :n] = torch.tensor(d.mask, dtype=torch.float32)
    return Collated(ids, att, tgt, slp, adv, msk)

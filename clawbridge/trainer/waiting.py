"""How long ready samples wait before they train: the short-batch and whole-group rules.

Both measure time on the store's monotonic clock (`clawbridge.runtime.clock`), so tests move it instead
of sleeping, and both are bounded by one setting, `batch_wait_s` (`wait_s` here).

Invariants:
- Short batch: once fewer than `batch_size` usable samples have been ready for `wait_s` (> 0),
  they train as a short batch (`short_batch_due`). The wait starts when such samples are first
  seen and restarts whenever a full batch forms or nothing is ready (`reset_short`). With
  `wait_s` 0 a batch is always full. Without this the last turns before agents go quiet stayed
  untrained until more came (7 of 52 rewarded turns in bench/waste.py).
- Whole groups (group baselines only, `settled_groups`): the ready samples of a task that is
  still unsettled (`TrainingStore.unsettled_tasks`: one of its sessions active, or ended but not
  yet rewarded or judged) are held for the rest of their group, for at most `wait_s` from when
  they were first held (0: never held). A group trained piecemeal compares each part only with
  itself, and a part rewarded alike has no signal: in a real-demo run (4 concurrent sessions per
  question, judged as they ended) 104 of 128 trainable turns came in such parts, dropped as
  `no_signal`, though 8 of its 16 questions had mixed verdicts, and 3 steps trained.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from clawbridge.store.training import PendingSample


@dataclass
class BatchWaits:
    """The two waits' state, kept by the trainer loop between polls."""

    wait_s: float
    """`batch_wait_s`: the longest a ready sample waits for its batch or its group (0: see above)."""
    short_since: float | None = None
    """When fewer than batch_size ready samples were first seen (None: none waiting)."""
    held_since: dict[str, float] = field(default_factory=dict)
    """Unsettled task id -> when its ready samples were first held for the rest of its group."""
    held_for_group: int = 0
    """Ready samples the last selection held for the rest of their group."""

    def settled_groups(self, usable: Sequence[PendingSample], unsettled: set[str], now: float) -> list[PendingSample]:
        """`usable` less the samples of `unsettled` tasks first held less than `wait_s` ago."""
        unsettled = unsettled if self.wait_s > 0 else set()
        self.held_since = {t: self.held_since.get(t, now) for t in unsettled}
        held = {t for t, since in self.held_since.items() if now - since < self.wait_s}
        keep = [s for s in usable if s.task_id not in held]
        self.held_for_group = len(usable) - len(keep)
        return keep

    def reset_short(self) -> None:
        """A full batch formed, or nothing is ready: no short batch is waiting."""
        self.short_since = None

    def short_batch_due(self, now: float) -> bool:
        """Fewer than batch_size samples are ready now: whether they have waited `wait_s` (the wait
        starts at the first call; a due short batch resets it)."""
        if self.short_since is None:
            self.short_since = now
        if self.wait_s <= 0 or now - self.short_since < self.wait_s:
            return False
        self.short_since = None
        return True

    def short_batch_in(self, now: float) -> float | None:
        """Seconds until the ready samples train as a short batch (None: none are waiting for one)."""
        if self.short_since is None or self.wait_s <= 0:
            return None
        return round(max(0.0, self.wait_s - (now - self.short_since)), 2)

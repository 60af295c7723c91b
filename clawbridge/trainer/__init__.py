"""The backend-independent trainer loop: ended sessions -> datums -> steps -> published versions.

- `advantages`: the named reward, discount, baseline and normalization rules (pure).
- `datums`: ready samples -> a batch of `Datum`s.
- `loop`: `TrainerLoop`, the background task, and `TrainerConfig`.
- `fake`: `FakeTrainingBackend` for tests and demos of the loop.
"""

from clawbridge.trainer.fake import FakeTrainingBackend
from clawbridge.trainer.loop import StepReport, TrainerConfig, TrainerLoop

__all__ = ["FakeTrainingBackend", "StepReport", "TrainerConfig", "TrainerLoop"]

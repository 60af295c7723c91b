"""A real proxy (real app, uvicorn, SQLite, tokenizer) over a scripted sampler, for exact assertions."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from clawbridge.backend import FakeServingBackend, ModelInfo
from clawbridge.chat.render import Renderer
from clawbridge.config import Settings
from clawbridge.runtime.clock import SYSTEM_CLOCK, Clock
from clawbridge.serving.sampler import FakeSampler, SamplerError, SampleStream, SamplingParams
from tests.support import InProcessProxy, free_port


@dataclass
class SwitchableSampler(FakeSampler):
    """A FakeSampler that can be told to fail with a given error, or to script new text."""

    fail_with: SamplerError | None = None
    calls: list[SamplingParams] = field(default_factory=list)

    async def sample(self, prompt_ids: Sequence[int], params: SamplingParams) -> SampleStream:
        self.calls.append(params)
        if self.fail_with is not None:
            raise self.fail_with
        return await super().sample(prompt_ids, params)


def script_for(renderer: Renderer, text: str, stop: bool = True) -> list[int]:
    """Token ids that decode to `text` (+ the end-of-turn token)."""
    ids = list(renderer.tokenizer.encode(text, add_special_tokens=False))
    if stop:
        ids.append(renderer.stop_token_ids[0])
    return ids


def start_fake_proxy(model_dir: Path, state_dir: Path, sampler: FakeSampler, clock: Clock = SYSTEM_CLOCK,
                     **settings: object) -> InProcessProxy:
    values: dict[str, object] = {"port": free_port(), "state_dir": state_dir, "model": str(model_dir),
                                 "served_model_name": "tiny"}
    values.update(settings)
    s = Settings(**values)  # type: ignore[arg-type]
    info = ModelInfo(name="tiny", tokenizer_path=str(model_dir), context_window=4096, max_output_tokens=256)
    return InProcessProxy(s, FakeServingBackend(sampler, info), clock).start()

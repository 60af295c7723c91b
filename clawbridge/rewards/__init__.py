"""Rewards from conversation: next states, an LLM judge, hindsight hints and on-policy distillation.

- `next_state`: what came after each main turn (tool results, the next user message); pure.
- `judge`: the `JudgeModel` seam, prompt, parsing and majority voting; `OpenAIJudge`,
  `BaseModelJudge`, `ScriptedJudge`.
- `opd`: hinted teacher inputs (recorded completion ids, never re-tokenized) and OPD advantages.
- `worker`: `RewardWorker`, the background task started in the app lifespan.
The rule-based judge server the demos use is dev tooling: `clawbridge.devtools.judge_server`.
How the trainer combines verdicts, explicit rewards and OPD: `clawbridge.trainer.advantages`.
"""

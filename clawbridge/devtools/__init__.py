"""Dev tooling: what tests, benchmarks and the demos use, never the serving path.

- `tinymodel`: a tiny Qwen3-architecture model and tokenizer built offline (its corpus word lists
  in `tinymodel_words.json`, its chat template in `chat_template.jinja`).
- `demo`: `clawbridge demo`, an offline learning demo over the tiny model.
- `realdemo`: `clawbridge demo --model smollm2`, a real instruct model learning a preference.
- `judge_server`: an OpenAI-compatible HTTP server with a scripted or keyword (rule-based) judge.

Invariant: the core (proxy, store, trainer, rewards, render/parse, backends) imports nothing from
this package; `tests/test_layers.py` checks it from the import graph. Only the CLI's dev commands
(`clawbridge demo`, `clawbridge model tiny`) and tests/benchmarks reach in here.
"""

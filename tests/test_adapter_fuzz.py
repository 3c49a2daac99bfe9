"""Hostile adapters. A hypothesis fuzz of adapter_config.json values (wrong types per field,
huge and negative numbers, bad regular-expression keys, deep nesting): `load_adapter` either
accepts the adapter or raises AdapterError, nothing else. And one live `radixlora serve` with
--adapter-dir and admin: bad configs, a FIFO, a file symlink leaving the allowed root, integer
tensors, the base model's name and stack weights out of bounds are OpenAI-shaped 4xx or rejected
events, the server and the registry stay up, and the same content under several names serves
identical outputs."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from radixlora.config import ModelConfig
from radixlora.errors import AdapterError
from radixlora.lora.adapter import LoraAdapter, load_adapter
from scripts.checkpoints import build_tiny_adapter, build_tiny_model
from tests.server_harness import running_server

KEY = "fuzz-admin-key"
BASE = "tiny"
PROMPT = "Fuzz"
FIELDS = ("r", "lora_alpha", "target_modules", "rank_pattern", "alpha_pattern", "use_rslora",
          "layers_to_transform", "bias", "peft_type", "use_dora", "modules_to_save",
          "fan_in_fan_out", "trainable_token_indices")

NUMBERS = st.one_of(
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([0, 1, 4, 8, -1, 1e308, -1e308, 2**63, 0.5]),
)
REGEX_KEYS = st.one_of(
    st.sampled_from(["q_proj", "[", "(?P<", "*", "a{99999999999}", "(a+)+", "(.*)*x", ".*", "\\",
                     ""]),
    st.text(max_size=12),
)
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, st.text(max_size=8))
JSON_VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(REGEX_KEYS, inner, max_size=4)),
    max_leaves=12,
)


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    model = build_tiny_model(root / BASE)
    good = build_tiny_adapter(model, root / "good", rank=4, seed=1)
    return model, good, json.loads((good / "adapter_config.json").read_text())


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(changes=st.dictionaries(st.sampled_from(FIELDS), JSON_VALUES, max_size=4),
       depth=st.sampled_from([0, 0, 50, 5_000, 200_000]))
def test_config_fuzz_is_accepted_or_an_adapter_error(tiny, tmp_path, changes, depth):
    model, good, config = tiny
    path = tmp_path / "fuzzed"
    shutil.rmtree(path, ignore_errors=True)
    shutil.copytree(good, path)
    text = json.dumps({**config, **changes})
    if depth:
        text = text[:-1] + f', "nested": {_nested(depth)}}}'
    (path / "adapter_config.json").write_text(text)
    try:
        adapter = load_adapter("fuzzed", path, ModelConfig.from_dir(model), 64)
    except AdapterError as e:
        assert e.name == "fuzzed" and e.reason
        return
    assert isinstance(adapter, LoraAdapter)
    assert all(torch.isfinite(b).all() for _, b in adapter.weights.values())


# ---- a live server -------------------------------------------------------------------------------


def _bad_config(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps({**cfg, **changes}))
    return dst


def _with_weights(src: Path, dst: Path, make) -> Path:
    shutil.copytree(src, dst)
    (dst / "adapter_model.safetensors").unlink()
    make(dst / "adapter_model.safetensors")
    return dst


def _int_tensors(src: Path):
    def make(target: Path) -> None:
        tensors = load_file(src / "adapter_model.safetensors")
        save_file({k: v.to(torch.int32) for k, v in tensors.items()}, str(target))
    return make


def _wait(predicate, timeout_s=20.0, what=""):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _models(server) -> dict[str, str | None]:
    return {m["id"]: m.get("adapter_id") for m in server.http.get("/v1/models").json()["data"]}


def _complete(server, model: str) -> str:
    resp = server.http.post("/v1/completions", json={
        "model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
        "ignore_eos": True})
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["text"]


def _load(server, name: str, path: Path):
    return server.http.post("/v1/load_lora_adapter",
                            json={"lora_name": name, "lora_path": str(path)},
                            headers={"authorization": f"Bearer {KEY}"})


def _assert_openai_error(resp, status: int, needle: str) -> None:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert needle in error["message"], error["message"]


def test_hostile_adapters_against_a_live_server(tiny, tmp_path):
    model, good, _ = tiny
    watched, allowed, outside = tmp_path / "watched", tmp_path / "allowed", tmp_path / "outside"
    for d in (watched, allowed, outside):
        d.mkdir()
    with running_server(model, {"flag_a": good, "flag_b": good}, tmp_path / "server.log",
                        "--adapter-dir", str(watched), "--adapter-rate", "50",
                        "--adapter-quiet", "0.1", "--enable-admin", "--admin-api-key", KEY,
                        "--allowed-adapter-root", str(allowed)) as server:
        registry_pid = server.info()["pids"]["registry"]
        for field, value in (("lora_alpha", "16"), ("r", "8"), ("target_modules", 5),
                             ("rank_pattern", {"q_proj[": 4}), ("use_rslora", "yes"),
                             ("layers_to_transform", {"0": 1}), ("alpha_pattern", [1])):
            path = _bad_config(good, allowed / f"bad_{field}", **{field: value})
            _assert_openai_error(_load(server, f"bad_{field}", path), 400,
                                 "rank_pattern" if field == "rank_pattern" else f"$.{field}")
        deep = shutil.copytree(good, allowed / "deep")
        (deep / "adapter_config.json").write_text('{"r": 4, "x": ' + _nested(100_000) + "}")
        _assert_openai_error(_load(server, "deep", deep), 400, "nested too deeply")
        fifo = _with_weights(good, allowed / "fifo", os.mkfifo)
        started = time.monotonic()
        _assert_openai_error(_load(server, "fifo", fifo), 400, "not a regular file")
        assert time.monotonic() - started < 10
        escape = _with_weights(good, allowed / "escape", lambda p: os.symlink(
            shutil.copy(good / "adapter_model.safetensors", outside), p))
        _assert_openai_error(_load(server, "escape", escape), 403, "outside the allowed")
        ints = _with_weights(good, allowed / "ints", _int_tensors(good))
        _assert_openai_error(_load(server, "ints", ints), 400, "floating point")
        _assert_openai_error(_load(server, BASE, shutil.copytree(good, allowed / "b")), 400,
                             "served model's name")
        assert server.http.get("/health").json()["status"] == "ok"

        _bad_config(good, watched / "a_bad", lora_alpha="16")
        shutil.copytree(good, watched / "b_fifo")
        os.unlink(watched / "b_fifo" / "adapter_model.safetensors")
        os.mkfifo(watched / "b_fifo" / "adapter_model.safetensors")
        build_tiny_adapter(model, tmp_path / "src" / "c_good", rank=4, seed=7)
        os.rename(tmp_path / "src" / "c_good", watched / "c_good")
        shutil.copytree(good, watched / "d_copy")
        shutil.copytree(good, watched / "e_copy")
        _wait(lambda: {"c_good", "d_copy", "e_copy"} <= set(_models(server)),
              what="the good adapters after the bad ones")
        events = {e["name"]: e for e in server.info()["adapter_events"]}
        assert events["a_bad"]["reason"] == "bad_config"
        assert "$.lora_alpha" in events["a_bad"]["message"]
        assert events["b_fifo"]["reason"] == "special_file"
        assert events["e_copy"]["path"] == events["d_copy"]["path"]  # one snapshot
        assert server.http.get("/health").json()["status"] == "ok"
        assert server.info()["pids"]["registry"] == registry_pid

        assert _load(server, "admin_copy", shutil.copytree(good, allowed / "copy")).is_success
        models = _models(server)
        names = ("flag_a", "flag_b", "d_copy", "e_copy", "admin_copy")
        assert len({models[n] for n in names}) == 1 and models[names[0]]
        assert list(models).count(BASE) == 1
        assert len({_complete(server, n) for n in names}) == 1
        assert _complete(server, "c_good") != _complete(server, "d_copy")
        for weight in (1e38, -101.0):
            resp = server.http.post("/v1/completions", json={
                "model": BASE, "prompt": PROMPT, "max_tokens": 2,
                "adapters": [{"name": "c_good", "weight": weight}]})
            _assert_openai_error(resp, 400, "finite number in [-100, 100]")

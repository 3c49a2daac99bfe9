"""Every bad adapter raises a clear AdapterError naming it and the reason; the engine keeps
serving the others (bad files, configs, ranks, shapes and names; bad requests; the stack cap)."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from radixlora import (
    AdapterError,
    AdapterNotFoundError,
    Engine,
    InvalidRequestError,
    SamplingParams,
)
from radixlora.config import ModelConfig
from radixlora.lora.adapter import read_adapter_files
from radixlora.sched.adapter_choice import MAX_ADAPTER_WEIGHT
from radixlora.sched.adapter_registry import AdapterRegistry

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(checkpoints, adapters):
    return Engine(checkpoints["llama"], adapters={"a": adapters["llama"]["a"]}, max_rank=32)


def clone(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_config(path: Path, **changes) -> Path:
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    return path


def edit_tensors(path: Path, fn) -> Path:
    file = path / "adapter_model.safetensors"
    tensors = fn(load_file(file))
    save_file(tensors, file)
    return path


def _rename(tensors, old, new):
    return {k.replace(old, new): v for k, v in tensors.items()}


def bad_adapters(good: Path, tmp: Path):
    def c(name):
        return clone(good, tmp / name)

    cases = {
        "missing_dir": (tmp / "nope", "does not exist"),
        "no_config": (_unlink(c("no_config"), "adapter_config.json"), "no adapter_config.json"),
        "config_not_json": (
            _write(c("config_not_json"), "adapter_config.json", b"{nope"),
            "not valid JSON",
        ),
        "r_zero": (edit_config(c("r_zero"), r=0), "at `$.r`"),
        "r_negative": (edit_config(c("r_negative"), r=-4), "at `$.r`"),
        "r_too_big": (_rank64(c("r_too_big")), "exceeds the server's max rank"),
        "wrong_module": (
            edit_tensors(
                c("wrong_module"), lambda t: _rename(t, "self_attn.q_proj", "attn.c_attn")
            ),
            "not a LoRA weight",
        ),
        "unknown_target": (
            edit_tensors(
                c("unknown_target"), lambda t: _rename(t, "self_attn.q_proj", "self_attn.qq_proj")
            ),
            "not supported",
        ),
        "layer_out_of_range": (
            edit_tensors(c("layer_out_of_range"), lambda t: _rename(t, "layers.1.", "layers.7.")),
            "2 layers",
        ),
        "shape_mismatch": (edit_tensors(c("shape_mismatch"), _shrink_first_b), "shape mismatch"),
        "empty_tensors": (_write(c("empty_tensors"), "adapter_model.safetensors", b""), "empty"),
        "corrupt_header": (
            _write(
                c("corrupt_header"),
                "adapter_model.safetensors",
                b"\xff\x00\x00\x00\x00\x00\x00\x00garbage",
            ),
            "corrupted",
        ),
        "truncated": (_truncate(c("truncated")), "corrupted"),
        "pickle_only": (_pickle_only(c("pickle_only")), "never unpickles"),
        "dora_without_magnitudes": (edit_config(c("dora_without_magnitudes"), use_dora=True),
                                    "has no lora_magnitude_vector"),
        "modules_to_save": (
            edit_config(c("modules_to_save"), modules_to_save=["lm_head"]),
            "modules_to_save",
        ),
        "bias": (edit_config(c("bias"), bias="all"), "bias"),
        "nan": (edit_tensors(c("nan"), _poison), "NaN"),
        # finite, but B = 1e30: the delta's output would overflow the next norm
        "huge_b": (edit_tensors(c("huge_b"), _huge_b), "norm overflows"),
        "missing_half": (edit_tensors(c("missing_half"), _drop_one_b), "lora_B missing"),
    }
    return cases


def _unlink(path: Path, name: str) -> Path:
    (path / name).unlink()
    return path


def _write(path: Path, name: str, data: bytes) -> Path:
    (path / name).write_bytes(data)
    return path


def _truncate(path: Path) -> Path:
    file = path / "adapter_model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    return path


def _pickle_only(path: Path) -> Path:
    (path / "adapter_model.safetensors").rename(path / "adapter_model.bin")
    return path


def _rank64(path: Path) -> Path:
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg["r"] = 64
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    return edit_tensors(
        path,
        lambda t: {
            k: (torch.randn(64, v.shape[1]) if "lora_A" in k else torch.randn(v.shape[0], 64))
            for k, v in t.items()
        },
    )


def _shrink_first_b(t):
    key = sorted(k for k in t if "lora_B" in k)[0]
    t[key] = t[key][:-1].contiguous()
    return t


def _poison(t):
    key = sorted(t)[0]
    t[key] = t[key].clone()
    t[key][0, 0] = float("nan")
    return t


def _huge_b(t):
    key = sorted(k for k in t if "lora_B" in k)[0]
    t[key] = torch.full_like(t[key], 1e30)
    return t


def _drop_one_b(t):
    del t[sorted(k for k in t if "lora_B" in k)[0]]
    return t


def test_every_bad_adapter_is_refused_with_its_reason(engine, adapters, tmp_path):
    before = engine.generate([5, 6, 7], GREEDY, adapters="a")[0].outputs[0].token_ids
    for name, (path, reason) in bad_adapters(adapters["llama"]["a"], tmp_path).items():
        with pytest.raises(AdapterError) as info:
            engine.load_adapter(name, path)
        assert info.value.name == name
        assert reason in str(info.value), (name, str(info.value))
        assert name not in engine.adapters
    after = engine.generate([5, 6, 7], GREEDY, adapters="a")[0].outputs[0].token_ids
    assert after == before


@pytest.mark.parametrize("name", ["", "x" * 200, "../evil", "a/b", "/abs", "a:b"])
def test_bad_adapter_names(engine, adapters, name):
    with pytest.raises(InvalidRequestError):
        engine.load_adapter(name, adapters["llama"]["b"])


def test_request_errors(engine):
    with pytest.raises(AdapterNotFoundError):
        engine.generate([1, 2], GREEDY, adapters="unknown")
    with pytest.raises(InvalidRequestError, match="at most 8"):
        engine.generate([1, 2], GREEDY, adapters=[("a", 1.0)] * 9)
    with pytest.raises(InvalidRequestError, match="named twice"):
        engine.generate([1, 2], GREEDY, adapters=[("a", 1.0), ("a", 0.5)])
    with pytest.raises(InvalidRequestError, match="finite"):
        engine.generate([1, 2], GREEDY, adapters=[("a", float("nan"))])
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.generate([[]], GREEDY)
    with pytest.raises(InvalidRequestError, match="token ids"):
        engine.generate([1, 999999], GREEDY)
    with pytest.raises(InvalidRequestError, match="context length"):
        engine.generate([1, 2], SamplingParams(max_tokens=10_000))
    for bad in (
        dict(max_tokens=0),
        dict(max_tokens=1.5),
        dict(temperature=-1),
        dict(temperature=float("nan")),
        dict(top_p=0),
        dict(top_p=2),
        dict(n=0),
        dict(logprobs=21),
        dict(top_k=-5),
        dict(min_p=float("inf")),
    ):
        with pytest.raises(InvalidRequestError):
            engine.generate([1, 2], SamplingParams(**bad))
    assert engine.generate([1, 2], GREEDY, adapters="a")[0].outputs[0].token_ids


def test_stack_cap_is_configurable(checkpoints, adapters):
    eng = Engine(checkpoints["llama"], adapters=adapters["llama"], max_rank=64, max_stacked=2)
    with pytest.raises(InvalidRequestError, match="at most 2"):
        eng.generate([1, 2], GREEDY, adapters=[("a", 1.0), ("b", 1.0), ("c", 1.0)])
    assert eng.generate([1, 2], GREEDY, adapters=[("a", 1.0), ("b", 1.0)])[0].outputs[0].token_ids


WRONG_CONFIGS = {  # field -> a value of the wrong type or range, named in the error as `$.field`
    "r": "8",
    "lora_alpha": "16",
    "target_modules": 5,
    "rank_pattern": ["q_proj"],
    "alpha_pattern": {"q_proj": "x"},
    "use_rslora": "yes",
    "layers_to_transform": {"0": 1},
    "bias": 3,
    "peft_type": 1,
}


@pytest.mark.parametrize("field", sorted(WRONG_CONFIGS))
def test_wrong_config_types_name_the_field(engine, adapters, tmp_path, field):
    path = edit_config(clone(adapters["llama"]["a"], tmp_path / "x"),
                       **{field: WRONG_CONFIGS[field]})
    with pytest.raises(AdapterError, match=re.escape(f"`$.{field}")):
        engine.load_adapter("x", path)


@pytest.mark.parametrize("changes,reason", [
    (dict(lora_alpha=1e300), "`$.lora_alpha`"),
    (dict(r=2**70), "exceeds the server's max rank"),
    (dict(rank_pattern={"q_proj": 0}), "`$.rank_pattern"),
    (dict(alpha_pattern={"q_proj": -1}), "`$.alpha_pattern"),
    (dict(rank_pattern={"q_proj[": 4}), "not a valid regular expression"),
    (dict(alpha_pattern={"(?P<": 4}), "not a valid regular expression"),
    (dict(rank_pattern={"q" * 300: 4}), "longer than"),
    (dict(rank_pattern={"(.*)*x": 4}), "inside a repetition"),
    (dict(alpha_pattern={"(ab|cd)+": 4}), "inside a repetition"),
    (dict(rank_pattern={".*.*.*.*.*x": 4}), "more than 4 repetitions"),
    (dict(rank_pattern={f"x{i}": 4 for i in range(600)}), "more than 512 keys"),
    (dict(layers_to_transform=[-1]), "`$.layers_to_transform"),
])
def test_config_ranges_and_patterns(engine, adapters, tmp_path, changes, reason):
    path = edit_config(clone(adapters["llama"]["a"], tmp_path / "x"), **changes)
    with pytest.raises(AdapterError, match=re.escape(reason)):
        engine.load_adapter("x", path)


def test_deep_big_and_non_object_configs(engine, adapters, tmp_path):
    good = adapters["llama"]["a"]
    cfg = json.loads((good / "adapter_config.json").read_text())
    deep = json.dumps(cfg)[:-1].encode() + b', "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    for name, data, reason in (
        ("deep", deep, "nested too deeply"),
        ("huge", b" " * (2 << 20) + json.dumps(cfg).encode(), "larger than 1 MiB"),
        ("list", b"[1, 2]", "must hold a JSON object"),
    ):
        path = _write(clone(good, tmp_path / name), "adapter_config.json", data)
        with pytest.raises(AdapterError, match=reason):
            engine.load_adapter(name, path)


def test_peft_extras_and_every_accepted_form_still_load(engine, adapters, tmp_path):
    good = adapters["llama"]["a"]
    path = edit_config(clone(good, tmp_path / "x"), lora_alpha=16.5, target_modules="q_proj",
                       use_dora=False, modules_to_save=None, fan_in_fan_out=False,
                       trainable_token_indices=None, layers_to_transform=None,
                       rank_pattern=None, alpha_pattern=None, use_rslora=None,
                       unknown_future_key={"deep": [1, {"x": None}]}, task_type="CAUSAL_LM")
    engine.load_adapter("extras", path)
    assert "extras" in engine.adapters
    engine.unload_adapter("extras")


def _special(path: Path, make) -> Path:
    (path / "adapter_model.safetensors").unlink()
    make(path / "adapter_model.safetensors")
    return path


def test_special_files_are_refused_without_blocking(engine, adapters, tmp_path):
    good = adapters["llama"]["a"]
    fifo = _special(clone(good, tmp_path / "fifo"), os.mkfifo)
    link_fifo = clone(good, tmp_path / "link_fifo")
    (link_fifo / "adapter_model.safetensors").unlink()
    os.symlink(fifo / "adapter_model.safetensors", link_fifo / "adapter_model.safetensors")
    device = _special(clone(good, tmp_path / "device"), lambda p: os.symlink("/dev/zero", p))
    dangling = _special(clone(good, tmp_path / "dangling"),
                        lambda p: os.symlink(tmp_path / "nowhere", p))
    config_dir = clone(good, tmp_path / "config_dir")
    (config_dir / "adapter_config.json").unlink()
    (config_dir / "adapter_config.json").mkdir()
    for path in (fifo, link_fifo, device, dangling, config_dir):
        with pytest.raises(AdapterError, match="not a regular file|unreadable"):
            engine.load_adapter(path.name, path)


def test_file_symlinks_must_resolve_inside_the_roots(adapters, checkpoints, tmp_path):
    good = adapters["llama"]["a"]
    root = tmp_path / "root"
    inside = clone(good, root / "inside")
    escape = clone(good, root / "escape")
    (escape / "adapter_model.safetensors").unlink()
    os.symlink(good / "adapter_model.safetensors", escape / "adapter_model.safetensors")
    linked_in = clone(good, root / "linked_in")
    (linked_in / "adapter_config.json").unlink()
    os.symlink(inside / "adapter_config.json", linked_in / "adapter_config.json")
    assert read_adapter_files("inside", inside, [root])
    assert read_adapter_files("linked_in", linked_in, [root])
    assert read_adapter_files("escape", escape)  # no roots: links are followed
    with pytest.raises(AdapterError, match="outside the allowed adapter roots") as info:
        read_adapter_files("escape", escape, [root])
    assert info.value.code == "path_not_allowed"


@pytest.mark.parametrize("dtype", [torch.int32, torch.int8, torch.bool, torch.uint8])
def test_non_float_tensors_are_refused(engine, adapters, tmp_path, dtype):
    path = edit_tensors(clone(adapters["llama"]["a"], tmp_path / "x"),
                        lambda t: {k: v.to(dtype) for k, v in t.items()})
    with pytest.raises(AdapterError, match="floating point"):
        engine.load_adapter("x", path)


def test_half_precision_tensors_are_accepted(engine, adapters, tmp_path):
    path = edit_tensors(clone(adapters["llama"]["a"], tmp_path / "half"),
                        lambda t: {k: v.to(torch.bfloat16) for k, v in t.items()})
    engine.load_adapter("half", path)
    engine.unload_adapter("half")


def test_stack_weights_are_bounded(engine):
    for weight in (1e38, -101, MAX_ADAPTER_WEIGHT * 1.01):
        with pytest.raises(InvalidRequestError, match="finite number in"):
            engine.generate([1, 2], GREEDY, adapters=[("a", weight)])
    assert engine.generate([1, 2], GREEDY, adapters=[("a", -MAX_ADAPTER_WEIGHT)])


def test_base_served_name_is_reserved(checkpoints, adapters):
    registry = AdapterRegistry(ModelConfig.from_dir(checkpoints["llama"]), 32, 8, 64,
                               reserved=frozenset({"llama"}))
    with pytest.raises(InvalidRequestError, match="served model's name"):
        registry.load("llama", adapters["llama"]["a"])
    assert registry.load("llama-a", adapters["llama"]["a"])[0].name == "llama-a"


def test_non_finite_logits_end_the_request_not_the_batch(checkpoints, adapters):
    """Logits that are not finite (here: the adapter's B rows in the pool overwritten with
    1e30 after it loaded, so its activations overflow) are never sampled from: the request
    ends with finish_reason non_finite_logits at the first token whose logits are not finite
    (its first token came from finite ones), the base request beside it is untouched, and
    nothing leaks."""
    from radixlora.sched.scheduler import NON_FINITE_LOGITS
    from tests.conftest import assert_all_free

    eng = Engine(checkpoints["llama"], adapters={"a": adapters["llama"]["a"]}, max_rank=32,
                 kv_pages=256)
    base_alone = eng.generate([5, 6, 7], GREEDY)[0].outputs[0].token_ids
    eng.generate([5, 6, 7], GREEDY, adapters="a")  # resident now
    for layer in eng.runner.adapter_pool.b:
        for rows in layer.values():
            rows.fill_(1e30)
    bad, base = eng.generate([[5, 6, 7], [5, 6, 7]], GREEDY, adapters=["a", None])
    assert bad.outputs[0].finish_reason == NON_FINITE_LOGITS
    assert len(bad.outputs[0].token_ids) < GREEDY.max_tokens
    assert all(math.isfinite(lp) for lp in bad.outputs[0].logprobs)
    assert base.outputs[0].token_ids == base_alone
    assert_all_free(eng)

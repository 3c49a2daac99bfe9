"""Quantized bases under tensor parallel on the CPU (gloo): a bitsandbytes NF4 checkpoint,
--quantization nf4 at load, a per-channel FP8 checkpoint, one with scales per 32 x 32 block
(each rank's o and down columns whole blocks) and --quantization fp8 at load, each
on 2 ranks (the FP8 checkpoint also on 4, over 2 KV heads: replicated), answer the
single-device greedy tokens and logprobs within TOL (float32: only the all-reduce's summation
order differs), base-only and with a LoRA adapter (non-zero lora_B) in one batch; a model whose
NF4 blocks or FP8 scale blocks a rank's slice would cut is refused at load. The ranks are
tests.test_tensor_parallel's worker ranks.

The model: llama with biases on every projection (the row-parallel ones added once, after the
all-reduce), 4 heads of 32 over 2 KV heads and an intermediate size of 256, so that each rank's
o and down columns are whole 64-blocks (bitsandbytes' blocksize)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from radixlora import Engine
from radixlora.config import EngineConfig, ModelConfig
from radixlora.distributed import Shard, TensorParallel
from radixlora.errors import ModelLoadError
from radixlora.model.loader import load_model
from scripts.checkpoints import (
    HF_VOCAB,
    build_fp8_model,
    build_nf4_model,
    build_peft_adapter,
    hf_config,
    save_nf4,
)
from tests import test_tensor_parallel as tpt

SHAPE = dict(hidden_size=128, intermediate_size=256, vocab_size=HF_VOCAB, attention_bias=True,
             mlp_bias=True, initializer_range=0.1, max_position_embeddings=512,
             tie_word_embeddings=False)


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, Path]:
    """The dense base, its bitsandbytes NF4 save (double quantization) and its FP8 one, and an
    adapter of the dense base."""
    import transformers

    root = tmp_path_factory.mktemp("quantized-tp")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(hf_config("llama", **SHAPE)).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_proj.bias"):
                p.normal_(0.0, 0.1)
    model.save_pretrained(root / "dense")
    save_nf4(root / "dense", root / "nf4")
    fp8, _ = build_fp8_model(root / "fp8", root / "dense", "channel")
    fp8_block, _ = build_fp8_model(root / "fp8-block", root / "dense", "block", (32, 32))
    adapter = build_peft_adapter(root / "dense", root / "adapter", seed=5, r=8, lora_alpha=16)
    return {"dense": root / "dense", "nf4": root / "nf4", "fp8": fp8, "fp8-block": fp8_block,
            "adapter": adapter}


@pytest.mark.parametrize("base,quantization,sizes", [("nf4", None, [2]), ("dense", "nf4", [2]),
                                                     ("fp8", None, [2, 4]),
                                                     ("fp8-block", None, [2]),
                                                     ("dense", "fp8", [2])],
                         ids=["nf4", "nf4-at-load", "fp8", "fp8-block", "fp8-at-load"])
def test_ranks_match_the_single_device_run(bases, base, quantization, sizes, tmp_path):
    # adapters of the dense base served on an NF4 one: the mismatch is not what is tested here
    engine = Engine(bases[base], adapters={"a": bases["adapter"]}, dtype="float32",
                    kv_pages=128, max_running=4, quantization=quantization,
                    qlora_mismatch="serve")
    assert engine.model_cfg.quantization == (quantization or base.removesuffix("-block"))
    rec = tpt.Recorded([], [])
    launch, finish = engine.executor.launch, engine.executor.finish
    engine.executor.launch = lambda plan: rec.plans.append(plan) or launch(plan)
    engine.executor.finish = lambda step: rec.results.append(finish(step)) or rec.results[-1]
    engine.generate([tpt.prompt(1, 7), tpt.prompt(2, 5), tpt.prompt(3, 9)], tpt.GREEDY,
                    adapters=[None, "a", "a"])
    for size in sizes:
        tpt.check_same_results(tpt.run_ranks(tmp_path, bases[base], engine.config, rec, size),
                               rec.results)


@pytest.mark.parametrize("stored", [True, False])
def test_nf4_blocks_a_rank_would_cut_are_refused(checkpoints, stored, tmp_path):
    """The tests' small llama (q_dim 64): each of 2 ranks' o_proj columns are 32 wide, half a
    64-block."""
    path = build_nf4_model(tmp_path / "nf4", "llama") if stored else checkpoints["llama"]
    cfg = ModelConfig.from_dir(path).served(EngineConfig(quantization="nf4"))
    tp = TensorParallel(Shard(1, 2, cfg), group=None, control=None)  # refused before any collective
    with pytest.raises(ModelLoadError, match=r"tensor-parallel-size 2: the NF4 o_proj \[64, 64\] "
                                             r"of blocksize 64"):
        load_model(path, cfg, torch.float32, "cpu", tp=tp)



def test_fp8_scale_blocks_a_rank_would_cut_are_refused(bases, tmp_path):
    """Blocks of 48 input columns: rank 0's columns of o_proj, [0, 64), end inside a block.
    Every rank checks every rank's cut before loading, so rank 1 refuses as rank 0 does."""
    path, _ = build_fp8_model(tmp_path / "fp8", bases["dense"], "block", (48, 48))
    cfg = ModelConfig.from_dir(path).served(EngineConfig())
    tp = TensorParallel(Shard(1, 2, cfg), group=None, control=None)
    with pytest.raises(ModelLoadError, match=r"tensor-parallel-size 2: the FP8 o_proj's input "
                                             r"columns \[0, 64\) of rank 0 are not whole "
                                             r"blocks of 48"):
        load_model(path, cfg, torch.float32, "cpu", tp=tp)

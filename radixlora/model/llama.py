"""Llama-family causal LM (Llama, Qwen2, Mistral) over a paged KV pool and a paged adapter pool.

Projections are fused (qkv, gate_up) and every projection's LoRA delta comes from the forward
batch's LoRA context, one batched op per projection. A projection returns (y, delta): under CUDA
graphs the delta is computed beside the base GEMM and added by y's consumer (rotary + KV store,
the norms' residual add, SiLU-mul); otherwise it is already in y and delta is None. The model
holds no per-request state.
"""

from __future__ import annotations

import torch
from torch import nn

from radixlora.config import ModelConfig
from radixlora.model.forward_batch import ForwardBatch
from radixlora.model.ops import rms_norm, silu_mul
from radixlora.model.rope import RotaryEmbedding


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, delta=None):
        """(norm(x + residual), x + residual): the residual add (and x's deferred LoRA delta)
        is fused into the norm."""
        return rms_norm(x, self.weight, self.eps, residual, delta)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_dim + 2 * cfg.kv_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.q_dim, cfg.hidden_size, bias=cfg.o_bias)
        self.split = (cfg.q_dim, cfg.kv_dim, cfg.kv_dim)

    def forward(self, x: torch.Tensor, fb: ForwardBatch, inv_freq: torch.Tensor):
        """(o_proj output, its deferred LoRA delta or None)."""
        qkv, delta = fb.lora_project(self.qkv_proj, x, self.layer_id, "qkv")
        deltas = None if delta is None else self.heads(delta)
        o = fb.attention(*self.heads(qkv), self.layer_id, inv_freq, deltas)
        return fb.lora_project(self.o_proj, o.reshape(-1, self.split[0]), self.layer_id, "o")

    def heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k and v [T, Hk, D]: views of a fused qkv row."""
        q, k, v = qkv.split(self.split, dim=-1)
        return (
            q.view(-1, self.num_heads, self.head_dim),
            k.view(-1, self.num_kv_heads, self.head_dim),
            v.view(-1, self.num_kv_heads, self.head_dim),
        )


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor, fb: ForwardBatch):
        """(down_proj output, its deferred LoRA delta or None)."""
        gate_up, delta = fb.lora_project(self.gate_up_proj, x, self.layer_id, "gate_up")
        return fb.lora_project(self.down_proj, silu_mul(gate_up, delta), self.layer_id, "down")


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_id)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, layer_id)

    def forward(self, h, delta, residual, fb: ForwardBatch, inv_freq: torch.Tensor):
        """(mlp output, its deferred LoRA delta, residual stream before it); the residual adds
        live in the norms."""
        x, residual = self.input_layernorm(h, residual, delta)
        o, delta = self.self_attn(x, fb, inv_freq)
        x, residual = self.post_attention_layernorm(o, residual, delta)
        h, delta = self.mlp(x, fb)
        return h, delta, residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        # given a weight, Embedding skips its random init, whose meta-device path imports
        # torch._dynamo (seconds at start-up); the loader fills every weight
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Logits (in the model's dtype, as lm_head rounds them) of the tokens at
        fb.logits_indices: [num_logits, vocab]."""
        return self.logits(self.hidden(fb))

    @torch.inference_mode()
    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(h)

    @torch.inference_mode()
    def hidden(self, fb: ForwardBatch) -> torch.Tensor:
        """The final hidden states (normed) of the tokens at fb.logits_indices, which lm_head
        turns into logits: [num_logits, hidden]."""
        fb.begin()
        h, delta, residual = self.embed_tokens(fb.input_ids), None, None
        for layer in self.layers:
            h, delta, residual = layer(h, delta, residual, fb, self.rotary.inv_freq)
        rows = fb.logits_indices
        h, _ = self.norm(h[rows], residual[rows], None if delta is None else delta[rows])
        return h

"""The one decoder every family runs (radixlora.families declares what each changes: norms,
activation, embedding scale, q/k norms, sandwich norms, rotary dims and bases, sliding layers,
attention scale and soft-capping, final soft-capping), over a paged KV pool and a paged adapter
pool.

Projections are fused (qkv, gate_up) and every projection's LoRA delta comes from the forward
batch's LoRA context, one batched op per projection. A projection returns (y, delta): under CUDA
graphs the delta is computed beside the base GEMM and added by y's consumer (rotary + KV store,
the norms' residual add, the gated activation); otherwise it is already in y and delta is None.
The model holds no per-request state.
"""

from __future__ import annotations

import torch
from torch import nn

from radixlora.config import ModelConfig
from radixlora.model.forward_batch import ForwardBatch
from radixlora.model.ops import add_delta, gated_act, rms_norm, sparse_moe
from radixlora.model.rope import RotaryEmbedding
from radixlora_kernels.moe import Fp8Experts


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        """offset: the scale is offset + weight (Gemma's 1 + weight)."""
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, delta=None):
        """(norm(x + residual), x + residual): the residual add (and x's deferred LoRA delta)
        is fused into the norm."""
        return rms_norm(x, self.weight, self.eps, residual, delta, self.offset)


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
        if cfg.qk_norm:  # over each head's channels, before rotary
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.norm_offset)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.norm_offset)

    def forward(self, x: torch.Tensor, fb: ForwardBatch, rotary: RotaryEmbedding):
        """(o_proj output, its deferred LoRA delta or None)."""
        qkv, delta = fb.lora_project(self.qkv_proj, x, self.layer_id, "qkv")
        q, k, v = self.heads(qkv)
        deltas = None if delta is None else self.heads(delta)
        if hasattr(self, "q_norm"):  # the norms read q and k with their deltas
            if deltas is not None:
                q, k, v = map(add_delta, (q, k, v), deltas)
                deltas = None
            q = self.q_norm(q.reshape(-1, self.head_dim))[0].view_as(q)
            k = self.k_norm(k.reshape(-1, self.head_dim))[0].view_as(k)
        o = fb.attention(q, k, v, self.layer_id, rotary.inv_freq, deltas,
                         rotary.rope.attention_factor)
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
        self.activation = cfg.activation
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor, fb: ForwardBatch):
        """(down_proj output, its deferred LoRA delta or None)."""
        gate_up, delta = fb.lora_project(self.gate_up_proj, x, self.layer_id, "gate_up")
        hidden = gated_act(gate_up, delta, self.activation)
        return fb.lora_project(self.down_proj, hidden, self.layer_id, "down")


class Experts(nn.Module):
    """An MoE layer's experts, stacked as transformers 5 keeps them: gate_up_proj [E, 2I, H]
    ([gate | up] rows of each expert), down_proj [E, H, I]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))
        # FP8 experts (radixlora.model.quant_fp8.fp8_experts): columns per scale, 0 per row
        self.fp8_block: int | None = None

    @property
    def num_rows(self) -> int:
        """Weight rows of every expert, gate_up's and down's (what a checkpoint fills)."""
        return self.gate_up_proj.shape[:2].numel() + self.down_proj.shape[:2].numel()

    def weights(self) -> tuple:
        """(gate_up, down) as moe_experts takes them: tensors, or Fp8Experts with the scales."""
        if self.fp8_block is None:
            return self.gate_up_proj, self.down_proj
        return tuple(Fp8Experts(w, s, self.fp8_block or w.shape[2]) for w, s in (
            (self.gate_up_proj, self.gate_up_scale), (self.down_proj, self.down_scale)))


class SparseMoE(nn.Module):
    """A mixture-of-experts MLP: the router (`gate`) picks each token's experts_per_token
    experts, whose SiLU-gated outputs are summed by their routing weights. LoRA on the router
    adds to its logits like any projection's; LoRA on the stacked experts comes from the
    batch's expert hook (ForwardBatch.expert_lora)."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.top_k, self.renormalize = cfg.experts_per_token, cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = Experts(cfg)
        self.tp = None  # tensor parallel: each rank's experts hold a share of their channels

    def forward(self, x: torch.Tensor, fb: ForwardBatch):
        """(the routed sum, None): no deferred delta."""
        logits, delta = fb.lora_project(self.gate, x, self.layer_id, "router")
        if delta is not None:
            logits = logits.float() + delta
        y = sparse_moe(x, logits, *self.experts.weights(), self.top_k, self.renormalize,
                       fb.expert_lora(self.layer_id))
        return (y if self.tp is None else self.tp.all_reduce(y)), None


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        norm = (cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        self.input_layernorm = RMSNorm(*norm)
        self.self_attn = Attention(cfg, layer_id)
        # without sandwich norms, the norm before the MLP; with them, the one after attention
        self.post_attention_layernorm = RMSNorm(*norm)
        self.mlp = SparseMoE(cfg, layer_id) if cfg.moe_layer(layer_id) else MLP(cfg, layer_id)
        if cfg.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(*norm)
            self.post_feedforward_layernorm = RMSNorm(*norm)

    def forward(self, h, delta, residual, fb: ForwardBatch, rotary: RotaryEmbedding):
        """(mlp output, its deferred LoRA delta, residual stream before it); the residual adds
        live in the norms."""
        x, residual = self.input_layernorm(h, residual, delta)
        o, delta = self.self_attn(x, fb, rotary)
        if not hasattr(self, "pre_feedforward_layernorm"):
            x, residual = self.post_attention_layernorm(o, residual, delta)
            return (*self.mlp(x, fb), residual)
        o, _ = self.post_attention_layernorm(o, None, delta)
        x, residual = self.pre_feedforward_layernorm(o, residual)
        h, delta = self.mlp(x, fb)
        return self.post_feedforward_layernorm(h, None, delta)[0], None, residual


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        # given a weight, Embedding skips its random init, whose meta-device path imports
        # torch._dynamo (seconds at start-up); the loader fills every weight
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        rotary_dim = cfg.rotary_dim or cfg.head_dim
        self.rotary = RotaryEmbedding(rotary_dim, cfg.rope)
        if cfg.local_rope is not None:  # the sliding layers' own base
            self.local_rotary = RotaryEmbedding(rotary_dim, cfg.local_rope)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def rotaries(self) -> list[RotaryEmbedding]:
        return [self.rotary, *([self.local_rotary] if hasattr(self, "local_rotary") else [])]

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch, out: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (in the model's dtype, as lm_head rounds them) of the tokens at
        fb.logits_indices: [num_logits, vocab], written into `out` when given."""
        return self.logits(self.hidden(fb), out)

    @torch.inference_mode()
    def logits(self, h: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """lm_head(h), final soft-capping applied, in a new tensor or in `out` (the CUDA
        graphs' one logits buffer)."""
        cap = self.cfg.final_softcap
        if out is None:
            logits = self.lm_head(h)
            return logits if cap is None else torch.tanh(logits / cap) * cap
        if isinstance(self.lm_head, nn.Linear):
            torch.mm(h, self.lm_head.weight.t(), out=out)
        else:  # a tensor-parallel head gathers its ranks' logits into a new tensor
            out.copy_(self.lm_head(h))
        return out if cap is None else out.div_(cap).tanh_().mul_(cap)

    @torch.inference_mode()
    def hidden(self, fb: ForwardBatch) -> torch.Tensor:
        """The final hidden states (normed) of the tokens at fb.logits_indices, which lm_head
        turns into logits: [num_logits, hidden]."""
        fb.begin()
        h, delta, residual = self.embed_tokens(fb.input_ids), None, None
        if self.cfg.embed_scale:  # sqrt(hidden) rounded to the model's dtype, as Gemma's
            h = h * torch.tensor(self.cfg.hidden_size**0.5, dtype=h.dtype).item()
        for i, layer in enumerate(self.layers):
            rotary = (self.local_rotary if hasattr(self, "local_rotary") and self.cfg.window(i)
                      else self.rotary)
            h, delta, residual = layer(h, delta, residual, fb, rotary)
        rows = fb.logits_indices
        h, _ = self.norm(h[rows], residual[rows], None if delta is None else delta[rows])
        return h

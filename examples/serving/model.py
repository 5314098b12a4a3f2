"""A small Llama-architecture decoder in plain PyTorch: RMSNorm, RoPE, GQA attention, SwiGLU MLP, LM head.

Module names follow Hugging Face's `LlamaForCausalLM` (`model.layers.{i}.self_attn.q_proj`, ...), so a state dict
saved from such a model (or from this one) loads with `load_weights` when the config matches. Nothing is
downloaded: weights are random from a seed unless a local file is given.

Attention is not part of the module: `forward` takes an `attn(layer, q, k, v)` callable that receives the rotated
q [T, Hq, D] and k/v [T, Hkv, D] of the T tokens being run and returns [T, Hq, D]. The serving engine passes paged
tileflash (or SDPA) attention; `reference_logits` passes an explicit masked softmax over the whole sequence.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class ModelConfig:
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    max_positions: int = 4096


PRESETS = {
    # Runs through the Triton interpreter on the CPU in seconds; GQA 2 and head dim 16 still exercise pack-GQA.
    "tiny": ModelConfig(vocab=128, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128),
    # A GPU-sized model: GQA 4, head dim 64 (as in the integration issue), Llama-2 tokenizer's vocab size.
    "small": ModelConfig(vocab=32000, hidden=1024, layers=8, heads=16, kv_heads=4, head_dim=64, intermediate=2816),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        # Normalise in fp32 (as Llama does) so fp16 weights do not lose the mean square.
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rope_tables(cfg: ModelConfig, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_positions, head_dim] in fp32, laid out for `rotate_half` (Hugging Face's convention)."""
    inv_freq = cfg.rope_theta ** (-torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim)
    angles = torch.arange(cfg.max_positions, dtype=torch.float64)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float().to(device), angles.sin().float().to(device)


def apply_rope(x, cos, sin):
    """x [T, H, D]; cos/sin [T, D] (already indexed by each token's position)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.q_proj = nn.Linear(cfg.hidden, cfg.heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.heads * cfg.head_dim, cfg.hidden, bias=False)

    def forward(self, x, cos, sin, attn, layer: int):
        t, c = x.shape[0], self.cfg
        q = apply_rope(self.q_proj(x).view(t, c.heads, c.head_dim), cos, sin)
        k = apply_rope(self.k_proj(x).view(t, c.kv_heads, c.head_dim), cos, sin)
        v = self.v_proj(x).view(t, c.kv_heads, c.head_dim)
        return self.o_proj(attn(layer, q, k, v).reshape(t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden, cfg.intermediate, bias=False)
        self.up_proj = nn.Linear(cfg.hidden, cfg.intermediate, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate, cfg.hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, attn, layer: int):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps)


class LlamaModel(nn.Module):
    """`forward(tokens [T], positions [T], attn) -> final hidden states [T, hidden]`; `logits(h) -> [T, vocab]`
    in fp32. Tokens of several sequences may be packed into T: only `attn` knows where sequences start."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # Plain attributes, not buffers: Module.to(dtype) would round the tables to fp16 with the weights.
        self.rope_cos, self.rope_sin = rope_tables(cfg, "cpu")

    def forward(self, tokens, positions, attn):
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        x = self.model.embed_tokens(tokens)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, attn, i)
        return self.model.norm(x)

    def logits(self, hidden):
        return self.lm_head(hidden).float()


def init_random(model: LlamaModel, seed: int) -> LlamaModel:
    """Gaussian weights with std gain / sqrt(fan_in), embeddings N(0, 1), norms at 1. Gain 2 on q/k makes
    attention peaked, so the tokens depend on which keys each query sees (a wrong page or mask changes them);
    gain 4 on the LM head spreads the logits, so greedy decoding has clear winners rather than near-ties."""
    gains = {"q_proj": 2.0, "k_proj": 2.0, "lm_head": 4.0}
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name == "model.embed_tokens.weight":
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                gain = next((v for k, v in gains.items() if k in name), 1.0)
                p.copy_(torch.randn(p.shape, generator=g) * gain / p.shape[1] ** 0.5)
    return model


def load_weights(model: LlamaModel, path: str) -> LlamaModel:
    """Load a local state dict (`.safetensors` through the safetensors package, anything else through
    `torch.load(weights_only=True)`). Names and shapes must match this module's (strict); a missing lm_head is
    allowed when the config ties embeddings."""
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        state = load_file(path)
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)
    if model.cfg.tie_embeddings:
        state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
    model.load_state_dict(state, strict=True)
    return model


def build_model(cfg: ModelConfig, seed: int = 0, weights: str | None = None, device="cpu",
                dtype=torch.float32) -> LlamaModel:
    model = LlamaModel(cfg)
    model = load_weights(model, weights) if weights else init_random(model, seed)
    model = model.to(device=device, dtype=dtype).eval()
    model.rope_cos, model.rope_sin = rope_tables(cfg, device)
    return model


def _causal_attention(q, k, v, attn_dtype):
    """One sequence, no cache: explicit masked softmax over all its tokens in fp32 (q [T, Hq, D], k/v [T, Hkv, D]).
    With attn_dtype, q/k/v and the output are rounded to it first, as the engine's fp16 attention and cache do."""
    t, hq, d = q.shape
    out_dtype, rep = q.dtype, hq // k.shape[1]
    if attn_dtype is not None:
        q, k, v = q.to(attn_dtype), k.to(attn_dtype), v.to(attn_dtype)
    q, k, v = q.float(), k.float().repeat_interleave(rep, 1), v.float().repeat_interleave(rep, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) * d ** -0.5
    s = s.masked_fill(~torch.ones(t, t, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    out = torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
    return (out if attn_dtype is None else out.to(attn_dtype)).to(out_dtype)


def fp32_copy(model: LlamaModel) -> LlamaModel:
    """The model itself if it is fp32, else a float32 copy (the reference computes in fp32 whatever the engine uses)."""
    return model if model.lm_head.weight.dtype == torch.float32 else copy.deepcopy(model).float()


@torch.no_grad()
def reference_logits(model: LlamaModel, tokens: list[int], attn_dtype=None) -> torch.Tensor:
    """Logits [len(tokens), vocab] (fp32) of one sequence by full recompute: no cache, no paging, attention as an
    explicit masked softmax. With an fp32 model (`fp32_copy`) and attn_dtype None this is the accuracy target; with
    the engine's model and attention dtype it is a low-precision reference whose distance to the target measures
    the rounding a correct engine may show."""
    ids = torch.tensor(tokens, device=model.rope_cos.device)
    hidden = model(ids, torch.arange(len(tokens), device=ids.device),
                   lambda _, q, k, v: _causal_attention(q, k, v, attn_dtype))
    return model.logits(hidden)

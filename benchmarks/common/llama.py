"""A tiny Llama in HuggingFace's layout, and torchtitan's tensor-parallel plan for it.

``model.embed_tokens``, ``model.layers[i]`` with ``self_attn.{q,k,v,o}_proj``,
``mlp.{gate,up,down}_proj`` and two RMSNorms, ``model.norm``, ``lm_head``: the module names,
parameter shapes and ops (RMSNorm, rotary embeddings, causal attention with grouped key/value
heads, SwiGLU) of ``transformers.LlamaForCausalLM``, so ``parallelize_module`` takes the same
plan (:func:`parallelize_tp`). The composition tests (``tests/fsdp``) and
``benchmarks/fsdp_2d.py`` build it; transformers is not needed.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

# "sdpa": F.scaled_dot_product_attention; "eager": HuggingFace's attn_implementation="eager"
ATTENTION = "eager"


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 32
    dim: int = 16
    heads: int = 4
    kv_heads: int = 2
    hidden: int = 24
    layers: int = 2


# about 1B parameters: the model a lent GPU runs (``gpu_step.py``, ``first_step.py --device cuda``)
LLAMA_1B = Config(vocab=32000, dim=2048, heads=16, kv_heads=8, hidden=5632, layers=18)


class RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * x32.to(x.dtype)


def rotary(x, positions):
    half = x.shape[-1] // 2
    freqs = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32, device=x.device) / half))
    angles = positions[:, None].float() * freqs[None, :]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Attention(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.head = c.dim // c.heads
        self.q_proj = nn.Linear(c.dim, c.heads * self.head, bias=False)
        self.k_proj = nn.Linear(c.dim, c.kv_heads * self.head, bias=False)
        self.v_proj = nn.Linear(c.dim, c.kv_heads * self.head, bias=False)
        self.o_proj = nn.Linear(c.heads * self.head, c.dim, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds a slice of them
        q = self.q_proj(x).view(b, s, -1, self.head).transpose(1, 2)
        k = self.k_proj(x).view(b, s, -1, self.head).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, self.head).transpose(1, 2)
        positions = torch.arange(s, device=x.device)
        q, k = rotary(q, positions), rotary(k, positions)
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        if ATTENTION == "sdpa":
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = q @ k.transpose(-1, -2) / self.head**0.5
            mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
            out = scores.masked_fill(mask, float("-inf")).softmax(-1) @ v
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.gate_proj = nn.Linear(c.dim, c.hidden, bias=False)
        self.up_proj = nn.Linear(c.dim, c.hidden, bias=False)
        self.down_proj = nn.Linear(c.hidden, c.dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """One layer; ``checkpoint_body=True`` runs its body under
    ``torch.utils.checkpoint.checkpoint`` inside the forward."""

    def __init__(self, c: Config, checkpoint_body: bool = False):
        super().__init__()
        self.self_attn, self.mlp = Attention(c), MLP(c)
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(c.dim), RMSNorm(c.dim)
        self.checkpoint_body = checkpoint_body

    def body(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward(self, x):
        if self.checkpoint_body and torch.is_grad_enabled():
            return checkpoint(self.body, x, use_reentrant=False)
        return self.body(x)


class Model(nn.Module):
    def __init__(self, c: Config, layer: type[DecoderLayer], checkpoint_body: bool):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab, c.dim)
        self.layers = nn.ModuleList([layer(c, checkpoint_body) for _ in range(c.layers)])
        self.norm = RMSNorm(c.dim)

    def forward(self, tokens):
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    """Seeded; the norms' weights drawn away from one, so their gradients matter."""

    def __init__(
        self,
        config: Config = Config(),
        layer: type[DecoderLayer] = DecoderLayer,
        checkpoint_body: bool = False,
        seed: int = 0,
    ):
        super().__init__()
        torch.manual_seed(seed)
        self.config = config
        self.model = Model(config, layer, checkpoint_body)
        self.lm_head = nn.Linear(config.dim, config.vocab, bias=False)
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, RMSNorm):
                    m.weight.uniform_(0.5, 1.5)

    def forward(self, tokens):
        return self.lm_head(self.model(tokens))


def parallelize_tp(net: LlamaForCausalLM, tp_mesh) -> LlamaForCausalLM:
    """torchtitan's Llama plan in HuggingFace's names: the embedding rowwise and the output
    layer colwise, each layer's q/k/v/gate/up colwise and o/down rowwise with sequence-parallel
    outputs, the norms ``SequenceParallel``, and the attention's and MLP's inputs gathered from
    the sequence shards."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    parallelize_module(
        net,
        tp_mesh,
        {
            "model.embed_tokens": RowwiseParallel(
                input_layouts=Replicate(), output_layouts=Shard(1)
            ),
            "model.norm": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        },
    )
    for layer in net.model.layers:
        parallelize_module(
            layer,
            tp_mesh,
            {
                "input_layernorm": SequenceParallel(),
                "self_attn": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
                "self_attn.q_proj": ColwiseParallel(),
                "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(),
                "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
                "post_attention_layernorm": SequenceParallel(),
                "mlp": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
                "mlp.gate_proj": ColwiseParallel(),
                "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
            },
        )
    return net

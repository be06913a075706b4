"""A tiny Llama in HuggingFace's layout (``model.embed_tokens``, ``model.layers[i]`` with
``self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj`` and two RMSNorms, ``model.norm``,
``lm_head``), for the composition tests: activation checkpointing in its three user-facing
forms, and the standard tensor-parallel plan.

It stands in for ``transformers.LlamaForCausalLM``: the same module names, parameter shapes
and ops (RMSNorm, rotary embeddings, causal attention with grouped key/value heads, SwiGLU),
so ``parallelize_module`` takes the same plan, and it runs torchtitan's op-list selective
checkpointing, which HuggingFace's Llama does not (see docs/fsdp.md). ``checkpointing`` picks
how a layer checkpoints itself: ``None``, ``"inner"`` (``torch.utils.checkpoint.checkpoint``
around the layer's body, inside its forward) or ``"hf"`` (HuggingFace's
``GradientCheckpointingLayer``: the layer's forward checkpointed, its hooks outside).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

VOCAB, DIM, HEADS, KV_HEADS, HIDDEN, LAYERS = 32, 16, 4, 2, 24, 2
ATTENTION = "eager"


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
    freqs = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32) / half))
    angles = positions[:, None].float() * freqs[None, :]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        head = DIM // HEADS
        self.q_proj = nn.Linear(DIM, HEADS * head, bias=False)
        self.k_proj = nn.Linear(DIM, KV_HEADS * head, bias=False)
        self.v_proj = nn.Linear(DIM, KV_HEADS * head, bias=False)
        self.o_proj = nn.Linear(HEADS * head, DIM, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        head = DIM // HEADS
        # -1 heads: under tensor parallelism each rank holds a slice of them
        q = self.q_proj(x).view(b, s, -1, head).transpose(1, 2)
        k = self.k_proj(x).view(b, s, -1, head).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, head).transpose(1, 2)
        positions = torch.arange(s)
        q, k = rotary(q, positions), rotary(k, positions)
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        if ATTENTION == "sdpa":
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # HuggingFace's attn_implementation="eager"
            scores = q @ k.transpose(-1, -2) / head**0.5
            mask = torch.ones(s, s, dtype=torch.bool).triu(1)
            out = scores.masked_fill(mask, float("-inf")).softmax(-1) @ v
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Linear(DIM, HIDDEN, bias=False)
        self.up_proj = nn.Linear(DIM, HIDDEN, bias=False)
        self.down_proj = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, checkpointing: str | None = None):
        super().__init__()
        self.self_attn, self.mlp = Attention(), MLP()
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(DIM), RMSNorm(DIM)
        self.checkpointing = checkpointing

    def body(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward(self, x):
        if self.checkpointing == "inner" and torch.is_grad_enabled():
            return checkpoint(self.body, x, use_reentrant=False)
        return self.body(x)


class HFCheckpointedLayer(DecoderLayer):
    """HuggingFace's ``GradientCheckpointingLayer`` as transformers 5 writes it: the class's
    ``forward`` (not ``__call__``) runs under the checkpoint, so module hooks stay outside it,
    and a subclass (``data_parallel``'s) wraps nothing twice."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        forward = cls.forward

        @functools.wraps(forward)
        def forward_with_checkpointing(self, *args, **kwargs):
            if torch.is_grad_enabled() and type(self).forward is forward_with_checkpointing:
                return checkpoint(
                    functools.partial(forward, self, **kwargs), *args, use_reentrant=False
                )
            return forward(self, *args, **kwargs)

        cls.forward = forward_with_checkpointing


class _HFLayer(HFCheckpointedLayer):
    pass


class Model(nn.Module):
    def __init__(self, checkpointing: str | None):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, DIM)
        layer = _HFLayer if checkpointing == "hf" else DecoderLayer
        inner = "inner" if checkpointing == "inner" else None
        self.layers = nn.ModuleList([layer(inner) for _ in range(LAYERS)])
        self.norm = RMSNorm(DIM)

    def forward(self, tokens):
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    def __init__(self, checkpointing: str | None = None, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.model = Model(checkpointing)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        with torch.no_grad():  # norms away from their initial ones: their gradients matter
            for m in self.modules():
                if isinstance(m, RMSNorm):
                    m.weight.uniform_(0.5, 1.5)

    def forward(self, tokens):
        return self.lm_head(self.model(tokens))


def torchtitan_sac_policy():
    """torchtitan's op-list selective checkpointing policy (``SelectiveAC``, op mode): save
    matmuls (every second one recomputed), attention, ``max`` and the reduce-scatter; recompute
    the rest."""
    save = {
        torch.ops.aten.mm.default,
        torch.ops.aten.linear.default,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
        torch.ops.aten._scaled_dot_product_attention_math.default,
        torch.ops.aten.max.default,
        torch.ops._c10d_functional.reduce_scatter_tensor.default,
        torch.ops._c10d_functional.all_to_all_single.default,
    }
    mms = (torch.ops.aten.mm.default, torch.ops.aten.linear.default)
    counts = {"forward": 0, "recompute": 0}

    def policy(ctx, func, *args, **kwargs):
        if func in mms:
            key = "recompute" if ctx.is_recompute else "forward"
            counts[key] += 1
            if counts[key] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in save else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def apply_ac(net: LlamaForCausalLM, ac: str | None) -> LlamaForCausalLM:
    """Wrap each layer as torchtitan's ``apply_ac`` does: ``"full"`` (``checkpoint_wrapper``),
    ``"sac"`` (op-list selective) or ``"reentrant"`` (``checkpoint_wrapper`` with
    ``CheckpointImpl.REENTRANT``); other values leave the layers as they are."""
    layers = net.model.layers
    for i, layer in enumerate(layers):
        if ac == "full":
            layers[i] = checkpoint_wrapper(layer, preserve_rng_state=False)
        elif ac == "sac":
            layers[i] = checkpoint_wrapper(
                layer, context_fn=torchtitan_sac_policy, preserve_rng_state=False
            )
        elif ac == "reentrant":
            layers[i] = checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.REENTRANT)
    return net


def llama(ac: str | None = None) -> LlamaForCausalLM:
    """The stand-in with activation checkpointing ``ac``: ``None``, ``"full"``, ``"sac"``,
    ``"reentrant"`` (see :func:`apply_ac`), ``"inner"`` or ``"hf"`` (the layer checkpoints
    itself, see :class:`DecoderLayer`)."""
    return apply_ac(LlamaForCausalLM(ac if ac in ("inner", "hf") else None), ac)


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

"""The benchmarks' models: a small decoder-only transformer (the main example's shape, with its
synthetic batches), MLPs and transformers by name (:data:`MODELS`), and those models with their
blocks for FSDP (:func:`make_blocks_model`). The Llama is :mod:`.llama`."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ, BATCH = 64, 32, 16


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (
            self.qkv(self.norm1(x))
            .view(b, t, 3, self.heads, d // self.heads)
            .permute(2, 0, 3, 1, 4)
        )
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    """Decoder-only transformer: 12 parameter tensors per block plus 4."""

    def __init__(
        self, dim: int = 64, layers: int = 2, heads: int = 4, vocab: int = VOCAB, seq: int = SEQ
    ):
        super().__init__()
        self.vocab = vocab
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq, dim))
        self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(layers)])
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        return self.head(self.blocks(self.embed(tokens) + self.pos[: tokens.shape[1]]))


def batch(
    rank: int,
    step: int,
    batch_size: int = BATCH,
    seq_len: int = SEQ,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences of t -> (5 t + 3) mod VOCAB from random starts: learnable, different per rank."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    start = torch.randint(0, VOCAB, (batch_size, 1), generator=g)
    seq = [start]
    for _ in range(seq_len):
        seq.append((5 * seq[-1] + 3) % VOCAB)
    seq = torch.cat(seq, dim=1).to(device)
    return seq[:, :-1], seq[:, 1:]


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so that a host timer measures it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def loss_fn(model, tokens, targets):
    logits = model(tokens)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


MODELS = {
    "mlp-2x64": ("mlp", 64, 2, 8),
    "mlp-32x256": ("mlp", 256, 32, 32),
    "mlp-32x256-b128": ("mlp", 256, 32, 128),
    "mlp-8x1024": ("mlp", 1024, 8, 32),
    "transformer-small": ("transformer", 64, 4, 8),
    "transformer-medium": ("transformer", 256, 4, 8),
}


SMOKE_MODEL = "mlp-2x64"  # --smoke's model, here and in the scripts that take these models


def make_model(name: str, extra_dims: int) -> tuple[nn.Module, tuple, torch.Tensor]:
    """The model, its input and target. ``extra_dims`` adds a one-element parameter of that
    rank: compiled autograd caches backward graphs by structure and would otherwise serve every
    compiled configuration the graph it compiled first."""
    kind, width, depth, batch_size = MODELS[name]
    torch.manual_seed(0)
    if kind == "mlp":
        net = nn.Sequential(
            *[m for _ in range(depth) for m in (nn.Linear(width, width), nn.ReLU())]
        )
        g = torch.Generator().manual_seed(dist.get_rank())
        inputs = (torch.randn(batch_size, width, generator=g),)
        target = torch.randn(batch_size, width, generator=g)
    else:
        net = TinyTransformer(dim=width, layers=depth)
        tokens, target = batch(dist.get_rank(), 0, batch_size=batch_size, seq_len=32)
        inputs = (tokens,)
    net.register_parameter("extra", nn.Parameter(torch.zeros((1,) * extra_dims)))
    return net, inputs, target


def loss_of(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if target.dtype == torch.long:
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))
    return F.mse_loss(out, target)


MLPS = ["mlp-2x64", "mlp-8x1024"]  # ddp_sync.py's models of these names


def make_blocks_model(name: str, tag: int) -> tuple[nn.Module, list[nn.Module], torch.Tensor]:
    """(model, blocks, input). ``tag`` sizes a parameter that makes each configuration's graph
    its own (Dynamo would otherwise serve one configuration's graph to another)."""
    torch.manual_seed(0)
    if name in MLPS:
        _, width, depth, batch = MODELS[name]
        model = nn.Sequential(
            *[m for _ in range(depth) for m in (nn.Linear(width, width), nn.ReLU())]
        )
        blocks, x = [m for m in model if isinstance(m, nn.Linear)], torch.randn(batch, width)
    else:
        model = TinyTransformer(dim=256, layers=4)
        blocks, x = list(model.blocks), torch.randint(0, model.vocab, (8, 32))
    return Tagged(model, tag), blocks, x


class Tagged(nn.Module):
    def __init__(self, model: nn.Module, tag: int):
        super().__init__()
        self.model, self.tag = model, nn.Parameter(torch.zeros(2 * (tag + 1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x) + self.tag.sum()

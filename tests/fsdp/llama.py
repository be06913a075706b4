"""The tiny Llama of ``benchmarks/common/llama.py`` (HuggingFace's layout) as the composition tests
build it: with activation checkpointing in each of its user-facing forms (:func:`llama`), and
with torchtitan's tensor-parallel plan (:func:`parallelize_tp`)."""

from __future__ import annotations

import functools

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from benchmarks.common.llama import Config, DecoderLayer, LlamaForCausalLM, parallelize_tp
from tests.fsdp.test_data_parallel import rel

__all__ = [
    "llama",
    "parallelize_tp",
    "batches",
    "loss_backward",
    "train_side_by_side",
    "capturing_first",
    "torchtitan_sac_policy",
    "VOCAB",
    "LAYERS",
]

VOCAB, LAYERS = Config().vocab, Config().layers


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
    ``"reentrant"`` (see :func:`apply_ac`), ``"inner"`` (``checkpoint`` inside each layer's
    forward) or ``"hf"`` (HuggingFace's checkpointed layer, :class:`HFCheckpointedLayer`)."""
    layer = _HFLayer if ac == "hf" else DecoderLayer
    return apply_ac(LlamaForCausalLM(layer=layer, checkpoint_body=ac == "inner"), ac)


def batches(seed: int, steps: int = 3, micro_batches: int = 1) -> list[list[torch.Tensor]]:
    """``steps`` lists of ``micro_batches`` token batches (2 x 8), seeded."""
    g = torch.Generator().manual_seed(seed)
    return [
        [torch.randint(0, VOCAB, (2, 8), generator=g) for _ in range(micro_batches)]
        for _ in range(steps)
    ]


def loss_backward(module, tokens: torch.Tensor) -> None:
    module(tokens).square().mean().backward()


def train_side_by_side(ref, model, steps, backward=None) -> float:
    """SGD steps (lr 0.5) of ``ref`` and ``model`` over ``steps`` (lists of micro-batches, whose
    gradients add up); ``backward(step, tokens)`` runs ``model``'s forward and backward (default
    :func:`loss_backward`), for a caller that compiles, counts or captures it. The largest
    relative difference of the two models' parameters, as full tensors, after the last step."""
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (ref, model)]
    for i, micro_batches in enumerate(steps):
        for tokens in micro_batches:
            loss_backward(ref, tokens)
            (backward or (lambda _, t: loss_backward(model, t)))(i, tokens)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    return max(
        rel(b.full_tensor(), a.full_tensor()) for a, b in zip(ref.parameters(), model.parameters())
    )


def capturing_first(run, codes: list[str]):
    """A ``backward`` for :func:`train_side_by_side` that runs ``run``'s step, the first one
    under ``run_and_get_code``: the code Inductor generates for it goes to ``codes``."""
    from torch._inductor.utils import run_and_get_code

    def backward(step: int, tokens: torch.Tensor) -> None:
        if step:
            return loss_backward(run, tokens)
        codes.extend(run_and_get_code(loss_backward, run, tokens)[1])

    return backward

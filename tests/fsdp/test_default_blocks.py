"""data_parallel's default blocks (compiled_hooks.fsdp.default_blocks) on stand-ins for the
layouts of torchtitan, HuggingFace and nanoGPT models, the warning when none is found, and one
all-gather and one reduce-scatter per found block after the passes (fake process group)."""

import warnings

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from compiled_hooks.fsdp import data_parallel, default_blocks
from passes import bucket_block_all_gathers, bucket_block_reduce_scatters
from passes.testing import fake_process_group
from tests.graphs import data_parallel_graphs, gather_reduce_counts

VOCAB, DIM, LAYERS = 16, 8, 3


class Layer(nn.Module):
    """A transformer layer's shape: a norm, an attention stand-in and a feed-forward
    ``nn.Sequential`` (a stack inside a block, which the search must not enter)."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.attention = nn.Linear(DIM, DIM)
        self.feed_forward = nn.Sequential(
            nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM)
        )

    def forward(self, x):
        x = x + self.attention(self.norm(x))
        return x + self.feed_forward(x)


class OtherLayer(Layer):
    """A second layer class, as hybrid models mix them."""


class TitanModuleDict(nn.ModuleDict):
    """torchtitan's ``protocols.module.ModuleDict``: a subclass."""


class TitanDecoder(nn.Module):
    """torchtitan 0.3.0's ``Decoder``: ``layers``, a ``ModuleDict`` subclass keyed "0", "1", ..."""

    def __init__(self, layer_classes=(Layer,) * LAYERS):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = TitanModuleDict()
        for i, cls in enumerate(layer_classes):
            self.layers[str(i)] = cls()
        self.norm = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.lm_head(self.norm(h))


class GPT2Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, DIM), nn.Embedding(VOCAB, DIM)
        self.drop = nn.Dropout(0.0)
        self.h = nn.ModuleList(Layer() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(DIM)


class GPT2LMHeadModel(nn.Module):
    """HuggingFace GPT-2: ``transformer.h`` is an ``nn.ModuleList``; the head is tied."""

    def __init__(self):
        super().__init__()
        self.transformer = GPT2Model()
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.lm_head.weight = self.transformer.wte.weight


class RotaryEmbedding(nn.Module):
    """Buffers, no parameters."""

    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", torch.ones(DIM // 2))


class LlamaModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.rotary_emb = RotaryEmbedding()


class LlamaForCausalLM(nn.Module):
    """HuggingFace Llama: ``model.layers`` is an ``nn.ModuleList``."""

    def __init__(self):
        super().__init__()
        self.model = LlamaModel()
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)


class NanoGPT(nn.Module):
    """nanoGPT: ``transformer`` is an ``nn.ModuleDict`` of the model's parts (a namespace, not a
    stack), whose ``h`` is the stack."""

    def __init__(self):
        super().__init__()
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(VOCAB, DIM),
                wpe=nn.Embedding(VOCAB, DIM),
                drop=nn.Dropout(0.0),
                h=nn.ModuleList(Layer() for _ in range(LAYERS)),
                ln_f=nn.LayerNorm(DIM),
            )
        )
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)


class IssueReproduction(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): nn.Linear(8, 8) for i in range(2)})


class NoStack(nn.Module):
    """No repeated blocks: every parameter is the root's."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB)


def layers(prefix, n=LAYERS):
    return [f"{prefix}{i}" for i in range(n)]


LAYOUTS = {
    "issue_module_dict": (IssueReproduction, layers("layers.", 2)),
    "torchtitan": (TitanDecoder, layers("layers.")),
    "torchtitan_hybrid": (lambda: TitanDecoder((Layer, OtherLayer, Layer)), layers("layers.")),
    "hf_gpt2": (GPT2LMHeadModel, layers("transformer.h.")),
    "hf_llama": (LlamaForCausalLM, layers("model.layers.")),
    "nanogpt": (NanoGPT, layers("transformer.h.")),
    "sequential_root": (
        lambda: nn.Sequential(nn.Linear(DIM, DIM), nn.ReLU(), nn.Linear(DIM, DIM)),
        ["0", "2"],
    ),
    "a_namespace_of_one_class_is_a_stack": (
        lambda: nn.ModuleDict({"encoder": Layer(), "decoder": Layer()}),
        ["encoder", "decoder"],
    ),
    "no_stack": (NoStack, []),
    "one_module": (lambda: nn.Linear(DIM, DIM), []),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_default_blocks(layout):
    make, expected = LAYOUTS[layout]
    model = make()
    found = default_blocks(model)
    assert list(found) == expected
    assert all(found[path] is model.get_submodule(path) for path in expected)


def data_parallel_blocks(model, **kwargs):
    """Shard ``model`` on a fake group of 2; the blocks its parameters were given to, and the
    warnings ``data_parallel`` raised."""
    fake_process_group(2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        data_parallel(model, init_device_mesh("cpu", (2,)), **kwargs)
    blocks = {
        layout.block
        for m in model.modules()
        for layout in getattr(m, "_data_parallel_layouts", {}).values()
    }
    return blocks, [w for w in caught if "data_parallel" in str(w.message)]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_data_parallel_gathers_per_default_block_and_warns_when_none_is_found(layout):
    make, expected = LAYOUTS[layout]
    model = make()
    outside = [
        n for n, _ in model.named_parameters() if not any(n.startswith(b + ".") for b in expected)
    ]
    blocks, warned = data_parallel_blocks(model)
    assert blocks == set(expected) | ({""} if outside else set())  # "": the root's
    if layout == "no_stack":
        [warning] = warned
        assert warning.category is UserWarning
        assert "no blocks found in NoStack" in str(warning.message)
        assert "blocks=" in str(warning.message)
        assert warning.filename == __file__  # attributed to the caller of data_parallel
    else:  # blocks found, or one module: nothing to split
        assert warned == []


def test_no_warning_when_blocks_are_passed():
    model = NoStack()
    blocks, warned = data_parallel_blocks(model, blocks=[model.proj])
    assert blocks == {"", "proj"} and warned == []
    blocks, warned = data_parallel_blocks(NoStack(), blocks=[])
    assert blocks == {""} and warned == []


def test_module_dict_blocks_one_all_gather_and_one_reduce_scatter_each_after_the_passes():
    """The torchtitan layout on 4 fake ranks: after the block passes, the forward gathers the
    root and each layer once, and the backward reduce-scatters each once."""
    fake_process_group(4)
    model = data_parallel(TitanDecoder(), init_device_mesh("cpu", (4,)))
    counts = {}
    for kind, gm in data_parallel_graphs(model, torch.randint(0, VOCAB, (2, 5))):
        bucket_block_all_gathers(gm.graph)
        bucket_block_reduce_scatters(gm.graph)
        gm.graph.lint()
        counts[kind] = gather_reduce_counts(gm)
    blocks = 1 + LAYERS  # the root (embedding, norm, head) and each layer
    # the backward gathers again (reshard_after_forward=True)
    assert counts == {"forward": [blocks, 0], "backward": [blocks, blocks]}

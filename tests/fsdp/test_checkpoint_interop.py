"""torch.distributed.checkpoint between FSDP2 and data_parallel: a checkpoint of model and
optimizer saved by one loads into the other, on the same mesh and on another data-parallel
size, 1-D and with tensor parallelism, bitwise."""

import os
import tempfile

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from compiled_hooks.fsdp import data_parallel
from tests.fsdp.llama import VOCAB, llama, parallelize_tp
from tests.ranks import run_ranks


def build(framework, world_size, tp):
    """The stand-in Llama, sharded by ``framework`` (``"fsdp2"`` or ``"data_parallel"``) over
    every rank, or over ``dp`` with TP over ``tp`` (2) when ``tp``; and AdamW over it."""
    if tp:
        mesh = init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("dp", "tp"))
        net, dp = parallelize_tp(llama(), mesh["tp"]), mesh["dp"]
    else:
        net, dp = llama(), init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    if framework == "fsdp2":
        for layer in net.model.layers:
            fully_shard(layer, mesh=dp)
        fully_shard(net, mesh=dp)
    else:
        data_parallel(net, dp)
    return net, torch.optim.AdamW(net.parameters(), lr=1e-2)


def full_state(model, opt):
    """Every tensor of the model's and the optimizer's state dicts, as full tensors, by key."""
    model_sd, opt_sd = get_state_dict(model, opt)
    out = {f"model.{k}": v.full_tensor() for k, v in model_sd.items()}
    for fqn, state in opt_sd["state"].items():
        for k, v in state.items():
            out[f"optim.{fqn}.{k}"] = v.full_tensor() if hasattr(v, "full_tensor") else v
    return out


def save_worker(rank, world_size, framework, tp, path):
    model, opt = build(framework, world_size, tp)
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):
        model(torch.randint(0, VOCAB, (2, 8), generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    model_sd, opt_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": opt_sd}, checkpoint_id=path)
    return full_state(model, opt)


def load_worker(rank, world_size, framework, tp, path):
    model, opt = build(framework, world_size, tp)
    model(torch.randint(0, VOCAB, (2, 8))).square().mean().backward()
    opt.step()  # optimizer state for the load to overwrite
    opt.zero_grad()
    model_sd, opt_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": opt_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return full_state(model, opt)


RUNS = [
    pytest.param("fsdp2", 2, "data_parallel", 2, False, id="fsdp2-to-data_parallel"),
    pytest.param("data_parallel", 2, "fsdp2", 2, False, id="data_parallel-to-fsdp2"),
    pytest.param("fsdp2", 2, "data_parallel", 4, False, id="fsdp2-dp2-to-data_parallel-dp4"),
    pytest.param("data_parallel", 4, "fsdp2", 2, False, id="data_parallel-dp4-to-fsdp2-dp2"),
    pytest.param("fsdp2", 4, "data_parallel", 4, True, id="tp-fsdp2-to-data_parallel"),
    pytest.param("data_parallel", 4, "fsdp2", 4, True, id="tp-data_parallel-to-fsdp2"),
]


@pytest.mark.slow
@pytest.mark.parametrize("saver,save_size,loader,load_size,tp", RUNS)
def test_checkpoint_loads_bitwise(saver, save_size, loader, load_size, tp):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt")
        saved = run_ranks(save_worker, save_size, saver, tp, path)[0]
        for loaded in run_ranks(load_worker, load_size, loader, tp, path):
            assert loaded.keys() == saved.keys()
            for key, value in saved.items():
                assert torch.equal(loaded[key], value), key

"""benchmarks/fsdp_memory.py: its rows on 2 fake ranks, and the claims it checks (activation
checkpointing keeps data_parallel's activations at or under FSDP2's, and a resharding step
with it gathers one block at a time)."""

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from benchmarks import fsdp_memory
from passes.testing import fake_process_group


@pytest.mark.slow
def test_rows_and_checks():
    fake_process_group(2)
    mesh = init_device_mesh("cpu", (2,))
    rows = fsdp_memory.measure(mesh)
    verdicts = fsdp_memory.checks(rows)
    assert len(verdicts) == 3 and all(v.startswith("OK") for v in verdicts), verdicts
    by = {r["config"]: r for r in rows}
    # checkpointing cuts what each configuration holds; keeping holds every gathered weight
    for name in fsdp_memory.ROWS:
        for mode in ("reshard", "keep"):
            with_ac, without = by[f"{name}, {mode}, full AC"], by[f"{name}, {mode}, no AC"]
            assert with_ac["activations_mb"] < without["activations_mb"] / 4, (name, mode)
    model = fsdp_memory.make_model(False)[0]
    weights = sum(p.numel() * 4 for p in model.parameters() if p.dim() == 2) / 2**20
    assert by["data_parallel compiled, keep, full AC"]["gathered_mb"] >= weights
    assert by["data_parallel compiled, reshard, full AC"]["gathered_mb"] == 0
    torch._dynamo.reset()

"""Misuse of the public API raises a clear error on every rank before any collective.

Each case runs on 2 gloo ranks under a dispatch mode that counts c10d ops, with its own
timeout; a case passes when every rank raised the expected type and message and issued no
collective. The group stays usable afterwards (a final all_reduce agrees), so no rank is left
diverged. Covers the hooks, their states, the DDP adapter, FSDP2 registration, data_parallel, the
scaler, ZeRO, the passes, Pipeline, install and the tracing helper.
"""

import functools
import os
import re
import signal
import weakref

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as ddp_default_hooks
from torch.utils._python_dispatch import TorchDispatchMode

import compiled_hooks as ch
import passes
from compiled_hooks.zero import ZeroOptimizer, hook_with_zero_step, hook_with_zero_step_interleaved
from tests.ranks import run_ranks


class CountCollectives(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("_c10d_functional", "c10d"):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _state(g):
    return ch.DefaultState(g)


def _lp(g, dtype=torch.float32):
    return ch.LowPrecisionState(g, dtype)


def _psgd(g, **kw):
    return ch.powersgd.PowerSGDState(g, start_powerSGD_iter=2, **kw)


_SERVED = {}


def _psgd_served():
    """A state that served one model for two steps (run before the cases: it communicates)."""
    state, a = _psgd(dist.group.WORLD), torch.nn.Parameter(torch.ones(8, 8))
    for _ in range(2):
        ch.powersgd.powerSGD_hook(state, torch.ones(8, 8), param=a)
    _SERVED["state"] = state


def _psgd_two_models(g):
    ch.powersgd.powerSGD_hook(
        _SERVED["state"], torch.ones(8, 8), param=torch.nn.Parameter(torch.ones(8, 8))
    )


# id: (call(group), exception type, message fragment)
CASES = {
    "powersgd_rank_0": (
        lambda g: _psgd(g, matrix_approximation_rank=0),
        ValueError,
        "matrix_approximation_rank must be >= 1",
    ),
    "powersgd_group_list": (
        lambda g: ch.powersgd.PowerSGDState([0, 1]),
        TypeError,
        "expects a torch.distributed.ProcessGroup",
    ),
    "powersgd_start_1_with_error_feedback": (
        lambda g: ch.powersgd.PowerSGDState(g, start_powerSGD_iter=1),
        ValueError,
        "start_powerSGD_iter must be > 1",
    ),
    "powersgd_integer_grad": (
        lambda g: ch.powersgd.powerSGD_hook(_psgd(g), torch.ones(4, 4, dtype=torch.int32)),
        TypeError,
        "grad must be a floating-point tensor",
    ),
    "powersgd_wrong_state": (
        lambda g: ch.powersgd.powerSGD_hook(_state(g), torch.ones(4, 4)),
        TypeError,
        "state must be a PowerSGDState",
    ),
    "powersgd_state_with_two_models": (
        _psgd_two_models,
        ValueError,
        "make one PowerSGDState per DDP model",
    ),
    "state_without_group": (lambda g: ch.DefaultState(None), ValueError, "explicit ProcessGroup"),
    "state_with_rank_list": (
        lambda g: ch.DefaultState([0, 1]),
        TypeError,
        "expects a torch.distributed.ProcessGroup",
    ),
    "low_precision_int_type": (
        lambda g: _lp(g, torch.int32),
        TypeError,
        "parameter_type must be a floating",
    ),
    "int8_bits_4": (
        lambda g: ch.QuantizedState(g, bits=4),
        ValueError,
        "bits must be 8",
    ),
    "int8_block_size_0": (
        lambda g: ch.QuantizedState(g, block_size=0),
        ValueError,
        "block_size must be >= 1",
    ),
    "int8_default_state": (
        lambda g: ch.int8_compress_hook(_state(g), torch.ones(4)),
        TypeError,
        "state must be a QuantizedState",
    ),
    "int8_error_feedback_without_param": (
        lambda g: ch.int8_compress_hook(ch.QuantizedState(g), torch.ones(4)),
        ValueError,
        "the hook needs param=",
    ),
    "int8_output_size": (
        lambda g: ch.int8_compress_hook(
            ch.QuantizedState(g, error_feedback=False), torch.ones(6), torch.empty(2)
        ),
        ValueError,
        "reduce-scatter needs grad.numel\\(\\) == world_size",
    ),
    "no_state": (
        lambda g: ch.allreduce_hook(None, torch.ones(4)),
        TypeError,
        "state must be a DefaultState",
    ),
    "default_state_to_compress_hook": (
        lambda g: ch.bf16_compress_hook(_state(g), torch.ones(4)),
        TypeError,
        "state must be a LowPrecisionState",
    ),
    "group_removed_from_state": (
        lambda g: ch.allreduce_hook(_without_group(_state(g)), torch.ones(4)),
        ValueError,
        "process_group is None",
    ),
    "grad_not_tensor": (
        lambda g: ch.allreduce_hook(_state(g), [1.0, 2.0]),
        TypeError,
        "grad must be a torch.Tensor",
    ),
    "integer_grad": (
        lambda g: ch.allreduce_hook(_state(g), torch.ones(4, dtype=torch.int64)),
        TypeError,
        "grad must be a floating-point tensor, got dtype torch.int64",
    ),
    "sparse_grad": (
        lambda g: ch.allreduce_hook(_state(g), torch.ones(4).to_sparse()),
        TypeError,
        "dense \\(strided\\) tensor",
    ),
    "parameter_instead_of_grad": (
        lambda g: ch.allreduce_hook(_state(g), torch.nn.Parameter(torch.ones(4))),
        ValueError,
        "leaf that requires grad",
    ),
    "reduce_scatter_wrong_size": (
        lambda g: ch.reduce_scatter_hook(_state(g), torch.ones(10), torch.empty(4)),
        ValueError,
        "grad.numel\\(\\)=10, world_size=2, output.numel\\(\\)=4",
    ),
    "reduce_scatter_missing_output": (
        lambda g: ch.reduce_scatter_hook(_state(g), torch.ones(8), None),
        TypeError,
        "output must be a torch.Tensor",
    ),
    "reduce_scatter_output_dtype": (
        lambda g: ch.reduce_scatter_hook(
            _state(g), torch.ones(8), torch.empty(4, dtype=torch.float64)
        ),
        TypeError,
        "output has dtype torch.float64 but the result is torch.float32",
    ),
    "reduce_scatter_output_device": (
        lambda g: ch.reduce_scatter_hook(_state(g), torch.ones(8), torch.empty(4, device="meta")),
        ValueError,
        "output is on meta but grad is on cpu",
    ),
    "compress_grad_not_parameter_type": (
        lambda g: ch.bf16_compress_hook(_lp(g), torch.ones(4, dtype=torch.bfloat16)),
        TypeError,
        "grad has dtype torch.bfloat16 but the result is torch.float32",
    ),
    "compress_output_not_parameter_type": (
        lambda g: ch.fp16_compress_hook(_lp(g), torch.ones(8), torch.empty(4, dtype=torch.float16)),
        TypeError,
        "output has dtype torch.float16 but the result is torch.float32",
    ),
    "compress_output_wrong_size": (
        lambda g: ch.fp16_compress_hook(_lp(g), torch.ones(8), torch.empty(3)),
        ValueError,
        "reduce-scatter needs grad.numel\\(\\) == world_size \\* output.numel\\(\\)",
    ),
    "ddp_wrap_reduce_scatter_hook": (
        lambda g: ch.ddp_comm_hook(ch.reduce_scatter_hook),
        TypeError,
        "reduce-scatter hooks",
    ),
    "ddp_wrap_not_callable": (lambda g: ch.ddp_comm_hook(42), TypeError, "hook must be callable"),
    "pass_given_a_graph_module": (
        lambda g: passes.fold_collective_scaling(_traced()),
        TypeError,
        "got a GraphModule; pass gm.graph",
    ),
    "pass_given_a_string": (
        lambda g: passes.bucket_compressed_collectives("graph"),
        TypeError,
        "expected a torch.fx.Graph",
    ),
    "pipeline_given_a_module": (
        lambda g: passes.default_pipeline().run(torch.nn.Linear(2, 2)),
        TypeError,
        "expected a torch.fx.Graph",
    ),
    "pipeline_unknown_option": (
        lambda g: passes.default_pipeline(bucket_size=3),
        ValueError,
        "no pass takes option",
    ),
    "pipeline_not_a_pass": (lambda g: passes.Pipeline([42]), TypeError, "a pass must be callable"),
    "bucket_cap_not_positive": (
        lambda g: passes.bucket_compressed_collectives(_traced().graph, bucket_cap_mb=-1),
        ValueError,
        "must be positive",
    ),
    "install_a_pass_not_a_pipeline": (
        lambda g: passes.install(passes.fold_collective_scaling),
        TypeError,
        "expected a passes.Pipeline",
    ),
    "trace_with_other_world_size": (
        lambda g: passes.testing.trace(lambda x: x, torch.ones(1), world_size=8),
        ValueError,
        "a gloo process group of size 2 is initialized",
    ),
    "fsdp_hook_on_plain_module": (
        lambda g: ch.fsdp.register_comm_hook(
            torch.nn.Linear(2, 2), _state(g), ch.reduce_scatter_hook
        ),
        TypeError,
        "expected a module to which fully_shard or replicate was applied",
    ),
    "fsdp_hook_with_bad_state": (
        lambda g: ch.fsdp.register_comm_hook(_sharded(), object(), ch.reduce_scatter_hook),
        TypeError,
        "state must be a DefaultState",
    ),
    "fsdp_hook_on_hsdp": (
        lambda g: ch.fsdp.register_comm_hook(_hsdp(), _state(g), ch.reduce_scatter_hook),
        NotImplementedError,
        "HSDP",
    ),
    "data_parallel_hybrid_on_1d_mesh": (
        lambda g: ch.fsdp.data_parallel(torch.nn.Linear(2, 2), _mesh(), mode="hybrid_shard"),
        ValueError,
        "mode 'hybrid_shard' needs a 2-D",
    ),
    "data_parallel_on_fsdp2_module": (
        lambda g: ch.fsdp.data_parallel(torch.nn.Sequential(_sharded()), _mesh()),
        ValueError,
        "already wrapped by FSDP2",
    ),
    "data_parallel_twice": (
        lambda g: ch.fsdp.data_parallel(_native(), _mesh()),
        ValueError,
        "already wrapped by data_parallel",
    ),
    "data_parallel_gather_dtype_not_int8": (
        lambda g: ch.fsdp.data_parallel(
            torch.nn.Linear(2, 2), _mesh(), gather_dtype=torch.bfloat16
        ),
        ValueError,
        "gather_dtype must be None .* or torch.int8, got torch.bfloat16",
    ),
    "data_parallel_int8_gathers_on_replicas": (
        lambda g: ch.fsdp.data_parallel(
            torch.nn.Linear(2, 2), _mesh(), mode="replicate", gather_dtype=torch.int8
        ),
        ValueError,
        "mode 'replicate' gathers nothing",
    ),
    "data_parallel_tp_mesh_as_data_parallel_mesh": (
        lambda g: ch.fsdp.data_parallel(_tensor_parallel()[0], _tensor_parallel()[1]["tp"]),
        ValueError,
        "is not a sibling dimension of the data-parallel mesh",
    ),
    "data_parallel_tp_with_unnamed_mesh": (
        lambda g: ch.fsdp.data_parallel(_tensor_parallel()[0], _mesh()),
        ValueError,
        "both meshes need named dimensions",
    ),
    "data_parallel_params_on_two_devices": (
        lambda g: ch.fsdp.data_parallel(_two_devices(), _mesh()),
        ValueError,
        "on several devices",
    ),
    "data_parallel_all_reduce_hook_on_shards": (
        lambda g: ch.fsdp.register_comm_hook(_native(), _state(g), ch.allreduce_hook),
        TypeError,
        "cannot reduce a 'fully_shard' module",
    ),
    "data_parallel_reduce_scatter_hook_on_replicas": (
        lambda g: ch.fsdp.register_comm_hook(
            _native("replicate"), _state(g), ch.reduce_scatter_hook
        ),
        TypeError,
        "cannot reduce a 'replicate' module",
    ),
    "data_parallel_switch_inside_forward": (
        lambda g: _switching_in_forward()(torch.ones(1, 2)),
        RuntimeError,
        "set_requires_gradient_sync: called inside the data_parallel module's forward",
    ),
    "data_parallel_switch_not_bool": (
        lambda g: _native().set_requires_gradient_sync(1),
        TypeError,
        "requires_gradient_sync must be a bool, got int",
    ),
    "data_parallel_mesh_with_pipeline_dim": (
        lambda g: ch.fsdp.data_parallel(torch.nn.Linear(2, 2), _pp_mesh()["pp"]),
        ValueError,
        "includes the pipeline dimension 'pp'",
    ),
    "data_parallel_block_called_alone": (
        lambda g: _native()[0](torch.ones(1, 2)),
        RuntimeError,
        "ran outside its root's forward",
    ),
    "data_parallel_hook_on_non_root": (
        lambda g: ch.fsdp.register_comm_hook(_native()[0], _state(g), ch.reduce_scatter_hook),
        AssertionError,
        "can only be called on a root instance",
    ),
    "zero_group_bad_hyperparameter": (
        lambda g: ZeroOptimizer(
            [{"params": [_param()]}, {"params": [_param()], "eps": -1.0}], torch.optim.AdamW, lr=0.1
        ),
        ValueError,
        "Invalid epsilon value",
    ),
    "zero_groups_keeping_different_state": (
        lambda g: ZeroOptimizer(
            [{"params": [_param()]}, {"params": [_param()], "momentum": 0.0}],
            torch.optim.SGD,
            lr=0.1,
            momentum=0.9,
        ),
        ValueError,
        "every parameter group must keep the same state",
    ),
    "zero_scheduler_zeroes_momentum": (
        lambda g: torch.optim.lr_scheduler.OneCycleLR(
            ZeroOptimizer([_param()], torch.optim.SGD, lr=0.1, momentum=0.9),
            max_lr=0.1,
            total_steps=10,
            base_momentum=0.0,
            max_momentum=0.0,
        ),
        ValueError,
        "changed its update's form \\(momentum True -> False",
    ),
    "zero_bad_max_norm": (
        lambda g: ZeroOptimizer([_param()], torch.optim.SGD, lr=0.1, max_norm=0.0),
        ValueError,
        "max_norm must be a positive number",
    ),
    "zero_clipping_interleaved": (
        lambda g: hook_with_zero_step_interleaved(
            ch.allreduce_hook,
            _ddp_zero()[0],
            ZeroOptimizer(
                _ddp_zero()[0].module.parameters(), torch.optim.AdamW, lr=0.1, max_norm=1.0
            ),
        ),
        ValueError,
        "clips gradients \\(max_norm=1.0\\), .* use hook_with_zero_step",
    ),
    "zero_param_group_after_hooks": (
        lambda g: _zero_with_hooks().add_param_group({"params": [_param()]}),
        RuntimeError,
        "already laid out for the ZeRO hooks",
    ),
    "zero_step_hook_with_zero_hooks": (
        lambda g: _zero_with_hooks().register_step_pre_hook(lambda *a: None),
        RuntimeError,
        "step hooks run around step\\(\\)",
    ),
    "zero_consolidate_to_no_rank": (
        lambda g: _ddp_zero()[1].consolidate_state_dict(to=2),
        ValueError,
        "to=2 is not a rank of the group",
    ),
    "zero_param_without_grad": (
        lambda g: ZeroOptimizer([torch.zeros(2)], torch.optim.SGD, lr=0.1),
        ValueError,
        "does not require grad",
    ),
    "zero_mixed_dtypes": (
        lambda g: ZeroOptimizer(
            [_param(), torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))],
            torch.optim.SGD,
            lr=0.1,
        ),
        TypeError,
        "one dtype and device",
    ),
    "zero_unsupported_optimizer": (
        lambda g: ZeroOptimizer([_param()], torch.optim.Adagrad, lr=0.1),
        TypeError,
        "supports torch.optim.SGD, Adam and AdamW",
    ),
    "zero_amsgrad": (
        lambda g: ZeroOptimizer([_param()], torch.optim.Adam, lr=0.1, amsgrad=True),
        ValueError,
        "amsgrad=True\\) is not supported",
    ),
    "zero_bad_hyperparameter": (
        lambda g: ZeroOptimizer([_param()], torch.optim.SGD, lr=-1.0),
        ValueError,
        "Invalid learning rate",
    ),
    "zero_wrong_gradient_shape": (
        lambda g: _ddp_zero()[1].update(0, torch.zeros(3)),
        ValueError,
        "gradient of shape \\(3,\\)",
    ),
    "zero_hook_shard_buckets_mismatch": (
        lambda g: hook_with_zero_step(ch.allreduce_hook, *_ddp_zero(), shard_buckets=True),
        ValueError,
        "shard_buckets=True but the ZeroOptimizer was built with shard_buckets=False",
    ),
    "zero_hook_other_parameters": (
        lambda g: hook_with_zero_step(
            ch.allreduce_hook, _ddp_zero()[0], ZeroOptimizer([_param()], torch.optim.SGD, lr=0.1)
        ),
        ValueError,
        "exactly the DDP module's parameters",
    ),
    "zero_hook_with_reduce_scatter_hook": (
        lambda g: hook_with_zero_step_interleaved(ch.reduce_scatter_hook, *_ddp_zero()),
        TypeError,
        "hook must be callable as hook\\(state, grad\\)",
    ),
    "zero_hook_torch_ddp_hook_compiled": (
        lambda g: _with_python_reducer_flag(
            lambda: hook_with_zero_step(
                ddp_default_hooks.allreduce_hook, *_ddp_zero_python_reducer()
            )
        ),
        TypeError,
        "allreduce_hook is a DDP comm hook .* only eager DDP's C\\+\\+ reducer can run",
    ),
    "zero_hook_torch_ddp_hook_shard_buckets": (
        lambda g: hook_with_zero_step_interleaved(
            ddp_default_hooks.fp16_compress_hook, *_ddp_zero_sharded(), shard_buckets=True
        ),
        TypeError,
        "fp16_compress_hook is a DDP comm hook, which runs on DDP's own bucket",
    ),
    "zero_hook_powersgd": (
        lambda g: hook_with_zero_step(ch.ddp_comm_hook(ch.powersgd.powerSGD_hook), *_ddp_zero()),
        TypeError,
        "keeps state per parameter",
    ),
    "zero_hook_not_callable": (
        lambda g: hook_with_zero_step("allreduce", *_ddp_zero()),
        TypeError,
        "hook must be callable",
    ),
    "zero_hook_ddp_not_python_reducer": (
        lambda g: _with_python_reducer_flag(
            lambda: hook_with_zero_step(ch.allreduce_hook, *_ddp_zero())
        ),
        ValueError,
        "built before torch._dynamo.config.optimize_ddp = 'python_reducer'",
    ),
    "zero_load_state_dict_other_model": (
        lambda g: _ddp_zero()[1].load_state_dict(
            {"state": {}, "param_groups": [{"params": [0, 1, 2]}]}
        ),
        ValueError,
        "expected parameter groups of \\[2\\] parameters, got \\[3\\]",
    ),
    "scaler_unscale_twice": (
        lambda g: _unscale_twice(),
        RuntimeError,
        "unscale_\\(\\) has already been called",
    ),
    "scaler_unsupported_optimizer": (
        lambda g: _scaler_step(torch.optim.Adagrad),
        TypeError,
        "supports SGD, Adam, AdamW",
    ),
    "compiled_autograd_without_python_reducer": (
        lambda g: ch.compiled_autograd().__enter__(),
        RuntimeError,
        "optimize_ddp = 'python_reducer'",
    ),
    "check_ranks_not_a_bool": (
        lambda g: passes.install(check_ranks="yes"),
        TypeError,
        "check_ranks must be True, False or None",
    ),
    "check_ranks_env_not_a_flag": (
        lambda g: _with_env("PASSES_CHECK_RANKS", "on", passes.default_pipeline),
        ValueError,
        "environment variable PASSES_CHECK_RANKS='on': expected 1, 0, true or false",
    ),
    "verify_env_not_a_flag": (
        lambda g: _with_env("PASSES_VERIFY", "maybe", passes.default_pipeline),
        ValueError,
        "environment variable PASSES_VERIFY='maybe': expected 1, 0, true or false",
    ),
    "check_ranks_with_a_pipeline": (
        lambda g: passes.install(
            passes.Pipeline([passes.fold_collective_scaling]), check_ranks=True
        ),
        ValueError,
        "pass check_ranks= to the Pipeline you give",
    ),
    "check_ranks_on_an_unknown_group": (
        lambda g: torch.ops.compiled_hooks.check_ranks(
            '{"no-such-group": [["all_reduce", ["sum"], ["float32", [4]], ""]]}'
        ),
        RuntimeError,
        "process group 'no-such-group', which this process does not know",
    ),
}


@functools.cache
def _traced():
    """A hook graph traced against the real group (built before the cases run: tracing
    dispatches collectives on fake tensors, which the counter would see)."""
    hook = ch.allreduce_hook
    state = _state(dist.group.WORLD)
    return passes.testing.trace(lambda t: (hook(state, t), t)[1], torch.ones(4), world_size=None)


@functools.cache
def _sharded():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    return fully_shard(
        torch.nn.Linear(2, 2), mesh=init_device_mesh("cpu", (dist.get_world_size(),))
    )


@functools.cache
def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


@functools.cache
def _tensor_parallel():
    """A colwise-parallel Linear over the ``tp`` dimension of a (dp=1, tp=2) mesh, and the mesh
    (both communicate while built, so they are built before the cases)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("dp", "tp"))
    return parallelize_module(torch.nn.Linear(2, 4), mesh["tp"], ColwiseParallel()), mesh


def _native(mode="fully_shard"):
    return ch.fsdp.data_parallel(torch.nn.Sequential(torch.nn.Linear(2, 2)), _mesh(), mode=mode)


class _SwitchInForward(torch.nn.Module):
    """A first block without parameters that switches its root's gradient sync in forward."""

    def forward(self, x):
        self.root().set_requires_gradient_sync(False)
        return x


def _switching_in_forward():
    switch = _SwitchInForward()
    root = ch.fsdp.data_parallel(torch.nn.Sequential(switch, torch.nn.Linear(2, 2)), _mesh())
    switch.root = weakref.ref(root)
    return root


def _pp_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("pp", "dp"))


def _two_devices():
    net = torch.nn.Linear(2, 2)
    net.bias = torch.nn.Parameter(torch.zeros(2, device="meta"))
    return net


def _hsdp():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(
        "cpu", (dist.get_world_size(), 1), mesh_dim_names=("replicate", "shard")
    )
    return fully_shard(torch.nn.Linear(2, 2), mesh=mesh)


def _scaled_model():
    net = torch.nn.Linear(2, 2)
    scaler = ch.ShardedGradScaler(device="cpu")
    scaler.scale(net(torch.ones(1, 2)).sum()).backward()
    return net, scaler


@functools.cache
def _unscaled_once():
    """A scaler whose optimizer was unscaled once (its valid all_reduce runs before the cases)."""
    net, scaler = _scaled_model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    scaler.unscale_(opt)
    return scaler, opt


def _unscale_twice():
    scaler, opt = _unscaled_once()
    scaler.unscale_(opt)


def _scaler_step(opt_cls):
    net, scaler = _scaled_model()
    scaler.step(opt_cls(net.parameters()))


def _param():
    return torch.nn.Parameter(torch.zeros(2))


@functools.cache
def _ddp_zero():
    """A DDP (C++ reducer; building it communicates, so it is built before the cases run) and
    a ZeroOptimizer over its parameters."""
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
    return ddp, ZeroOptimizer(ddp.module.parameters(), torch.optim.SGD, lr=0.1)


def _zero_with_hooks():
    """A fresh ZeroOptimizer whose ZeRO hooks are built, over the cached DDP's parameters."""
    ddp = _ddp_zero()[0]
    zero = ZeroOptimizer(ddp.module.parameters(), torch.optim.SGD, lr=0.1)
    hook_with_zero_step(ch.allreduce_hook, ddp, zero)
    return zero


@functools.cache
def _ddp_zero_python_reducer():
    """The same with DDP built in python-reducer mode (for compiled autograd)."""
    return _with_python_reducer_flag(_ddp_zero.__wrapped__)


@functools.cache
def _ddp_zero_sharded():
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
    return ddp, ZeroOptimizer(ddp.module.parameters(), torch.optim.SGD, shard_buckets=True, lr=0.1)


def _with_python_reducer_flag(fn):
    before = torch._dynamo.config.optimize_ddp
    torch._dynamo.config.optimize_ddp = "python_reducer"
    try:
        return fn()
    finally:
        torch._dynamo.config.optimize_ddp = before


def _with_env(name, value, fn):
    os.environ[name] = value
    try:
        return fn()
    finally:
        del os.environ[name]


def _without_group(state):
    state.process_group = None
    return state


CASE_TIMEOUT_S = 30


def _case_timeout(signum, frame):
    raise TimeoutError(f"case did not finish within {CASE_TIMEOUT_S}s")


def misuse_worker(rank, world_size):
    group = dist.group.WORLD
    results = {}
    _traced(), _sharded(), _mesh(), _unscaled_once(), _ddp_zero(), _psgd_served()
    _tensor_parallel()
    _ddp_zero_python_reducer(), _ddp_zero_sharded()
    signal.signal(signal.SIGALRM, _case_timeout)
    for name, (call, _, _) in CASES.items():
        counter = CountCollectives()
        signal.alarm(CASE_TIMEOUT_S)  # a case that hangs fails alone, named
        try:
            with counter:
                call(group)
            results[name] = (None, "no exception", counter.count)
        except Exception as e:  # noqa: BLE001 - the test inspects it
            results[name] = (type(e), str(e), counter.count)
        finally:
            signal.alarm(0)
    counter = CountCollectives()  # positive control: a valid call is counted
    with counter:
        ch.bf16_compress_hook(_lp(group), torch.ones(4))
    check = torch.tensor([float(rank + 1)])
    dist.all_reduce(check)
    return results, (check.item(), counter.count)


@pytest.fixture(scope="module")
def outcomes():
    return run_ranks(misuse_worker, 2, timeout=120)


def test_group_usable_after_all_cases_and_counter_works(outcomes):
    # every rank reaches the final all_reduce; a valid hook call issues collectives
    assert [check for _, (check, _) in outcomes] == [3.0, 3.0]
    assert all(count > 0 for _, (_, count) in outcomes)


@pytest.mark.parametrize("case", CASES)
def test_misuse_raises_before_any_collective(outcomes, case):
    _, exc_type, fragment = CASES[case]
    for rank, (results, _) in enumerate(outcomes):
        got_type, message, collectives = results[case]
        assert got_type is exc_type, f"rank {rank}: {got_type} {message}"
        assert re.search(fragment, message), f"rank {rank}: {message!r}"
        assert collectives == 0, f"rank {rank} issued {collectives} collective(s) before raising"

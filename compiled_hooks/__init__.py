"""Compile-native data-parallel gradient communication for PyTorch.

The gradient-communication hooks of ``torch.distributed.algorithms._comm_hooks.default_hooks``
rewritten with functional collectives, so ``torch.compile`` traces them without graph breaks.
"""

from . import fsdp, graph_contract, powersgd, zero  # noqa: F401 - every custom op, registered
from .ddp import compile_ddp, compiled_autograd, ddp_comm_hook
from .grad_scaler import ShardedGradScaler
from .hooks import allreduce_hook, bf16_compress_hook, fp16_compress_hook, reduce_scatter_hook
from .int8 import QuantizedState, int8_compress_hook
from .state import DefaultState, LowPrecisionState

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "DefaultState",
    "LowPrecisionState",
    "QuantizedState",
    "allreduce_hook",
    "reduce_scatter_hook",
    "fp16_compress_hook",
    "bf16_compress_hook",
    "int8_compress_hook",
    "ddp_comm_hook",
    "compile_ddp",
    "compiled_autograd",
    "fsdp",
    "powersgd",
    "ShardedGradScaler",
    "zero",
]

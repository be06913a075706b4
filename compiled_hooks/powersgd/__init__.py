"""PowerSGD gradient compression (Vogels et al., NeurIPS 2019), compile-native: the hook
(:mod:`.hook`), its state (:mod:`.state`) and its custom ops (:mod:`.ops`, registered here)."""

from . import ops
from .hook import orthogonalize, powerSGD_hook, reduce_bucket_async
from .state import PowerSGDState, Slot, random_q, should_compress

__all__ = [
    "PowerSGDState",
    "Slot",
    "ops",
    "orthogonalize",
    "powerSGD_hook",
    "random_q",
    "reduce_bucket_async",
    "should_compress",
]

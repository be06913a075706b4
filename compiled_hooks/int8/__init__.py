"""int8 gradient communication (ZeRO++'s qgZ and qwZ), in one package:

- :mod:`.codec`: the wire format, defined once: blocks of :data:`~.codec.BLOCK_SIZE` values,
  each an int8 payload behind its fp32 scale's :data:`~.codec.SCALE_BYTES` bytes;
- :mod:`.collectives`: the reduce-scatter (all-to-all) and all-gather that carry it;
- :mod:`.state`: :class:`QuantizedState`, the error-feedback residuals;
- :mod:`.hook`: :func:`int8_compress_hook` and its C++-reducer form.
"""

from .hook import int8_compress_hook
from .state import QuantizedState

__all__ = ["QuantizedState", "int8_compress_hook"]

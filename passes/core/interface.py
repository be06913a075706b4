"""What a pass declares: its name, its options and the passes it must run after.

    @dataclasses.dataclass(frozen=True)
    class Options:
        bucket_cap_mb: Optional[float] = None
        '''Cap of one bucket in MiB; None derives it from the graph.'''

    @graph_pass(options=Options, after=("fold_collective_scaling",))
    def bucket_compressed_collectives(graph, bucket_cap_mb=None) -> bool: ...

:func:`graph_pass` returns the function itself with ``fn.interface`` set; it checks at import
that the options dataclass and the function's keyword parameters have the same names and
defaults, so the two cannot drift apart. :class:`passes.Pipeline` reads the interface: options
go to the passes whose dataclass has them, and a pipeline that runs a pass before one it must
run after is refused with :class:`PassOrderError`. A callable without a declaration (a pass of
your own) is taken as it is: its name is ``__name__``, its options its keyword parameters, and
it runs after nothing in particular.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import Any, cast

__all__ = ["PassInterface", "PassOrderError", "graph_pass", "interface_of", "check_order"]


@dataclasses.dataclass(frozen=True)
class NoOptions:
    """A pass without options."""


@dataclasses.dataclass(frozen=True)
class PassInterface:
    name: str
    options: type  # a dataclass: one field per option, with its default
    after: tuple[str, ...]

    @property
    def option_names(self) -> frozenset[str]:
        return frozenset(f.name for f in dataclasses.fields(self.options))


class PassOrderError(ValueError):
    """A pipeline runs a pass before one it must run after."""


def _keyword_defaults(fn: Callable[..., Any]) -> dict[str, Any]:
    params = list(inspect.signature(fn).parameters.values())[1:]  # after the graph
    return {
        p.name: p.default for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    }


def graph_pass(
    *, options: type = NoOptions, after: Sequence[str] = ()
) -> Callable[[Callable[..., bool]], Callable[..., bool]]:
    """Declare a pass ``fn(graph, **options) -> bool``: its ``options`` dataclass and the names of
    the passes it must run after when a pipeline holds both."""
    if not dataclasses.is_dataclass(options):
        raise TypeError(f"graph_pass: options must be a dataclass, got {options!r}")

    def declare(fn: Callable[..., bool]) -> Callable[..., bool]:
        fields = {f.name: f.default for f in dataclasses.fields(options)}
        if fields != _keyword_defaults(fn):
            raise TypeError(
                f"graph_pass: {fn.__name__}'s keyword parameters {_keyword_defaults(fn)} differ "
                f"from its options {fields}"
            )
        cast(Any, fn).interface = PassInterface(fn.__name__, options, tuple(after))
        return fn

    return declare


def interface_of(fn: Callable[..., Any]) -> PassInterface:
    """``fn``'s declaration, or one read from its signature for a callable without one."""
    declared = getattr(fn, "interface", None)
    if isinstance(declared, PassInterface):
        return declared
    name = getattr(fn, "__name__", repr(fn))
    fields = [(k, Any, dataclasses.field(default=v)) for k, v in _keyword_defaults(fn).items()]
    return PassInterface(
        name, dataclasses.make_dataclass(f"{name}_options", fields, frozen=True), ()
    )


def check_order(interfaces: Sequence[PassInterface]) -> None:
    """Raise :class:`PassOrderError` when a pass comes before one it must run after."""
    position: dict[str, int] = {}
    for i, p in enumerate(interfaces):
        position.setdefault(p.name, i)
    for i, p in enumerate(interfaces):
        late = [name for name in p.after if position.get(name, -1) > i]
        if late:
            order = ", ".join(q.name for q in interfaces)
            raise PassOrderError(
                f"Pipeline: {p.name} must run after {', '.join(late)}, which come(s) later in "
                f"[{order}]"
            )

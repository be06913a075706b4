"""Reading Inductor's generated code (C++ kernels on CPU, Triton kernels on CUDA): which
collectives a compiled graph issues, and what the kernels that write a collective's input do.

In the wrapper's ``call()`` a bucketed collective reads one buffer that the kernels before it
fill, through aliases of it where each writes one member::

    buf27 = empty_strided_cpu((4224, ), (1, ), torch.bfloat16)
    buf20 = reinterpret_tensor(buf27, (32, ), (1, ), 1024)  # alias
    cpp_fused_1(buf0, buf3, buf20)                 # Triton: triton_poi_fused_1.run(..., buf20, ...)
    torch.ops._c10d_functional.all_reduce_.default(buf27, 'sum', '0')

Inductor lowers a cat of int8 tensors on CPU to ``aten.cat`` itself (it generates no int8 cat
kernel there), so an int8 bucket is first written in pieces by kernels and then copied::

    cpp_fused_4(..., buf162, buf163)           # every member's packed rows
    buf174 = torch.ops.aten.cat.default([buf162, buf163], 1)
    buf175 = buf174
    torch.ops._c10d_functional.all_to_all_single.default(buf175, [1, 1], [1, 1], '0')
"""

from __future__ import annotations

import re

__all__ = [
    "collective_calls",
    "kernels",
    "bucket_writers",
    "casts_to",
    "cat_inputs",
    "quantizes",
    "input_types",
    "cpp_writers",
    "cpp_input_writers",
    "allocations",
]

_KERNEL = re.compile(r"^(\w+) = async_compile\.\w+\(.*?'''(.*?)'''", re.M | re.S)
_ALIAS = re.compile(r"^\s*(buf\d+) = reinterpret_tensor\((buf\d+),.*# alias$", re.M)
# A cast written in a kernel: C++ (vectorized or scalar) and Triton spellings.
_CASTS = {
    "bfloat16": (r"convert<at::BFloat16\b", r"\.to\(tl\.bfloat16\)"),
    "float16": (r"convert<at::Half\b", r"\.to\(tl\.float16\)"),
}
# Rounding to the nearest integer, as a quantization does: C++ (scalar, vectorized) and Triton.
_ROUND = (r"std::nearbyint\(", r"\.round\(\)", r"libdevice\.(nearbyint|rint|round)\(")
# A Triton kernel computes in fp32 and casts in its store: its signature's pointer types.
_TRITON_POINTER = re.compile(r"'((?:in_out|in|out)_ptr\d+)': '\*(\w+)'")
_TRITON_TYPE = {"bfloat16": "bf16", "float16": "fp16"}
# What precedes a collective's buffer argument when the call reads a view of it
# (``reinterpret_tensor(buf120, (1, 7800), ...)``)
_VIEWED = r"(?:reinterpret_tensor\()?"


def _call_body(code: str) -> str:
    start = code.index("def call(")
    end = code.find("\nrunner = ", start)
    return code[start:] if end < 0 else code[start:end]


def collective_calls(code: str, op: str) -> list[str]:
    """The buffer every ``_c10d_functional.<op>`` call reads (its first argument, or the
    buffer that argument views), in order; ``op`` matches the in-place form too
    (``all_reduce`` finds ``all_reduce_``)."""
    return re.findall(rf"_c10d_functional\.{op}_?\.default\({_VIEWED}(buf\d+)", _call_body(code))


def kernels(code: str) -> dict[str, str]:
    """Every kernel the module defines: name -> source."""
    return {m.group(1): m.group(2) for m in _KERNEL.finditer(code)}


def bucket_writers(code: str, buffer: str) -> list[str]:
    """The kernels that write ``buffer`` or an alias of it before the first collective that
    reads it, in call order (a name once per call)."""
    body = _call_body(code)
    first_use = re.search(rf"_c10d_functional\.\w+\.default\({_VIEWED}{buffer}\b", body)
    body = body[: first_use.start()] if first_use else body
    names = {buffer} | {alias for alias, base in _ALIAS.findall(body) if base == buffer}
    defined = kernels(code)
    writers = []
    for line in body.splitlines():
        m = re.match(r"\s*(\w+)(?:\.run)?\((.*)\)\s*$", line)
        if m and m.group(1) in defined and names & set(re.findall(r"\bbuf\d+\b", m.group(2))):
            writers.append(m.group(1))
    return writers


def casts_to(source: str, dtype: str) -> bool:
    """Whether a kernel's ``source`` converts values to ``dtype`` ("bfloat16", "float16"): an
    explicit conversion, or a Triton kernel that reads fp32 and stores ``dtype``."""
    if any(re.search(p, source) for p in _CASTS[dtype]):
        return True
    pointers = _TRITON_POINTER.findall(source)
    reads = {t for name, t in pointers if not name.startswith("out_")}
    writes = {t for name, t in pointers if not name.startswith("in_ptr")}
    return "fp32" in reads and _TRITON_TYPE[dtype] in writes


def cat_inputs(code: str, buffer: str) -> list[str]:
    """The buffers an ``aten.cat`` call copied into ``buffer`` (through plain renames,
    ``buf175 = buf174``); ``[buffer]`` when no cat made it."""
    body = _call_body(code)
    renames = dict(re.findall(r"^\s*(buf\d+) = (buf\d+)\s*$", body, re.M))
    while buffer in renames:
        buffer = renames[buffer]
    m = re.search(rf"^\s*{buffer} = torch\.ops\.aten\.cat\.default\(\[(.*?)\]", body, re.M)
    return re.findall(r"\bbuf\d+\b", m.group(1)) if m else [buffer]


def input_types(source: str) -> set[str]:
    """The element types a kernel's ``source`` reads: its C++ ``const T*`` parameters, or its
    Triton input pointers (``int32_t``, ``float``, ... / ``i32``, ``fp32``, ...)."""
    cpp = re.findall(r"const ([\w:]+)\*", source)
    triton = re.findall(r"'in_ptr\d+': '\*(\w+)'", source)
    return set(cpp + triton)


def quantizes(source: str) -> bool:
    """Whether a kernel's ``source`` rounds values to integers (a quantization)."""
    return any(re.search(p, source) for p in _ROUND)


def _cpp_calls(code: str) -> list[tuple[str, set[str], set[str]]]:
    """Every C++ kernel call: ``(kernel, read, written)``, the buffers and graph inputs behind
    its const and its non-const pointers."""
    signatures = {
        name: re.findall(r"'(const )?[\w:]+\*?'", types)
        for name, types in re.findall(
            r"^(\w+) = async_compile\.cpp_pybinding\((\[.*?\])", code, re.M
        )
    }
    found = []
    for name, args in re.findall(r"^\s*(\w+)\((.*)\)$", _call_body(code), re.M):
        if name in signatures:
            names = [a.strip() for a in args.split(",")]
            read = {n for n, const in zip(names, signatures[name]) if const}
            written = {n for n, const in zip(names, signatures[name]) if not const}
            found.append((name, read, written))
    return found


def cpp_writers(code: str, buffer: str) -> list[set[str]]:
    """For every C++ kernel call that writes ``buffer`` (a non-const pointer of its
    signature), the buffers and graph inputs that call reads; CPU code only."""
    return [read for _, read, written in _cpp_calls(code) if buffer in written]


def cpp_input_writers(code: str) -> dict[str, list[str]]:
    """Every graph input (``argN_1``) a C++ kernel writes: the kernels that write it, in call
    order; CPU code only."""
    found: dict[str, list[str]] = {}
    for name, _, written in _cpp_calls(code):
        for arg in sorted(a for a in written if re.fullmatch(r"arg\d+_1", a)):
            found.setdefault(arg, []).append(name)
    return found


def allocations(code: str, dtype: str) -> list[tuple[int, ...]]:
    """The shape of every buffer of ``dtype`` ("float32", ...) that ``call()`` allocates."""
    found = re.findall(
        rf"empty_strided_\w+\(\(([\d, ]*)\), \([\d, ]*\), torch\.{dtype}\)", _call_body(code)
    )
    return [tuple(int(d) for d in shape.replace(" ", "").split(",") if d) for shape in found]

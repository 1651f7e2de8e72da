"""The dtypes a checkpoint may hold, described by their bit layout only.

We never convert values: every tensor is handled as unsigned integers of its width. Float types also
say where their exponent lives, which the codec uses as context.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import FormatError

_UINT = {n: np.dtype(f"<u{n}") for n in (1, 2, 4, 8)}  # (built once: a property asked per chunk)


@dataclass(frozen=True)
class DType:
    name: str  # safetensors spelling
    itemsize: int  # bytes per element
    kind: str  # "float", "int", "uint", "bool"
    exp_bits: int = 0  # float exponent width (0 for non-floats)
    man_bits: int = 0  # float mantissa width

    @property
    def bits(self) -> int:
        return self.itemsize * 8

    @property
    def uint(self) -> np.dtype:
        """The unsigned integer view type of the same width."""
        return _UINT[self.itemsize]

    @property
    def n_contexts(self) -> int:
        """Number of codec contexts: one per exponent value for floats, one otherwise."""
        return 1 << self.exp_bits if self.kind == "float" else 1


_ALL = [
    DType("F64", 8, "float", 11, 52),
    DType("F32", 4, "float", 8, 23),
    DType("F16", 2, "float", 5, 10),
    DType("BF16", 2, "float", 8, 7),
    DType("F8_E4M3", 1, "float", 4, 3),
    DType("F8_E5M2", 1, "float", 5, 2),
    DType("I64", 8, "int"),
    DType("I32", 4, "int"),
    DType("I16", 2, "int"),
    DType("I8", 1, "int"),
    DType("U64", 8, "uint"),
    DType("U32", 4, "uint"),
    DType("U16", 2, "uint"),
    DType("U8", 1, "uint"),
    DType("BOOL", 1, "bool"),
]
DTYPES: dict[str, DType] = {d.name: d for d in _ALL}

# Codes used in binary records (stable: part of the format).
DTYPE_CODES: dict[str, int] = {d.name: i + 1 for i, d in enumerate(_ALL)}


def dtype(name: str) -> DType:
    """Look up a dtype by its safetensors name; unknown names are a format error."""
    try:
        return DTYPES[name]
    except KeyError:
        raise FormatError(f"unsupported dtype {name!r}; supported: {', '.join(DTYPES)}") from None

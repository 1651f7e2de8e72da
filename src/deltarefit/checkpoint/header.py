"""What both sides of a safetensors checkpoint share: the header size limit, a tensor to be written
(``TensorSource``), and the shape and count checks of a header entry."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

MAX_HEADER_BYTES = 100 << 20


@dataclass(frozen=True)
class TensorSource:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    chunks: Callable[[], Iterable[bytes | memoryview | np.ndarray]]  # the raw bytes, in order, in pieces


def _shape_str(dt: str, shape: Sequence[int]) -> str:
    return f"{dt}[{','.join(str(int(d)) for d in shape)}]"


def _is_count(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool) and x >= 0

"""Whether two checkpoints look like two versions of one model: the check ``deltarefit encode`` warns by
(most elements changed) and a publish refuses by (``another_model`` lets it through).

Most elements changed is not enough to refuse: an fp32 checkpoint after one AdamW step changes nearly
every element. Two versions of one model keep their tensors (names, shapes, dtypes) and the signs of
almost all their weights (only weights crossing zero flip); another model, or random weights of the
same shapes, keeps few of its tensors or flips about half the signs. ``another_model`` samples them.
"""

from __future__ import annotations

import numpy as np

from ..checkpoint.read import open_checkpoint
from ..errors import UsageError

# Two versions of one model during training change a few percent of their elements per step in bf16 (in
# fp32 nearly all); another model, or random weights of the same shapes, all of them.
UNRELATED_FRACTION = 0.5
SIGN_FLIPS = 0.25  # of sampled nonzero weights: a training step flips a few percent at most; unrelated ~half
SAMPLE = 1 << 20  # elements compared at most (spread over the shared tensors)
_FLOATS = {"F64": np.uint64, "F32": np.uint32, "F16": np.uint16, "BF16": np.uint16, "F8_E4M3": np.uint8,
           "F8_E5M2": np.uint8}


def looks_unrelated(changed_fraction: float) -> bool:
    return changed_fraction >= UNRELATED_FRACTION


def unrelated_words(base: str, target: str, changed_fraction: float) -> str:
    return (f"{base} -> {target}: {100 * changed_fraction:.1f}% of elements changed: they look unrelated (not two "
            "versions of one model)")


def another_model(base: str, target: str) -> str | None:
    """Why ``target`` looks like another model than ``base`` (both checkpoints), or None: under half of
    its tensor bytes in tensors ``base`` has (same name, dtype and shape), or over ``SIGN_FLIPS`` of a
    sample of their nonzero floating-point weights with the other sign."""
    with open_checkpoint(base) as b, open_checkpoint(target) as t:
        shared = [n for n, i in t.tensors.items() if (o := b.tensors.get(n)) is not None
                  and (o.dtype, o.shape) == (i.dtype, i.shape)]
        total = sum(i.nbytes for i in t.tensors.values())
        kept = sum(t.tensors[n].nbytes for n in shared)
        if total and kept < total / 2:
            return f"{100 * kept / total:.0f}% of its bytes are in tensors of the same name, dtype and shape"
        floats = [n for n in shared if t.tensors[n].dtype in _FLOATS and t.tensors[n].nbytes]
        elements = sum(t.tensors[n].nbytes // np.dtype(_FLOATS[t.tensors[n].dtype]).itemsize for n in floats)
        flips = nonzero = 0
        for n in floats:
            u = _FLOATS[t.tensors[n].dtype]
            x, y = b.raw(n).view(u), t.raw(n).view(u)
            step = max(1, -(-elements // SAMPLE))
            x, y = x[::step], y[::step]
            top, magnitude = u(1) << u(8 * np.dtype(u).itemsize - 1), ~(u(1) << u(8 * np.dtype(u).itemsize - 1))
            live = ((x & magnitude) != 0) & ((y & magnitude) != 0)
            flips += int(np.count_nonzero(((x ^ y) & top)[live]))
            nonzero += int(np.count_nonzero(live))
        if nonzero and flips > SIGN_FLIPS * nonzero:
            return f"{100 * flips / nonzero:.0f}% of a sample of its nonzero weights have the other sign"
    return None


def check_one_model(changed_fraction: float, base: str, checkpoint: object, version: int, *, allowed: bool) -> None:
    """Refuse (``UsageError``, nothing published) a publish of ``checkpoint`` whose encode against the
    baseline ``base`` (``version`` of the stream) changed most elements and which looks like another
    model (``another_model``), unless ``allowed``. Tensors in memory (not a path) are the trainer's own:
    not checked."""
    if allowed or not isinstance(checkpoint, str) or not looks_unrelated(changed_fraction):
        return
    why = another_model(base, checkpoint)
    if why is None:
        return
    raise UsageError(f"{unrelated_words(f'version {version}', checkpoint, changed_fraction)}; {why}: is it a "
                     "checkpoint of another model? nothing published; check the path, or pass --another-model "
                     "(another_model=True) to publish it as the stream's next version all the same")

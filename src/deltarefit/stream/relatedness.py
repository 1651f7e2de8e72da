"""Whether two checkpoints look like two versions of one model, judged by the encode between them: the
check ``deltarefit encode`` warns by and a publish refuses by (``another_model`` lets it through)."""

from __future__ import annotations

from ..errors import UsageError

# Two versions of one model during training change a few percent of their elements per step (a fine-tune
# with a high learning rate, tens); another model, or random weights of the same shapes, all of them.
UNRELATED_FRACTION = 0.5


def looks_unrelated(changed_fraction: float) -> bool:
    return changed_fraction >= UNRELATED_FRACTION


def unrelated_words(base: str, target: str, changed_fraction: float) -> str:
    return (f"{base} -> {target}: {100 * changed_fraction:.1f}% of elements changed: they look unrelated (not two "
            "versions of one model)")


def check_one_model(changed_fraction: float, checkpoint: str, version: int, *, allowed: bool) -> None:
    """Refuse (``UsageError``, nothing published) a publish of ``checkpoint`` whose encode against the
    baseline (``version`` of the stream) changed most elements, unless ``allowed``."""
    if allowed or not looks_unrelated(changed_fraction):
        return
    raise UsageError(f"{unrelated_words(f'version {version}', str(checkpoint), changed_fraction)}: is it a "
                     "checkpoint of another model? nothing published; check the path, or pass --another-model "
                     "(another_model=True) to publish it as the stream's next version all the same")

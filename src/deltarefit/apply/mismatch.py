"""What a wrong base is, for a person: ``explain`` turns the apply protocol's ``BaseMismatchError`` for a
checkpoint file into one line naming both files, the fingerprints, what was written (nothing: the
protocol refuses before its first write) and the likely cause with its fix: another version of the same
model (same tensors, names, dtypes and shapes: a rollout's copy behind or ahead, which a sync from its
stream brings to the version it needs) or another model altogether.
"""

from __future__ import annotations

from ..checkpoint.read import open_checkpoint
from ..errors import DeltaRefitError
from ..format import DeltaReader


def _layout_of_delta(delta_path: str) -> tuple[str, dict[str, tuple[str, tuple[int, ...]]]]:
    with DeltaReader(delta_path) as d:
        return d.base_fingerprint, {e.name: (e.base.dtype, tuple(e.base.shape)) for e in d.tensors
                                    if e.base is not None}


def _held(checkpoint_path: str) -> str:
    """What the checkpoint's version record says it holds, or ''."""
    from ..stream.holder import state_path
    from ..stream.records import held_state

    try:
        st = held_state(state_path(checkpoint_path))
    except (DeltaRefitError, OSError):
        return ""
    if not st:
        return ""
    return f" Its version record says it holds version {st['version']} ({st['fingerprint'][:16]}…)."


def explain(delta_path: str, checkpoint_path: str, err: Exception) -> str:
    """One line for a checkpoint that is not ``delta_path``'s base (``err``: the protocol's refusal)."""
    try:
        base_fp, want = _layout_of_delta(delta_path)
        with open_checkpoint(checkpoint_path) as ck:
            have = {n: (i.dtype, tuple(i.shape)) for n, i in ck.tensors.items()}
    except (DeltaRefitError, OSError):
        return f"{checkpoint_path}: not the base of {delta_path} ({err}); nothing was written"
    missing = sorted(set(want) - set(have))
    reshaped = sorted(n for n in set(want) & set(have) if want[n] != have[n])
    head = (f"{checkpoint_path}: not the base of {delta_path} (base fingerprint {base_fp[:16]}…; {err}); "
            "nothing was written.")
    if missing or reshaped:
        what = []
        if missing:
            what.append(f"{len(missing)} of its tensors missing, e.g. {missing[0]!r}")
        if reshaped:
            n = reshaped[0]
            what.append(f"{len(reshaped)} of another dtype or shape, e.g. {n!r} {have[n][0]}{list(have[n][1])} "
                        f"where the delta has {want[n][0]}{list(want[n][1])}")
        return f"{head} It is another model ({'; '.join(what)}): apply deltas encoded from this model's checkpoints."
    return (f"{head} Same tensors, other values: another version of this model (a copy behind or ahead of the "
            f"delta's base, or edited).{_held(checkpoint_path)} A rollout's copy follows its stream with "
            f"'deltarefit sync STORE {checkpoint_path}', which picks the route from the version it holds.")

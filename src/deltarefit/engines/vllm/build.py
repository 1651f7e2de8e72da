"""The steps that build a live engine's state (``engines.vllm.worker.LiveEngine._build``), as functions of
what each step reads: which tensors the tensor-parallel group holds whole or as a partition
(``partition``), which layers' kernels keep their own copy of a weight (``kernel_check``, ``derived_copies``,
``check_derived``), host copies of the reload set (``host_copies``), and the proof at init that vLLM's
reload takes and reproduces those copies (``check_reload``). Collective steps take the worker's group
and are called by every worker in the same order."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from ...errors import UsageError, VerificationError
from .. import kernels
from ..capture import sub_param
from ..kernels import kernel_reads as _kernel_reads
from ..placement import Placement
from .group import WorkerGroup

__all__ = ["check_derived", "check_reload", "derived_copies", "host_copies", "kernel_check", "packed",
           "partition", "torch_dtype", "whole_layers"]


def torch_dtype(name: str):
    from ...apply.tensors import torch_dtype

    return torch_dtype(name)


def packed(model: Any) -> dict[str, list[str]]:
    """The model's fused modules: fused name -> the checkpoint modules packed into it."""
    mapping = getattr(model, "packed_modules_mapping", None) or {}
    return {str(k): [str(p) for p in v] for k, v in dict(mapping).items()}


def whole_layers(reload: dict[str, str], names: list[str], layer: Any) -> dict[str, str]:
    """``reload`` with every other tensor of each layer it touches (``layer(name)``): a layer is reloaded whole."""
    layers = {layer(n) for n in reload}
    return {**{n: "its layer is reloaded" for n in names if layer(n) in layers}, **reload}


def partition(placements: dict[str, list[Placement]], reload: dict[str, str], specs: dict[str, tuple[str, tuple]],
              names: list[str], group: WorkerGroup) -> tuple[dict[str, str], set[str]]:
    """(``reload`` with every tensor the group holds neither whole in each worker nor as a partition,
    the tensors partitioned across the group): two collective calls (the sum and the minimum of the
    elements each worker owns)."""
    held = np.array([sum(pl.piece.count for pl in placements.get(n, ()) if pl.piece.owner)
                     for n in names], np.int64)
    numel = np.array([math.prod(specs[n][1]) for n in names], np.int64)
    total, least = group.sum(held), group.min(held)
    reload = dict(reload)
    shared: set[str] = set()
    for i, n in enumerate(names):
        if least[i] == numel[i]:
            continue  # every worker holds it whole (replicated, or one worker)
        if total[i] == numel[i]:
            shared.add(n)  # partitioned across the group: segments assembled by the group
        elif n not in reload:
            reload[n] = f"the workers hold {total[i]} of its {numel[i]} elements, not a partition"
    return reload, shared


def kernel_check(placements: dict[str, list[Placement]], params: dict[str, Any], modules: dict[str, Any],
                 reload: dict[str, str]) -> None:
    """Move into ``reload`` every placed tensor whose layer's kernel does not multiply with the
    parameter it is placed in (``kernels.kernel_reads``: an identity probe, one element moved and put back)."""
    for name, places in placements.items():
        if name in reload:
            continue
        for pl in places:
            param = sub_param(pl.param)[0]
            mod_name, _, pname = param.rpartition(".")
            if not _kernel_reads(modules[mod_name], pname, params[param]):
                reload[name] = f"the kernel of {mod_name} keeps its own copy of the weight"


def derived_copies(placements: dict[str, list[Placement]], params: dict[str, Any], modules: dict[str, Any]
                   ) -> dict[str, list[tuple[str, str]]]:
    """Checkpoint tensor -> the (module, parameter) pairs that hold its parameter tied (the storage of
    another module's parameter, e.g. an LM head tied to the embedding) and whose kernel keeps its own
    copy of it (``kernels``: *derived*), to be rebuilt after every write."""
    by_storage = kernels.holders_of(modules)
    out: dict[str, list[tuple[str, str]]] = {}
    for name, places in placements.items():
        for pl in places:
            param = sub_param(pl.param)[0]
            own = tuple(param.rpartition(".")[::2])
            for mod_name, pname in by_storage.get(params[param].untyped_storage().data_ptr(), ()):
                if (mod_name, pname) != own and (mod_name, pname) not in out.get(name, []) \
                        and not _kernel_reads(modules[mod_name], pname, getattr(modules[mod_name], pname)):
                    out.setdefault(name, []).append((mod_name, pname))
    return out


def check_derived(derived: dict[str, list[tuple[str, str]]], modules: dict[str, Any], names: set[str],
                  at_init: bool = False, rebuild: bool = True) -> None:
    """Rebuild the derived copies of tensors ``names`` (``kernels.rebuild``; not with ``rebuild=False``)
    and read each back through its kernel: it must multiply with exactly the parameter's values, or
    ``VerificationError`` names the tensor and the module (``at_init``: ``UsageError``, the engine
    refused)."""
    done: set[str] = set()
    for n in sorted(names):
        for mod_name, pname in derived.get(n, ()):
            if mod_name in done:
                continue
            done.add(mod_name)
            mod = modules[mod_name]
            if rebuild:
                kernels.rebuild(mod)
            if kernels.kernel_matches(mod, getattr(mod, pname)) is not True:
                why = (f"tensor {n!r}: the kernel of {mod_name} keeps its own copy of this tied weight and does "
                       "not read it as written, even after its post-load processing ran again")
                if at_init:
                    raise UsageError(f"deltarefit: {why}, so this model cannot be refitted exactly in this engine")
                raise VerificationError(why)


def host_copies(ck: Any, specs: dict[str, tuple[str, tuple]], reload: dict[str, str]) -> dict[str, Any]:
    """CPU tensors of the reload set, read from checkpoint ``ck`` (the only bit-exact base a prepacked
    kernel leaves)."""
    import torch

    host: dict[str, Any] = {}
    for n in reload:
        t = torch.empty(specs[n][1], dtype=torch_dtype(specs[n][0]))
        t.view(-1).view(torch.uint8).numpy()[:] = ck.raw(n)
        host[n] = t
    return host


def check_reload(model: Any, host: dict[str, Any], packed: dict[str, list[str]], *, sharded: bool,
                 layer: Callable[[str], str], reload: Callable[[list[str]], Any], comparable: set[str]) -> None:
    """At init: reload every layer of the reload set from the host copies (the weights the engine already
    holds), one layer at a time as updates do, and require what those layers compute with (every
    parameter and buffer, each linear kernel read back) to be unchanged. vLLM's reload must reproduce the
    fresh load bit for bit; where it does not (a kernel format it does not rebuild on reload), the
    engine's state is put back and the engine refused with ``UsageError`` naming the layer. Before that,
    each layer is reloaded once with one element of every tensor moved far, and must change: a
    reload that drops what it is fed would pass the first check and lose every update.

    ``layer``: a tensor's layer; ``reload(names)``: those tensors' layers fed through vLLM's reload;
    ``comparable`` gets the tensors whose kernels read back as the checkpoint has them."""
    if not host:
        return
    try:
        import vllm.model_executor.model_loader.reload.inplace  # noqa: F401
    except ImportError:  # not a vLLM engine: there is no reload path to check (an apply that needs one fails)
        return
    layers = sorted({layer(n) for n in host})
    mods = sorted({m for m in (kernels.nearest_module(model, key) for key in layers) if m is not None},
                  key=lambda m: m[0])
    before = kernels.state_of(mods)
    # Which reloaded tensors read back through their kernels as the checkpoint has them: a layer that
    # multiplies with a transposed copy (GPT-2's Conv1D) does not, and is shown by this check alone.
    got = kernels.verify_layers(model, list(host), packed, host.__getitem__,
                                {"verified": [], "mismatched": [], "unverified": []}, sharded=sharded)
    comparable.update(got["verified"])
    saved = kernels.snapshot(mods)
    deaf = None
    for key in layers:
        names = [n for n in host if layer(n) == key]
        # First with one element of each tensor moved far (``move_first_loudly``: one ulp can round away in
        # a quantized layout): the layer must take what it is fed (a model whose loader writes around
        # vLLM's layerwise reload keeps its old weights, silently).
        mod = [m for m in (kernels.nearest_module(model, key),) if m is not None]
        s0 = kernels.state_of(mod)
        backs = [kernels.move_first_loudly(host[n]) for n in names]
        try:
            reload(names)
        finally:
            for back in backs:
                back()
        # Judged on what can be read: a kernel that cannot be probed (its digest says "unprobed") tells
        # nothing, and a layer with nothing readable is left to the second check.
        seen = {k: v for k, v in s0.items() if not v.startswith("unprobed")}
        s1 = kernels.state_of(mod)
        if seen and all(s1.get(k) == v for k, v in seen.items()) and deaf is None:
            deaf = key
        reload(names)
    after = kernels.state_of(mods)
    wrong = sorted(k for k in before if after.get(k) != before[k])
    if wrong or deaf is not None:
        kernels.restore(saved)
        back = kernels.state_of(mods) == before
        why = (f"vLLM's reload of {deaf} does not take the weights it is fed (changed weights leave it as it "
               "was)" if deaf is not None else f"vLLM's reload does not reproduce the fresh load of {wrong[0]} "
               f"({len(wrong)} tensors differ when a layer is reloaded with the weights it holds)")
        raise UsageError(f"deltarefit: {why}, so this model cannot be refitted exactly in this engine; "
                         + ("its weights were put back" if back else "restart it: its weights may be wrong now"))

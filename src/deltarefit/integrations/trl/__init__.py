"""TRL's weight sync through deltarefit: one call before the trainer is built.

    from deltarefit.integrations import trl as dtrl
    dtrl.enable(stream="/shared/run7", signing_key="trainer.pem", verify_key="trainer.pub")
    trainer = GRPOTrainer(..., args=GRPOConfig(use_vllm=True, vllm_mode="server", ...))

TRL (1.16) builds its server client in ``VLLMGeneration._init_vllm`` from the module-level name
``VLLMClient`` of ``trl.generation.vllm_generation``; ``enable`` points that name at
:class:`deltarefit.integrations.trl.client.DeltaRefitVLLMClient`, so every trainer built afterwards that goes
through ``VLLMGeneration`` (GRPO, RLOO, the distillation and experimental trainers that call
``sync_weights``) syncs through it. Generation still goes through TRL's own client code. Each
``sync_weights`` then publishes the trainer's weights from memory as the next version of ``stream``
(``Publisher.publish_tensors``: no checkpoint written) and has the server refit itself in place from the
stream over vLLM's RL routes (``deltarefit.engines.vllm.backend.HTTPClient``), checked before it serves
again (see ``client``). The server is started with ``python -m deltarefit.integrations.trl.serve``.

:func:`rollout_version` says which version the server's workers hold, read back from them: the version
the rollouts generated after the last sync come from (for off-policy correction).

Colocate mode (``vllm_mode="colocate"``) is not switched: TRL writes each tensor into the in-process
engine with ``model.load_weights`` itself (docs/FRAMEWORKS.md, TRL).

Importing this package imports neither TRL nor vLLM; ``enable`` imports TRL.
"""

from __future__ import annotations

from typing import Any

from ...errors import UsageError
from .settings import RolloutVersion, TRLSync, _state, settings

__all__ = ["RolloutVersion", "TRLSync", "disable", "enable", "rollout_version", "settings"]


def enable(stream: str, *, state_dir: str | None = None, signing_key: str | None = None,
           verify_key: str | None = None, served: str | None = None, keyframe_every: int = 20,
           timeout: float = 300.0, format_version: int | None = None) -> TRLSync:
    """Make TRL's vLLM server mode sync through deltarefit (module docstring); returns the settings.

    Call it before the trainer is built (TRL reads the client class when ``VLLMGeneration`` is
    built). ``stream``: where versions go, a directory or an ``s3://`` URL that the server's host reads.
    ``signing_key``/``verify_key``: sign every record on the trainer, and have the server's workers
    verify them; ``verify_key`` is a path the server's host reads, of the key it pins with
    ``serve --verify-key`` (a pinned server refuses another key, or none). ``served``: the dtype
    the server computes in, default its model dtype. ``format_version``: of the deltas (1 or 2; None: the
    stream's, 2 for a new one). Calling it again replaces the settings."""
    import trl.generation.vllm_generation as gen

    from ...stream.publisher import default_state_dir
    from .client import DeltaRefitVLLMClient

    if served is not None and served not in ("BF16", "F16", "F32"):
        raise UsageError(f"served must be 'BF16', 'F16' or 'F32', not {served!r}")
    if format_version not in (None, 1, 2):
        raise UsageError(f"format_version must be 1, 2 or None, not {format_version!r}")
    if verify_key is not None and signing_key is None:
        raise UsageError("verify_key without signing_key: the server would refuse every unsigned record")
    _state.settings = TRLSync(stream, state_dir or default_state_dir(stream), signing_key, verify_key, served,
                              keyframe_every, timeout, format_version)
    if gen.VLLMClient is not DeltaRefitVLLMClient:
        _state.original = gen.VLLMClient
        gen.VLLMClient = DeltaRefitVLLMClient
    return _state.settings


def disable() -> None:
    """Give TRL its own client back (trainers built afterwards use NCCL again)."""
    if _state.original is not None:
        import trl.generation.vllm_generation as gen

        gen.VLLMClient = _state.original
    _state.settings = _state.original = None
    _state.clients.clear()


def rollout_version(client: Any = None) -> RolloutVersion:
    """The version the server's workers hold now, read back from them (``POST /collective_rpc``
    ``deltarefit_last_update`` on every worker, which must agree, and ``GET /weight_info``): what the
    rollouts generated since the last sync were generated with. ``client``: a trainer's
    ``vllm_generation.vllm_client``; default the newest client built since ``enable``."""
    if client is None:
        if not _state.clients:
            raise UsageError("deltarefit.integrations.trl: no client was built since enable(); build the trainer")
        client = _state.clients[-1]
    return client.rollout_version()

"""What the Ray integration's engine actors share (``ray`` and ``ray_http``): Ray itself, imported only
when asked for, and the placement of one engine per placement group."""

from __future__ import annotations

from typing import Any

from ..errors import UsageError

BACKEND = "deltarefit"
READY_TIMEOUT = 900.0  # a vLLM engine's start (and a restarted one's catch-up) on a slow CPU host


def require_ray() -> Any:
    """The ``ray`` module, or ``UsageError`` saying how to install it."""
    try:
        import ray
    except ImportError as e:
        raise UsageError(f"deltarefit.integrations.ray needs Ray ({e}): pip install 'ray>=2.40,<3'") from None
    return ray


def placed(resources: dict[str, float], name: str, *, num_cpus: float = 1, max_restarts: int = 3,
           runtime_env: dict[str, Any] | None = None, timeout: float = READY_TIMEOUT) -> dict[str, Any]:
    """Actor options for one engine: its own placement group (one ``STRICT_PACK`` bundle of ``num_cpus``
    CPUs and the node's ``resources``), named ``name``, restarted up to ``max_restarts`` times, in-flight
    calls not retried."""
    ray = require_ray()
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    pg = placement_group([{"CPU": num_cpus, **resources}], strategy="STRICT_PACK", name=f"deltarefit-{name}")
    ray.get(pg.ready(), timeout=timeout)
    return dict(num_cpus=num_cpus, resources=dict(resources), max_restarts=max_restarts, max_task_retries=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0),
                runtime_env=runtime_env, name=name)

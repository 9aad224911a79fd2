"""Ray Serve's autoscaling policy for an engine pool: Serve's own autoscaler sizes each pool by the
load its engines report (EngineReplica.record_autoscaling_stats); pdserve runs no scaler of its own.

Only the glue: the decision is pool_size.py's. Serve then applies the delays and bounds of the
deployment's autoscaling_config (deploy/serve.py writes it, naming this class).
"""

from __future__ import annotations

from typing import Any

from ray.serve.config import AutoscalingContext

from pdserve.cluster_config import PoolScalingSpec
from pdserve.ray.pool_size import engine_stats, next_pool_size


class EngineLoadPolicy:
    """Serve builds one per pool, with the pool's PoolScalingSpec fields as ``policy_kwargs``."""

    def __init__(self, **spec: Any) -> None:
        self._spec = PoolScalingSpec.model_validate(spec)

    def __call__(self, ctx: AutoscalingContext) -> tuple[int, dict[str, Any]]:
        """(the pool's next size, no policy state of its own)."""
        stats = engine_stats(ctx.aggregated_metrics or {}, ctx.running_replicas)
        size = next_pool_size(stats, target=ctx.target_num_replicas, running=ctx.current_num_replicas,
                              spec=self._spec)
        return size, {}

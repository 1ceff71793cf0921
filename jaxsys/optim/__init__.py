"""Inner optimizers and schedules (inner.py); outer low-communication optimizers.

Outer optimizers (optax style, run per replica under vmap/shard_map over the replica axis):
  diloco(sync_every=...)  averaged pseudo-gradients + Nesterov SGD (optax.sgd)  (arXiv 2311.08105)
  noloco(sync_every=...)  random pairs, modified Nesterov, no all-reduce       (arXiv 2506.10911)
  co2(sync_every=...)     one-step-delayed outer update, overlappable          (arXiv 2401.16265)
  streaming_diloco(sync_every=..., fragments=...)  DiLoCo one fragment at a time (arXiv 2501.18512)
"""
from jaxsys.optim.co2 import co2
from jaxsys.optim.diloco import diloco
from jaxsys.optim.noloco import noloco
from jaxsys.optim.outer import OuterOptimizer
from jaxsys.optim.streaming import streaming_diloco

__all__ = ["co2", "diloco", "noloco", "OuterOptimizer", "streaming_diloco"]

"""What must import before the report starts, checked without importing jax: on a machine
with no registry a missing package is one line naming it, not a traceback minutes in."""
from __future__ import annotations

import importlib.util

# module -> the distribution that provides it (jaxsys's own dependencies, pyproject.toml)
REQUIRED = {"jax": "jax", "flax": "flax", "optax": "optax", "orbax.checkpoint":
            "orbax-checkpoint", "chex": "chex", "absl": "absl-py", "ml_collections":
            "ml-collections", "grain": "grain", "numpy": "numpy", "safetensors": "safetensors",
            "tokenizers": "tokenizers", "tqdm": "tqdm"}


def missing(required: dict[str, str] = REQUIRED) -> list[str]:
  """The distributions whose module cannot be found."""
  out = []
  for module, dist in required.items():
    try:
      found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing or broken
      found = False
    if not found:
      out.append(dist)
  return out

"""The trainer, `python -m experiments.train` in the repository: `jaxsys/cli/train.py`
(installed as `jaxsys-train`, which runs from any directory)."""
from jaxsys.cli import scripts  # no jax: SIGTERM handling starts before the heavy imports

if __name__ == "__main__":
  scripts.train()

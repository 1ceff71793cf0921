"""Sampling, `python -m experiments.generate` in the repository: `jaxsys/cli/generate.py`
(installed as `jaxsys-generate`)."""
from jaxsys.cli import scripts

if __name__ == "__main__":
  scripts.generate()

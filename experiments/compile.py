"""The TPU compile report, `python -m experiments.compile` in the repository:
`jaxsys/cli/compile.py` (installed as `jaxsys-compile`, which runs from any directory)."""
from jaxsys.cli.compile import run

if __name__ == "__main__":
  run()

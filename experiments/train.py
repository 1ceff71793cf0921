"""The trainer, `python -m experiments.train` in the repository: `jaxsys/cli/train.py`
(installed as `jaxsys-train`, which runs from any directory)."""
from jaxsys import hugepages

if __name__ == "__main__":  # before jax starts: glibc reads its tunables at exec only
  hugepages.reexec_with_huge_pages()

from jaxsys.cli.train import run  # pylint: disable=wrong-import-position

if __name__ == "__main__":
  run()

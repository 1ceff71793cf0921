"""Console-script entry points (`[project.scripts]` in pyproject.toml)."""
from jaxsys import hugepages


def train() -> None:
  """`jaxsys-train`: re-executed with huge pages before jax starts, then the trainer."""
  hugepages.reexec_with_huge_pages()
  from jaxsys.cli import train as binary  # pylint: disable=import-outside-toplevel
  binary.run()


def checkpoint_info() -> None:
  """`jaxsys-checkpoint-info`."""
  from jaxsys.cli import checkpoint_info as binary  # pylint: disable=import-outside-toplevel
  binary.run()


def compile_report() -> None:
  """`jaxsys-compile`."""
  from jaxsys.cli import compile as binary  # pylint: disable=import-outside-toplevel
  binary.run()

"""Console-script entry points (`[project.scripts]` in pyproject.toml)."""
from jaxsys import hugepages, preemption


def train() -> None:
  """`jaxsys-train`: SIGTERM exits 75 from here on (`jaxsys.preemption`); re-executed with
  huge pages before jax starts, then the trainer."""
  with preemption.exits_preempted():
    preemption.install()
    with preemption.blocked_across_exec():  # a SIGTERM meanwhile reaches the new image
      hugepages.reexec_with_huge_pages()
    preemption.pause_point("imports")
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

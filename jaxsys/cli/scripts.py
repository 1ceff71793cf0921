"""Console-script entry points (`[project.scripts]` in pyproject.toml)."""
from jaxsys import preemption
from jaxsys.cli import start


def train() -> None:
  """`jaxsys-train`: `start.before_jax`, then the trainer."""
  with preemption.exits_preempted():
    start.before_jax()
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


def generate() -> None:
  """`jaxsys-generate`."""
  from jaxsys.cli import generate as binary  # pylint: disable=import-outside-toplevel
  binary.run()

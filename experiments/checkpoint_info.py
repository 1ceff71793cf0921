"""What a run's checkpoints hold, `python -m experiments.checkpoint_info` in the repository:
`jaxsys/cli/checkpoint_info.py` (installed as `jaxsys-checkpoint-info`)."""
from jaxsys.cli.checkpoint_info import describe, run  # pylint: disable=unused-import

if __name__ == "__main__":
  run()

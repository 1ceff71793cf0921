"""jaxsys's binaries, installed as console scripts that run from any directory.

`jaxsys-train` is `train.py`, `jaxsys-checkpoint-info` is `checkpoint_info.py`; in the
repository `python -m experiments.train` and `python -m experiments.checkpoint_info` run the
same code. Importing this package chooses, before jax starts, the backends this machine has
(jaxsys/platforms.py), so a binary's first line is its own.
"""
from jaxsys import platforms

platforms.choose()

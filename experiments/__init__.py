"""The repository's binaries, `python -m experiments.X`: Python imports this package first.

Before any of them starts jax: only the backends this machine has (jaxsys/platforms.py), so
a run's first line is its own, not libtpu's or the CUDA plugin's on a host without them.
"""
from jaxsys import platforms

platforms.choose()

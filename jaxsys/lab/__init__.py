"""The network lab: real processes, real collectives, a shaped link, its own byte counters.

`link` (a network namespace whose loopback is shaped by `tc`), `launch` (P processes
joined by `jax.distributed` in it), `wire` (what crossed the link, over time and per
step), `run` (one lab run and its summary). The binary is `experiments/lab.py`.
"""

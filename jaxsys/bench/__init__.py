"""Measurement libraries behind the benchmarks in experiments/ and the notebooks."""
import statistics
import sys
import time
from typing import Any, Callable

import jax


def log(msg: str) -> None:
  """A benchmark's progress line on stderr, timestamped (stdout keeps its tables)."""
  print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def median_seconds(fn: Callable[..., Any], *args, repeats: int,
                   clock: Callable[[], float] = time.perf_counter) -> float:
  """Median seconds by `clock` (wall by default) of fn(*args), finished on the device,
  over `repeats` calls after an untimed one (compilation, first-touch memory)."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = clock()
    jax.block_until_ready(fn(*args))
    times.append(clock() - start)
  return float(statistics.median(times))

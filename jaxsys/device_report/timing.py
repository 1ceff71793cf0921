"""Timing blocking calls in interleaved rounds, so a slow moment falls on every case alike."""
from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable

import jax

from jaxsys.device_report.section import error_line


@dataclasses.dataclass(frozen=True)
class Timing:
  """Seconds of the timed calls of one case (after its warm-up call)."""
  seconds: tuple[float, ...]

  @property
  def median(self) -> float:
    return statistics.median(self.seconds)

  @property
  def spread(self) -> float:
    """(max - min) / median: how much the calls disagreed."""
    return (max(self.seconds) - min(self.seconds)) / self.median

  def as_dict(self) -> dict[str, Any]:
    return {"median_s": self.median, "min_s": min(self.seconds), "max_s": max(self.seconds),
            "calls": len(self.seconds)}


def blocking(fn: Callable[..., Any], *args) -> Callable[[], Any]:
  """A call of fn(*args) that returns once the device has finished it."""
  return lambda: jax.block_until_ready(fn(*args))


def prepare(cases: dict[str, tuple[Callable[..., Any], tuple]]
            ) -> tuple[dict[str, Callable[[], Any]], dict[str, float], dict[str, str]]:
  """Compiles each case's fn for its args and calls it once: (a blocking call for each case
  that ran, the seconds of its first call, the error of each that did not)."""
  calls, first, failed = {}, {}, {}
  for name, (fn, args) in cases.items():
    try:
      compiled = jax.jit(fn).lower(*args).compile()
      call = blocking(compiled, *args)
      t0 = time.perf_counter()
      call()
      first[name] = time.perf_counter() - t0
      calls[name] = call
    except Exception as e:  # pylint: disable=broad-except
      failed[name] = error_line(e)
  return calls, first, failed


def time_calls(calls: dict[str, Callable[[], Any]], repeats: int, *, warm_up: bool = True
               ) -> dict[str, Timing]:
  """Each call once untimed unless already warm (compilation, first-touch memory), then
  `repeats` rounds that call each case once in turn."""
  for call in calls.values() if warm_up else ():
    call()
  seconds: dict[str, list[float]] = {name: [] for name in calls}
  for _ in range(repeats):
    for name, call in calls.items():
      t0 = time.perf_counter()
      call()
      seconds[name].append(time.perf_counter() - t0)
  return {name: Timing(tuple(s)) for name, s in seconds.items()}

"""A `jax.profiler` trace of a range of training steps, and a device-memory profile.

`Profiler(first, last, directory)` wraps each step (`with profiler.step(n): ...`): it starts
the trace as step `first` begins, annotates every step (`StepTraceAnnotation("train",
step_num=n)`, the steps TensorBoard's profile plugin and Perfetto show), saves the device
memory at the end of the first step it traces, and stops after step `last`, waiting for the step's
arrays so the trace holds their work. The trace goes to `<directory>/plugins/profile/<time>/`
(`*.xplane.pb` for TensorBoard's profile plugin, `perfetto_trace.json.gz` for
ui.perfetto.dev), the memory profile to `<directory>/memory_step<n>.prof` (pprof).
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Callable

import jax
from absl import logging


def parse_steps(steps: str) -> tuple[int, int] | None:
  """'3,5' -> (3, 5); '' -> None (config_check has checked the form)."""
  if not steps:
    return None
  first, last = (int(s) for s in steps.split(","))
  return first, last


class Profiler:
  """Traces steps `first` to `last` (inclusive) into `directory`; a no-op without a range."""

  def __init__(self, steps: tuple[int, int] | None, directory: str):
    self.steps, self.directory = steps, directory
    self.tracing = False
    self.written: str | None = None  # the directory, once a trace is in it

  @contextlib.contextmanager
  def step(self, n: int, outputs: Callable[[], Any]):
    """Runs step `n` inside the body; `outputs()` gives its arrays, waited for before a
    memory profile or the trace's end."""
    if self.steps is None or not self.steps[0] <= n <= self.steps[1]:
      yield
      return
    first, last = self.steps
    started = not self.tracing  # step `first`, or where a resumed run enters the range
    if started:
      os.makedirs(self.directory, exist_ok=True)
      jax.profiler.start_trace(self.directory, create_perfetto_trace=True)
      self.tracing = True
    with jax.profiler.StepTraceAnnotation("train", step_num=n):
      yield
    if started or n == last:
      jax.block_until_ready(outputs())
    if started:
      jax.profiler.save_device_memory_profile(
          os.path.join(self.directory, f"memory_step{n}.prof"))
    if n == last:
      self.stop()
      self.written = self.directory
      logging.info("profile of steps %d-%d in %s (TensorBoard's profile plugin: tensorboard "
                   "--logdir %s; Perfetto: its perfetto_trace.json.gz)", first, last,
                   self.directory, self.directory)

  def stop(self) -> None:
    """Ends a trace still running (a run that stopped inside the range)."""
    if self.tracing:
      jax.profiler.stop_trace()
      self.tracing = False

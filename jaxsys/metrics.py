"""Metrics: JSON lines + TensorBoard files, a progress display, and the peak FLOP/s MFU divides by."""
from __future__ import annotations

import functools
import json
import logging as pylogging
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from absl import logging

from jaxsys import storage


def summary_writer_class():
  """tensorboardX's SummaryWriter, imported without torch: tensorboardX imports torch where
  it is installed (the `hf` extra) only to accept its tensors, ~2 s of every run's
  start-up; we log Python floats. Where torch is already imported it stays as it is."""
  hide = "torch" not in sys.modules
  if hide:
    sys.modules["torch"] = None  # `import torch` raises ImportError, which it catches
  try:
    from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel
  finally:
    if hide:
      del sys.modules["torch"]
  return SummaryWriter


class MetricWriter:
  """Appends one JSON object per line to `<workdir>/metrics.jsonl` and mirrors scalars to TensorBoard.

  TensorBoard files go to `<workdir>/tensorboard` when tensorboardX is installed
  (`pip install 'jaxsys[tb]'`). Only process 0 writes. A run resumed at `resume_step`
  replays the steps after it: their rows (and a row a crash cut short) move from
  `metrics.jsonl` to `metrics.replayed.jsonl` first, and TensorBoard is told to purge
  its events from there on.
  """

  def __init__(self, workdir: str, *, tensorboard: bool = True, resume_step: int | None = None):
    self.enabled = jax.process_index() == 0
    self.path = os.path.join(workdir, "metrics.jsonl")
    self.tb_dir = None
    self._tb = None
    if not self.enabled:
      return
    os.makedirs(workdir, exist_ok=True)
    if resume_step is not None and os.path.exists(self.path):
      self._drop_after(resume_step)
    self._file = open(self.path, "a", encoding="utf-8")
    if tensorboard:
      try:
        SummaryWriter = summary_writer_class()
      except ImportError:
        logging.warning("tensorboardX is not installed; TensorBoard files are off "
                        "(pip install 'jaxsys[tb]'). metrics.jsonl is still written.")
      else:
        self.tb_dir = os.path.join(workdir, "tensorboard")
        self._tb = SummaryWriter(self.tb_dir, purge_step=None if resume_step is None
                                 else resume_step + 1)

  def _drop_after(self, step: int) -> None:
    """Moves rows past `step`, and a row cut short, from metrics.jsonl to
    metrics.replayed.jsonl (appended: nothing is lost); the rewrite is an atomic replace."""
    with open(self.path, encoding="utf-8") as f:
      lines = f.readlines()
    kept, moved = [], []
    for line in lines:
      try:
        row = json.loads(line)
      except ValueError:
        row = None
      good = row is not None and line.endswith("\n") and row.get("step", 0) <= step
      (kept if good else moved).append(line if line.endswith("\n") else line + "\n")
    if not moved:
      return
    replayed = os.path.join(os.path.dirname(self.path), "metrics.replayed.jsonl")
    with open(replayed, "a", encoding="utf-8") as f:
      f.writelines(moved)
    tmp = self.path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
      f.writelines(kept)
    os.replace(tmp, self.path)
    logging.info("%s: %d rows past the resumed step %d (replayed now) moved to %s",
                 self.path, len(moved), step, replayed)

  def write(self, step: int, metrics: dict[str, Any]) -> None:
    if not self.enabled:
      return
    row = {"step": int(step), **{k: _to_python(v) for k, v in metrics.items()}}
    try:
      self._file.write(json.dumps(row) + "\n")
      self._file.flush()
    except OSError as e:  # e.g. a full disk: one line naming the file
      raise storage.WriteError(f"writing {self.path}", e) from e
    if self._tb is not None:
      for k, v in row.items():
        if k not in ("step", "time") and isinstance(v, (int, float)):  # TB keeps its own time
          self._tb.add_scalar(k, v, int(step))

  def close(self) -> None:
    """Closes both files. A failure (the last rows flushed to a full disk) is raised as a
    storage.WriteError, unless another exception is propagating (close runs in a
    `finally`): then it is logged in one line, never masking the error that stopped the run."""
    if not self.enabled:
      return
    propagating = sys.exc_info()[1]
    closers = [(self.path, self._file.close)]
    if self._tb is not None:
      closers.append((self.tb_dir, lambda: _close_tensorboard(self._tb)))
    failures = []
    for what, close in closers:
      try:
        close()
      except OSError as e:
        failures.append(storage.WriteError(f"closing {what}", e))
    if failures and propagating is None:
      raise failures[0]
    for failure in failures:
      logging.error("%s", failure)


def _close_tensorboard(tb) -> None:
  """tb.close(). If its flush fails (a full disk), its event writers are marked closed and
  their threads stopped anyway: tensorboardX would retry the close at exit, and its worker
  thread would die on the queue torn down under it, each with a traceback."""
  try:
    tb.close()
  except OSError:
    for writer in (getattr(tb, "all_writers", None) or {}).values():
      events = getattr(writer, "event_writer", None)
      if events is not None and not getattr(events, "_closed", True):
        events._closed = True  # tensorboardX 2.x: close() and its atexit hook skip it now
        worker = getattr(events, "_worker", None)
        if worker is not None:
          worker.stop()
    tb.all_writers = tb.file_writer = None
    raise


class _QuietLibraries(pylogging.Filter):
  """Drops orbax's per-save INFO chatter (dozens of lines a checkpoint); keeps its warnings
  and errors, one line each. A failed save (a full disk) is raised to the binary, which
  prints it in one line; orbax would also log it with a traceback from each of its
  threads, and asyncio once per array piece ("Task exception was never retrieved")."""

  def filter(self, record: pylogging.LogRecord) -> bool:
    if "/orbax/" not in record.pathname:
      return not (record.name == "asyncio" and _from_orbax(record))
    if record.levelno < pylogging.WARNING:
      return False
    if record.exc_info and record.exc_info[1] is not None:  # the traceback -> its last line
      error = record.exc_info[1]
      reason = (str(error).strip().splitlines() or [""])[0][:300]
      record.msg, record.args = f"{record.getMessage()}: {type(error).__name__}: {reason}", None
      record.exc_info = record.exc_text = None
    return True


def _from_orbax(record: pylogging.LogRecord) -> bool:
  """An asyncio record about an orbax save: its text names orbax (a module, or a step's
  `.orbax-checkpoint-tmp` directory) or its traceback passes through orbax."""
  if "orbax" in record.getMessage():
    return True
  tb = record.exc_info[2] if record.exc_info else None
  while tb is not None:
    if "/orbax/" in tb.tb_frame.f_code.co_filename:
      return True
    tb = tb.tb_next
  return False


def _late_write_callback(unraisable) -> bool:
  """A tensorstore write finishing after a failed save closed orbax's event loop: its
  callback raises "Event loop is closed", once per array piece still in flight."""
  error, tb = unraisable.exc_value, unraisable.exc_traceback
  while tb is not None and tb.tb_next is not None:
    tb = tb.tb_next
  return (isinstance(error, RuntimeError) and str(error) == "Event loop is closed"
          and tb is not None and tb.tb_frame.f_code.co_name == "_check_closed")


# How jax's CUDA plugin (the gpu-compile extra) says, as it registers, that this host has no
# CUDA: its driver stub's note, or (when JAX_PLATFORMS does not rule CUDA out) its version
# check's traceback. Then everything written is about that.
_NO_CUDA = ("cudart_stub.cc:31] Could not find cuda drivers", "in _check_cuda_versions")


def _register_plugins_quietly() -> None:
  """Registers jax's PJRT plugins now (jax does it at the first backend use) with stderr set
  aside, and passes on what they wrote unless it is the CUDA plugin finding no CUDA driver
  (a GPU compile target needs none), so a binary's first line is its own. Backends are not
  started (`jax.distributed` may still follow); without this private hook of jax, nothing
  happens."""
  from jax._src import xla_bridge  # pylint: disable=import-outside-toplevel
  register = getattr(xla_bridge, "_discover_and_register_pjrt_plugins", None)
  if register is None:
    return
  sys.stderr.flush()
  with tempfile.TemporaryFile() as aside:
    saved = os.dup(2)
    os.dup2(aside.fileno(), 2)
    try:
      register()
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
    aside.seek(0)
    written = aside.read().decode(errors="replace")
  if written and not any(note in written for note in _NO_CUDA):
    sys.stderr.write(written)


def quiet_library_logs() -> None:
  """For experiment binaries: keep library INFO lines out of the absl log, the CUDA plugin's
  notes on a GPU-less host out of stderr, and the tracebacks a failed save would print by
  the hundred out of stderr (idempotent)."""
  _register_plugins_quietly()
  handler = logging.get_absl_handler()
  if not any(isinstance(f, _QuietLibraries) for f in handler.filters):
    handler.addFilter(_QuietLibraries())
  if not getattr(sys.unraisablehook, "jaxsys_quiet", False):
    previous = sys.unraisablehook

    def hook(unraisable):
      if not _late_write_callback(unraisable):
        previous(unraisable)
    hook.jaxsys_quiet = True
    sys.unraisablehook = hook


def _to_python(v):
  v = v.item() if hasattr(v, "item") else v
  if isinstance(v, float) and not math.isfinite(v):
    return str(v)  # JSON has no NaN/Inf; keep the row parseable
  return v


def read_metrics(workdir: str) -> list[dict[str, Any]]:
  """All rows of `<workdir>/metrics.jsonl`."""
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


class Progress:
  """A tqdm bar on a terminal; periodic log lines otherwise (files, CI, notebooks' logs)."""

  def __init__(self, total: int, initial: int = 0, *, log_every_s: float = 10.0, tty: bool | None = None):
    tty = sys.stderr.isatty() if tty is None else tty
    self.total, self.step, self._last_log = total, initial, 0.0
    self.log_every_s = log_every_s
    self._bar = None
    if tty and jax.process_index() == 0:
      from tqdm import tqdm
      self._bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)

  def update(self, step: int, **info: float) -> None:
    text = ", ".join(f"{k}={_fmt(v)}" for k, v in info.items())
    if self._bar is not None:
      self._bar.update(step - self.step)
      if info:
        self._bar.set_postfix_str(text, refresh=False)
    elif info and time.monotonic() - self._last_log >= self.log_every_s:
      self._last_log = time.monotonic()
      logging.info("step %d/%d  %s", step, self.total, text)
    self.step = step

  def close(self) -> None:
    if self._bar is not None:
      self._bar.close()


def _fmt(v: float) -> str:
  if isinstance(v, int) or abs(v) >= 1000:
    return f"{v:,.0f}"
  return f"{v:.3g}" if abs(v) < 0.1 else f"{v:.3f}"


def measure_matmul_flops(dtype: str = "float32", n: int = 2048, repeats: int = 5,
                         device: jax.Device | None = None) -> float:
  """Measured FLOP/s of one square matmul on one device: the peak MFU is reported against."""
  device = device or jax.local_devices()[0]
  a = jax.device_put(jnp.ones((n, n), dtype), device)
  f = jax.jit(lambda x, y: x @ y)
  f(a, a).block_until_ready()
  best = math.inf
  for _ in range(repeats):
    t0 = time.perf_counter()
    f(a, a).block_until_ready()
    best = min(best, time.perf_counter() - t0)
  return 2.0 * n ** 3 / best


# Dense bf16 peak FLOP/s of one chip from the vendors' datasheets (the sparse figures are
# twice these), keyed by `jax.Device.device_kind`. MFU on an accelerator is against these.
DATASHEET_PEAK_FLOPS = {
    "NVIDIA H100 80GB HBM3": 989e12,  # H100 SXM5
    "NVIDIA H100 PCIe": 756e12,
    "NVIDIA H100 NVL": 835e12,
    "NVIDIA H200": 989e12,  # H200 SXM
    "NVIDIA H200 NVL": 835e12,
    "NVIDIA A100-SXM4-40GB": 312e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100-PCIE-40GB": 312e12,
    "NVIDIA A100 80GB PCIe": 312e12,
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,  # v5e
    "TPU v5": 459e12,  # v5p
    "TPU v5p": 459e12,
    "TPU v6 lite": 918e12,  # v6e (Trillium)
    "TPU v6e": 918e12,
}


class Peak(NamedTuple):
  """The FLOP/s of all devices that MFU divides by, and where the number comes from."""
  flops: float
  source: str


def datasheet_peak() -> Peak | None:
  """The dense bf16 datasheet peak of all devices on a GPU/TPU in `DATASHEET_PEAK_FLOPS`,
  else None. The usual MFU denominator, whatever dtype the model computes in."""
  kind = jax.devices()[0].device_kind
  if jax.default_backend() == "cpu" or kind not in DATASHEET_PEAK_FLOPS:
    return None
  n = jax.device_count()
  return Peak(DATASHEET_PEAK_FLOPS[kind] * n, f"datasheet bf16 dense peak of {n} x {kind}")


@functools.cache
def measured_matmul_peak(dtype: str, backend: str, device_kind: str) -> float:
  """The best of two measured square matmuls in `dtype` on one device of `device_kind`, once a
  process: on CPU it takes about a second of every core, which each run in a process (a
  notebook's, a test's) paid again."""
  del device_kind  # a key of the cache: what the measurement is of
  # Best of two sizes: which one runs fastest varies (cache sizes, thread split). A CPU
  # reaches its peak at 1024 (2-core Xeon: 280-307 GFLOP/s, 2048 293-298) for a seventh of
  # 2048's CPU time (0.1 s against 0.75 s).
  sizes = (512, 1024) if backend == "cpu" else (1024, 2048)
  return max(measure_matmul_flops(dtype, n) for n in sizes)


def peak_flops(dtype: str = "float32") -> Peak:
  """`datasheet_peak()` where there is one; elsewhere (CPU, an unlisted chip) the best of
  two measured square matmuls in `dtype`. Simulated CPU devices share the host's cores,
  so on CPU one measurement is the whole machine's peak."""
  sheet = datasheet_peak()
  if sheet is not None:
    return sheet
  one = measured_matmul_peak(dtype, jax.default_backend(), jax.devices()[0].device_kind)
  if jax.default_backend() == "cpu":
    return Peak(one, f"measured {dtype} matmul peak of the host")
  n = jax.device_count()
  return Peak(one * n, f"measured {dtype} matmul peak x {n} devices (no datasheet entry for "
              f"{jax.devices()[0].device_kind!r})")


def host_cpu_seconds() -> tuple[float, float] | None:
  """(busy, total) CPU seconds of the whole host so far, from /proc/stat (Linux), else None:
  benchmarks compare two readings to say how much other processes used."""
  try:
    with open("/proc/stat", encoding="ascii") as f:
      ticks = [int(x) for x in f.readline().split()[1:]]
  except (OSError, ValueError):
    return None
  hz = os.sysconf("SC_CLK_TCK")
  return (sum(ticks) - ticks[3] - ticks[4]) / hz, sum(ticks) / hz


def machine_info() -> dict[str, Any]:
  """What a benchmark ran on: CPU model, cores, jax, backend, devices and the env knobs."""
  model = platform.processor() or ""
  try:
    out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    model = next((l.split(":", 1)[1].strip() for l in out.splitlines()
                  if l.startswith("Model name")), model)
  except OSError:
    pass
  return {"cpu": model or platform.machine(), "cores": len(os.sched_getaffinity(0)),
          "jax": jax.__version__, "backend": jax.default_backend(),
          "device": jax.devices()[0].device_kind, "devices": jax.device_count(),
          "xla_flags": os.environ.get("XLA_FLAGS", ""),
          "glibc_tunables": os.environ.get("GLIBC_TUNABLES", "")}

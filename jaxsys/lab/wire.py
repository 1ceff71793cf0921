"""What crossed the link, over time and step by step.

A sampler thread reads the links' transmit counters every few milliseconds
(`/proc/<pid>/net/dev` of a process inside each namespace: the counters of that process's
namespace; a device counts a packet as it leaves its shaper, so these are the shaped
links' bytes), summed over the namespaces.
Each training step's window comes from the runner's metrics rows (`time` at the step's end,
`step_time_s` its duration, eval and saves excluded), so a step's bytes, and the time the
link was busy within it, are the counters' differences over that window.
"""
from __future__ import annotations

import threading
import time

import numpy as np

# A sample counts as busy when the link carried at least this share of its rate in it
# (unshaped: BUSY_UNSHAPED_BPS): a step's waiting on the link, not its keep-alives.
BUSY_SHARE = 0.1
BUSY_UNSHAPED_BPS = 80e6


def read_device(pid: int, device: str = "lo") -> tuple[int, int]:
  """(bytes, packets) transmitted by `device` in process `pid`'s network namespace."""
  with open(f"/proc/{pid}/net/dev") as f:
    for line in f:
      name, _, stats = line.partition(":")
      if name.strip() == device:
        fields = stats.split()
        return int(fields[8]), int(fields[9])
  raise RuntimeError(f"no device {device} in process {pid}'s namespace")


class Sampler:
  """Samples (time, bytes, packets), summed over `device` in the namespaces of `pids`,
  every `interval` seconds, in a thread, until `stop()`."""

  def __init__(self, pids: list[int], device: str = "lo", interval: float = 0.005):
    self.pids, self.device, self.interval = pids, device, interval
    self._rows: list[tuple[float, int, int]] = []
    self._done = threading.Event()
    self._thread = threading.Thread(target=self._loop, daemon=True, name="wire-sampler")

  def start(self) -> "Sampler":
    self._thread.start()
    return self

  def _loop(self) -> None:
    while not self._done.is_set():
      try:
        counts = [read_device(pid, self.device) for pid in self.pids]
      except (OSError, RuntimeError):  # a namespace's last process is gone
        return
      self._rows.append((time.time(), sum(c[0] for c in counts), sum(c[1] for c in counts)))
      self._done.wait(self.interval)

  def stop(self) -> np.ndarray:
    """The samples, [n, 3]: unix time, bytes, packets (cumulative)."""
    self._done.set()
    self._thread.join()
    return np.asarray(self._rows, dtype=np.float64).reshape(-1, 3)


def busy_threshold_bps(rate_bps: float | None) -> float:
  return BUSY_SHARE * rate_bps if rate_bps else BUSY_UNSHAPED_BPS


def window(samples: np.ndarray, start: float, end: float, rate_bps: float | None) -> dict:
  """Bytes and packets the link carried between unix times `start` and `end`
  (interpolated between samples), and the seconds in it the link was busy."""
  t, nbytes, packets = samples.T
  sent = float(np.interp(end, t, nbytes) - np.interp(start, t, nbytes))
  pkts = float(np.interp(end, t, packets) - np.interp(start, t, packets))
  dt = np.diff(t)
  rate = np.diff(nbytes) * 8 / np.maximum(dt, 1e-9)
  overlap = np.clip(np.minimum(t[1:], end) - np.maximum(t[:-1], start), 0, None)
  busy = float(np.sum(overlap[rate >= busy_threshold_bps(rate_bps)]))
  return {"bytes": sent, "packets": pkts, "busy_s": busy}


def utilisation(samples: np.ndarray, rate_bps: float | None, bin_s: float = 0.1) -> list[dict]:
  """The link's throughput in bins of `bin_s` seconds: [{t (since the first sample), time
  (unix, the bin's start), bps, share (of the rate, shaped links only)}]."""
  t, nbytes, _ = samples.T
  if len(t) < 2:
    return []
  edges = np.arange(t[0], t[-1] + bin_s, bin_s)
  sent = np.diff(np.interp(edges, t, nbytes))
  out = []
  for start, b in zip(edges[:-1], sent):
    row = {"t": round(float(start - t[0]), 3), "time": float(start), "bps": float(b * 8 / bin_s)}
    if rate_bps:
      row["share"] = row["bps"] / rate_bps
    out.append(row)
  return out

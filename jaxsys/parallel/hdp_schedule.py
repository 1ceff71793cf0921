"""Per-rank HDP schedule: every device runs its own number of micro-batches.

`hdp.plan` is lock-step: all devices run micro-step m together, so each micro-step lasts
as long as its slowest device, and a ring member (attention ~ L x tpd per device) makes
the devices holding short documents wait. ByteScale's DP-Balance (arXiv 2502.21231,
Sec. 5) balances per rank instead: each rank runs its own micro-batches and only the
gradient all-reduce waits for all of them. A schedule has two kinds of work:

  rings: a sequence of L > tpd tokens on an aligned power-of-two block of
         `hdp.ring_size(L)` devices (fewer than twice what it needs), zigzag shares, one
         micro-batch for every member; the spare slots of a member's cell take whole
         short sequences;
  local: a device's own micro-batches of whole short sequences, tpd slots each.

Placement is LPT on estimated time (`hdp.sequence_cost`, a ring member's share is the
cost over the ring size): rings heaviest first, each on the aligned block whose members
are all free first (a ring's members start together); then short sequences heaviest
first, each onto the least loaded device. A device then packs its short sequences
first-fit decreasing, into the spare slots of its ring cells first and then into local
micro-batches. A device runs its rings in order, then its local micro-batches.

Example:
  s = schedule([9000, 300, 5000, 120], num_devices=4, tokens_per_device=4096)
  s.rings    # (Ring(seq=0, devices=(0, 1, 2, 3), fill=...), Ring(seq=2, devices=(0, 1), ...))
  s.local    # per device: its micro-batches (tuples of sequence indices)
  s.micro_batches()  # per device: rings + local micro-batches
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxsys.parallel import hdp, hdp_layout


@dataclasses.dataclass(frozen=True)
class Ring:
  """One sequence on an aligned block of devices; fill[k]: short sequences beside
  member k's share, in its cell's spare slots."""
  seq: int
  devices: tuple[int, ...]
  fill: tuple[tuple[int, ...], ...]

  def entries(self) -> list[tuple[int, tuple[int, ...]]]:
    """The ring's micro-batch as (sequence, device ids relative to the block) entries,
    the format `hdp_layout.pack_step` lays out over `len(devices)` devices."""
    c = len(self.devices)
    return [(self.seq, tuple(range(c)))] + [(i, (k,)) for k in range(c) for i in self.fill[k]]


@dataclasses.dataclass(frozen=True)
class Schedule:
  """rings: in dispatch order; local[d]: device d's micro-batches after its rings."""
  rings: tuple[Ring, ...]
  local: tuple[tuple[tuple[int, ...], ...], ...]

  @property
  def num_devices(self) -> int:
    return len(self.local)

  def micro_batches(self) -> np.ndarray:
    """[devices] micro-batches each device runs (rings and local)."""
    counts = np.array([len(batches) for batches in self.local], np.int64)
    for ring in self.rings:
      counts[list(ring.devices)] += 1
    return counts

  def sequences(self) -> list[int]:
    """Every sequence index the schedule runs, each once (sorted)."""
    out = [r.seq for r in self.rings] + [i for r in self.rings for f in r.fill for i in f]
    out += [i for batches in self.local for b in batches for i in b]
    return sorted(out)


def _aligned_block(load: np.ndarray, c: int) -> int:
  """The first device of the aligned block of c whose members are all free first."""
  starts = load.reshape(-1, c).max(axis=1)
  return int(np.argmin(starts)) * c


def schedule(lengths: Sequence[int], *, num_devices: int, tokens_per_device: int,
             d_model: int = hdp.DEFAULT_D_MODEL) -> Schedule:
  """The per-rank schedule of `lengths` (see the module docstring); errors as hdp.plan."""
  arr = hdp._check(lengths, num_devices, tokens_per_device)
  cap = tokens_per_device
  costs = hdp.sequence_cost(arr, d_model=d_model) if arr.size else np.zeros(0)
  load = np.zeros(num_devices)
  long = [i for i in range(arr.size) if arr[i] > cap]
  short = [i for i in range(arr.size) if arr[i] <= cap]

  rings: list[tuple[int, tuple[int, ...]]] = []
  for i in sorted(long, key=lambda i: (-costs[i], i)):
    c = hdp.ring_size(int(arr[i]), cap)
    first = _aligned_block(load, c)
    devices = tuple(range(first, first + c))
    load[first:first + c] = load[first:first + c].max() + costs[i] / c
    rings.append((i, devices))

  mine: list[list[int]] = [[] for _ in range(num_devices)]
  for i in sorted(short, key=lambda i: (-costs[i], i)):
    d = int(np.argmin(load))
    mine[d].append(i)
    load[d] += costs[i]

  # Per device, first-fit decreasing: ring cells' spare slots first, then local batches.
  spare: dict[tuple[int, int], int] = {}  # (ring index, member) -> free slots
  for r, (i, devices) in enumerate(rings):
    for k, share in enumerate(hdp_layout.ring_shares(int(arr[i]), len(devices))):
      spare[r, k] = cap - share.size
  fill: dict[tuple[int, int], list[int]] = {key: [] for key in spare}
  cells_of = {d: [(r, devices.index(d)) for r, (_, devices) in enumerate(rings)
                  if d in devices] for d in range(num_devices)}
  local: list[tuple[tuple[int, ...], ...]] = []
  for d in range(num_devices):
    batches: list[list[int]] = []
    free: list[int] = []
    for i in sorted(mine[d], key=lambda i: (-arr[i], i)):
      n = int(arr[i])
      cell = next((key for key in cells_of[d] if spare[key] >= n), None)
      if cell is not None:
        fill[cell].append(i)
        spare[cell] -= n
        continue
      b = next((b for b, f in enumerate(free) if f >= n), None)
      if b is None:
        batches.append([])
        free.append(cap)
        b = len(batches) - 1
      batches[b].append(i)
      free[b] -= n
    local.append(tuple(tuple(b) for b in batches))
  return Schedule(
      rings=tuple(Ring(i, devices, tuple(tuple(fill[r, k]) for k in range(len(devices))))
                  for r, (i, devices) in enumerate(rings)),
      local=tuple(local))

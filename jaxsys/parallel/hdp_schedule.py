"""Per-rank HDP schedule: every device runs its own number of micro-batches.

`hdp.plan` is lock-step: all devices run micro-step m together, so each micro-step lasts
as long as its slowest device, and a ring member (attention ~ L x tpd per device) makes
the devices holding short documents wait. ByteScale's DP-Balance (arXiv 2502.21231,
Sec. 5) balances per rank instead: each rank runs its own micro-batches and only the
gradient all-reduce waits for all of them. A schedule has two kinds of work:

  rings: sequences of L > tpd tokens on a run of devices inside an aligned power-of-two
         block, zigzag shares, one micro-batch for every member. A ring holds one
         sequence on ceil(L / tpd) devices (`hdp.devices_needed`), or several that share
         it (`hdp.share_groups`: each on at most twice the devices it needs, so the
         ring's cells are full); the spare slots of a member's cell take whole short
         sequences;
  local: a device's own micro-batches of whole short sequences, tpd slots each.

Placement is LPT on estimated time (`FlopCost` by default: a ring member runs one cell of
tpd tokens through the matmuls plus its share of the attention; a short sequence costs
`hdp.sequence_cost`):
rings heaviest first, each on the run whose members are all free first (a ring's members
start together). A ring may instead take an aligned power-of-two block of up to twice the
devices it needs, when it ends sooner by more than the pool's share of the matmul work
its empty cells waste: shorter rings even the load where attention dominates (long
sequences), at the price of padding (`widen=False` keeps rings tight). Then short
sequences, heaviest first: into the spare slots of a ring cell if one fits (that of the
least loaded device), else onto the least loaded device, which packs its own first-fit
decreasing into local micro-batches (`hdp.pack_rows`). A
device runs its rings in order, then its local micro-batches.

Example:
  s = schedule([9000, 300, 5000, 120], num_devices=4, tokens_per_device=4096)
  s.rings    # (Ring(seqs=(0, 2), devices=(0, 1, 2, 3), fill=((), (), (1,), (3,))),)
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
  """Sequences each split over all of a run of devices; fill[k]: short sequences
  beside member k's shares, in its cell's spare slots."""
  seqs: tuple[int, ...]
  devices: tuple[int, ...]
  fill: tuple[tuple[int, ...], ...]

  def entries(self) -> list[tuple[int, tuple[int, ...]]]:
    """The ring's micro-batch as (sequence, device ids relative to the block) entries,
    the format `hdp_layout.pack_step` lays out over `len(devices)` devices."""
    c = len(self.devices)
    return ([(i, tuple(range(c))) for i in self.seqs]
            + [(i, (k,)) for k in range(c) for i in self.fill[k]])


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
    out = [i for r in self.rings for i in r.seqs + sum(r.fill, ())]
    out += [i for batches in self.local for b in batches for i in b]
    return sorted(out)


def _ring_sizes(need: int, num_devices: int, widen: bool) -> list[int]:
  """A ring's candidate sizes: the devices it needs and, widened, each power of two up to
  twice that (its aligned block, then larger blocks)."""
  sizes = [need]
  c = hdp.block_size(need + 1) if widen else 2 * need + 1
  while c <= min(2 * need, num_devices):
    sizes.append(c)
    c *= 2
  return sizes


def _free_run(load: np.ndarray, c: int) -> int:
  """The first device of the run of c devices, inside an aligned block of
  hdp.block_size(c), whose members are all free first (the lowest such start on ties)."""
  block = hdp.block_size(c)
  starts = np.lib.stride_tricks.sliding_window_view(load, c).max(axis=1)
  first = np.arange(starts.size)
  starts[first // block != (first + c - 1) // block] = np.inf
  return int(np.argmin(starts))


@dataclasses.dataclass(frozen=True)
class FlopCost:
  """The schedule's default time estimate: forward FLOPs of one layer (`hdp`'s terms).

  A ring member runs a whole cell of tokens_per_device tokens through the matmuls (fixed
  shapes: padding too) and its share of the ring's attention; ring traffic is free.
  """
  tokens_per_device: int
  d_model: int = hdp.DEFAULT_D_MODEL

  def cell(self) -> float:
    """One cell's matmuls: what an empty cell of a micro-batch still costs."""
    return float(hdp.LINEAR_FLOPS_PER_TOKEN * self.d_model ** 2 * self.tokens_per_device)

  def ring(self, lengths: np.ndarray, devices: int) -> float:
    """A member's time in a ring of `devices` holding `lengths` (split over all of it)."""
    attention = hdp.ATTENTION_FLOPS_PER_PAIR * self.d_model * np.sum(
        np.asarray(lengths, np.float64) ** 2)
    return self.cell() + float(attention) / devices

  def short(self, length: int) -> float:
    """A whole short sequence's time on one device."""
    return float(hdp.sequence_cost(int(length), d_model=self.d_model))


def schedule(lengths: Sequence[int], *, num_devices: int, tokens_per_device: int,
             d_model: int = hdp.DEFAULT_D_MODEL, widen: bool = True,
             cost=None) -> Schedule:
  """The per-rank schedule of `lengths` (see the module docstring); errors as hdp.plan.

  widen=False keeps every ring on the devices it needs (least padding). cost: the time
  estimate balanced (cell(), ring(lengths, devices), short(length), all in one unit);
  default FlopCost(tokens_per_device, d_model). A simulator passes its own, links
  included (`hdp_sim.ScheduleCost`).
  """
  arr = hdp._check(lengths, num_devices, tokens_per_device)
  cap = tokens_per_device
  cost = FlopCost(tokens_per_device, d_model) if cost is None else cost
  costs = hdp.sequence_cost(arr, d_model=d_model) if arr.size else np.zeros(0)
  load = np.zeros(num_devices)

  rings: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
  groups = hdp.share_groups(arr, cap, num_devices)
  for seqs, need in sorted(groups, key=lambda g: (-costs[list(g[0])].sum(), g[0])):
    options = []
    for c in _ring_sizes(need, num_devices, widen):
      first = _free_run(load, c)
      end = load[first:first + c].max() + cost.ring(arr[list(seqs)], c)
      # A wider ring may end sooner, but its c - need extra cells run the matmuls on
      # padding, work lost to the pool: in a balanced schedule that adds its share,
      # (c - need) * cell / N, to every device's time.
      options.append((end + (c - need) * cost.cell() / num_devices, end, c, first))
    _, end, c, first = min(options)
    load[first:first + c] = end
    rings.append((seqs, tuple(range(first, first + c))))

  # Ring cells' spare slots: (ring, member) -> free slots, and the device each is on.
  cells = [(r, k) for r, (_, devices) in enumerate(rings) for k in range(len(devices))]
  spare = np.array([cap - sum(hdp_layout.ring_shares(int(arr[i]), len(rings[r][1]))[k].size
                              for i in rings[r][0]) for r, k in cells], np.int64)
  on = np.array([rings[r][1][k] for r, k in cells], np.int64)
  fill: dict[tuple[int, int], list[int]] = {cell_id: [] for cell_id in cells}
  mine: list[list[int]] = [[] for _ in range(num_devices)]
  short = {i: cost.short(arr[i]) for i in range(arr.size) if arr[i] <= cap}
  for i in sorted(short, key=lambda i: (-short[i], i)):
    fits = np.flatnonzero(spare >= arr[i])
    if fits.size:  # the spare slots of the least loaded device's ring cell
      j = int(fits[np.argmin(load[on[fits]])])
      fill[cells[j]].append(i)
      spare[j] -= arr[i]
      d = int(on[j])
    else:
      d = int(np.argmin(load))
      mine[d].append(i)
    load[d] += short[i]

  # Each device packs its own first-fit decreasing into micro-batches of cap slots.
  local = [tuple(tuple(mine[d][j] for j in batch)
                 for batch in hdp.pack_rows(arr[mine[d]], cap)) for d in range(num_devices)]
  return Schedule(
      rings=tuple(Ring(seqs, devices, tuple(tuple(fill[r, k]) for k in range(len(devices))))
                  for r, (seqs, devices) in enumerate(rings)),
      local=tuple(local))

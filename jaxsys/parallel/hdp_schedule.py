"""Per-rank HDP schedule: every device runs its own number of micro-batches.

`hdp.plan` is lock-step: all devices run micro-step m together, so each micro-step lasts
as long as its slowest device, and a ring member (attention ~ L x tpd per device) makes
the devices holding short documents wait. ByteScale's DP-Balance (arXiv 2502.21231,
Sec. 5) balances per rank instead: each rank runs its own micro-batches and only the
gradient all-reduce waits for all of them. A schedule has two kinds of work:

  rings: sequences of L > tpd tokens on a run of devices inside an aligned power-of-two
         block, zigzag shares, one micro-batch for every member. A ring holds one
         sequence on ceil(L / tpd) devices (`hdp.devices_needed`), or several that share
         it (`hdp.share_groups`). Its program's cells are sized to its largest share, in
         steps of tpd / CELL_STEPS, so its matmuls and K/V hops carry (nearly) only real
         tokens; a member's spare slots take whole short sequences;
  local: a device's own micro-batches of whole short sequences, each of tpd, tpd/2, ...
         or tpd / 2^(LOCAL_SIZES - 1) slots, the smallest that holds them (`local_cell`).

Placement is LPT on estimated time (`cost.ForwardEstimate` by default: a ring member runs
its cell through the matmuls plus its share of the attention; a short sequence costs
`cost.sequence_cost`): rings heaviest first, each on a run of devices chosen with the
time its members wait for the last one counted as lost (a ring's members start
together). A ring may instead take an aligned power-of-two block of up to twice the
devices it needs (widen=True): it then ends sooner, but the device time its empty slots
and exposed hops waste is lost to the pool; two rules weigh that (`RULES`). Then short
sequences, heaviest first, where they end soonest: in spare slots of a ring cell (a ring
lasts as long as its slowest member) or of a device's local micro-batch (only their
attention adds), in the device's newest micro-batch grown to the next size, or in a new
one. A device runs its rings in order, then its local micro-batches.

With a budget of micro-batches per device (`fit`: what one training step of m micro-batches
takes of the documents offered), rings and short sequences go only where a device has
room, the first sequence before all (so a step always keeps it), and what finds no room
is left out; one schedule, not a search over schedules.

Ring placements are built as candidates (rings shared or one per sequence: shared rings
fill their cells, but each hop then carries all their shares for a fraction of the
attention; widened under each rule, and tight) and the one whose estimate ends first,
short sequences counted at their mean, is kept (with a budget: the one that leaves the
fewest tokens out, then that).

Example:
  s = schedule([9000, 300, 5000, 120], num_devices=4, tokens_per_device=4096)
  s.rings    # (Ring(seqs=(0, 2), devices=(0, 1, 2, 3), fill=((), (), (), ()), cell=3584),)
  s.local    # per device: its micro-batches (tuples of sequence indices)
  s.micro_batches()  # per device: rings + local micro-batches
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import numpy as np

from jaxsys.parallel import hdp
from jaxsys.parallel.cost import DEFAULT_D_MODEL, ForwardEstimate, flop_model, sequence_cost

# A ring's cells are sized to its largest share in steps of tokens_per_device / CELL_STEPS:
# its matmuls and K/V hops then carry (nearly) only real tokens.
CELL_STEPS = 8
# A device's local micro-batches hold tpd, tpd / 2, ... tpd / 2^(LOCAL_SIZES - 1) slots:
# the smallest that holds their tokens (one program per size).
LOCAL_SIZES = 4
# How a ring's size is chosen among those it may take (see _place_rings); each is tried.
RULES = ("share", "bound")


@dataclasses.dataclass(frozen=True)
class Ring:
  """Sequences each split over all of a run of devices; fill[k]: short sequences
  beside member k's shares, in its cell's spare slots; cell: the slots each member
  holds (the ring program's tokens per device, at most tokens_per_device)."""
  seqs: tuple[int, ...]
  devices: tuple[int, ...]
  fill: tuple[tuple[int, ...], ...]
  cell: int

  def entries(self) -> list[tuple[int, tuple[int, ...]]]:
    """The ring's micro-batch as (sequence, device ids relative to the block) entries,
    the format `hdp_layout.pack_step` lays out over `len(devices)` devices."""
    c = len(self.devices)
    return ([(i, tuple(range(c))) for i in self.seqs]
            + [(i, (k,)) for k in range(c) for i in self.fill[k]])


@dataclasses.dataclass(frozen=True)
class Schedule:
  """rings: in dispatch order; local[d]: device d's micro-batches after its rings; left:
  the sequences a budget left out (`schedule(budget=...)`), ascending."""
  rings: tuple[Ring, ...]
  local: tuple[tuple[tuple[int, ...], ...], ...]
  left: tuple[int, ...] = ()

  @property
  def num_devices(self) -> int:
    return len(self.local)

  def micro_batches(self) -> np.ndarray:
    """[devices] micro-batches each device runs (rings and local)."""
    counts = np.array([len(batches) for batches in self.local], np.int64)
    for ring in self.rings:
      counts[list(ring.devices)] += 1
    return counts

  def slots(self, lengths, tokens_per_device: int) -> int:
    """Token slots every micro-batch runs, padding included (a ring's c cells, a local
    micro-batch's `local_cell`), for sequences of `lengths`."""
    return (sum(len(r.devices) * r.cell for r in self.rings)
            + sum(local_cell(int(sum(lengths[i] for i in batch)), tokens_per_device)
                  for batches in self.local for batch in batches))

  def sequences(self) -> list[int]:
    """Every sequence index the schedule runs, each once (sorted)."""
    out = [i for r in self.rings for i in r.seqs + sum(r.fill, ())]
    out += [i for batches in self.local for b in batches for i in b]
    return sorted(out)

  def renumbered(self, new: dict[int, int]) -> Schedule:
    """The same schedule with sequence i called new[i] (nothing left out)."""
    ids = lambda seqs: tuple(new[i] for i in seqs)
    return Schedule(
        rings=tuple(dataclasses.replace(r, seqs=ids(r.seqs), fill=tuple(map(ids, r.fill)))
                    for r in self.rings),
        local=tuple(tuple(map(ids, batches)) for batches in self.local))


def _ring_sizes(need: int, num_devices: int, widen: bool) -> list[int]:
  """A ring's candidate sizes: the devices it needs and, widened, each power of two up to
  twice that (its aligned block, then larger blocks)."""
  sizes = [need]
  c = hdp.block_size(need + 1) if widen else 2 * need + 1
  while c <= min(2 * need, num_devices):
    sizes.append(c)
    c *= 2
  return sizes


def member_tokens(lengths: Sequence[int], devices: int) -> np.ndarray:
  """[devices] tokens each member of a ring holds of `lengths` split zigzag over it
  (`hdp_layout.ring_shares`)."""
  held = np.zeros(devices, np.int64)
  for n in lengths:
    base, extra = divmod(int(n), 2 * devices)  # array_split: the first `extra` chunks +1
    k = np.arange(devices)
    held += 2 * base + (k < extra) + (2 * devices - 1 - k < extra)
  return held


def cell_size(tokens: int, tokens_per_device: int) -> int:
  """A ring program's slots per device: `tokens` rounded up to a multiple of
  tokens_per_device / CELL_STEPS, so at most CELL_STEPS shapes per run of devices."""
  step = -(-tokens_per_device // CELL_STEPS)
  return min(tokens_per_device, -(-max(1, tokens) // step) * step)


def local_sizes(tokens_per_device: int) -> np.ndarray:
  """The slots a local micro-batch may have, ascending: tokens_per_device / 2^k for
  k < LOCAL_SIZES (rounded up)."""
  return np.array(_local_sizes(tokens_per_device))


@functools.lru_cache(maxsize=64)
def _local_sizes(tokens_per_device: int) -> tuple[int, ...]:
  return tuple(sorted({-(-tokens_per_device // 2 ** k) for k in range(LOCAL_SIZES)}))


def local_cell(tokens: int, tokens_per_device: int) -> int:
  """A local micro-batch's slots: the smallest of `local_sizes` that holds `tokens`."""
  return next(size for size in _local_sizes(tokens_per_device) if size >= tokens)


def _runs(load: np.ndarray, c: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Every run of c devices inside an aligned block of hdp.block_size(c): (first device,
  when all its members are free, the time they wait for the last one)."""
  block = hdp.block_size(c)
  windows = np.lib.stride_tricks.sliding_window_view(load, c)
  firsts = np.arange(windows.shape[0])
  firsts = firsts[firsts // block == (firsts + c - 1) // block]
  starts = windows[firsts].max(axis=1)
  return firsts, starts, c * starts - windows[firsts].sum(axis=1)


def schedule(lengths: Sequence[int], *, num_devices: int, tokens_per_device: int,
             d_model: int = DEFAULT_D_MODEL, widen: bool = True,
             cost=None, budget: int | None = None, later: int | None = None) -> Schedule:
  """The per-rank schedule of `lengths` (see the module docstring); errors as hdp.plan.

  widen=False keeps every ring on the devices it needs. cost: the time estimate balanced
  (cell(tokens), ring(lengths, devices, cell), short(length), all in one unit); default
  ForwardEstimate(flop_model(d_model)). A simulator passes its own, links included
  (`hdp_sim.ScheduleCost`).

  budget: at most that many micro-batches on any device; what does not fit is left out
  (`Schedule.left`). Sequence 0 is then placed first, so it always fits, and sequences
  from index `later` on (short ones) only after all others, in order, where room is left.
  """
  arr = hdp._check(lengths, num_devices, tokens_per_device)
  if budget is not None and (not isinstance(budget, int) or budget < 1):
    raise ValueError(f"budget={budget!r}: must be an int >= 1 (micro-batches per device)")
  later = arr.size if later is None else later
  if np.any(arr[later:] > tokens_per_device):
    raise ValueError(f"later={later}: the sequences from it on must be short "
                     f"(at most tokens_per_device={tokens_per_device} tokens)")
  limit = Budget(budget if budget is not None else np.iinfo(np.int64).max, later,
                   first=budget is not None)
  cost = ForwardEstimate(flop_model(d_model)) if cost is None else cost
  need = {i: hdp.devices_needed(int(n), tokens_per_device) for i, n in enumerate(arr)}
  alone = [((i,), c) for i, c in need.items() if c > 1]
  shared = hdp.share_groups(arr, tokens_per_device, num_devices)
  # Each candidate's end is estimated before the short sequences are placed (they even
  # out the devices): the latest ring, or the mean device once they are in.
  short_work = sum(cost.short(int(n)) for n in arr[arr <= tokens_per_device])

  @functools.cache
  def ring_time(seqs: tuple[int, ...], c: int) -> tuple[int, float]:
    """(cell, member time) of a ring of `seqs` on c devices: shared by the candidates."""
    cell = cell_size(int(member_tokens(arr[list(seqs)], c).max()), tokens_per_device)
    return cell, cost.ring(arr[list(seqs)], c, cell)

  # Rings go before short sequences: a short first one keeps a micro-batch of the last
  # device while they are placed.
  held, busy = np.zeros(num_devices, np.int64), np.zeros(num_devices)
  if limit.first and arr.size and arr[0] <= tokens_per_device:
    held[-1], busy[-1] = 1, cost.short(int(arr[0]))
  candidates = [_place_rings(arr, groups, widened, ring_time, rule, short_work, limit,
                             busy, held, d_model)
                for groups in ([shared] if shared == alone else [shared, alone])
                for widened, rule in [(True, r) for r in RULES if widen] + [(False, RULES[0])]]
  # The fewest tokens left out, then the soonest estimated end.
  rings, load, counts, left = min(candidates, key=lambda c: (
      int(arr[c[3]].sum()), max(c[1].max(initial=0.0), (c[1].sum() + short_work) / num_devices)))
  return _place_shorts(arr, rings, load - busy, counts - held, left, tokens_per_device, cost,
                       limit)


@dataclasses.dataclass(frozen=True)
class Budget:
  """Micro-batches a device may run (`most`); sequences from `later` on go after all
  others, in order; `first`: sequence 0 goes before all (see `schedule`)."""
  most: int
  later: int
  first: bool

  def order(self, seqs: tuple[int, ...], weight: float) -> tuple:
    """Sort key of a ring (`seqs`) or a short sequence (`(i,)`) of `weight` (heaviest first)."""
    i = seqs[0]
    return (not (self.first and 0 in seqs), i >= self.later,
            -weight if i < self.later else 0.0, seqs)


def fit(lengths: Sequence[int], *, budget: int, num_devices: int, tokens_per_device: int,
        **kwargs) -> tuple[list[int], Schedule]:
  """(kept, their schedule): what of the offered `lengths` one step of `budget`
  micro-batches per device takes, in one schedule; it indexes the kept sequences.

  The run of sequences from the first whose tokens fit the step's slots is scheduled (the
  first always kept), then the later short ones, in order, where room is left; the rest
  are not kept. kwargs: `schedule`'s (d_model, widen, cost).
  """
  lengths = [int(n) for n in lengths]
  capacity = budget * num_devices * tokens_per_device
  within = max(1, int(np.searchsorted(np.cumsum(lengths), capacity, side="right")))
  order = list(range(within)) + [i for i in range(within, len(lengths))
                                 if lengths[i] <= tokens_per_device]
  sched = schedule([lengths[i] for i in order], num_devices=num_devices,
                   tokens_per_device=tokens_per_device, budget=budget, later=within, **kwargs)
  left = set(sched.left)
  kept = sorted(order[k] for k in range(len(order)) if k not in left)
  position = {i: n for n, i in enumerate(kept)}
  return kept, sched.renumbered({k: position[i] for k, i in enumerate(order) if k not in left})


def _place_rings(arr, groups, widen, ring_time, rule, short_work, budget: Budget, load,
                 counts, d_model):
  """(rings as (sequences, devices, cell), load: when each device is done with them,
  micro-batches per device, sequences left out) of `groups`, the rings' sequences, placed
  after `load` and `counts`, their sizes chosen by `rule` (see below); ring_time: (seqs, c)
  -> (cell, member time)."""
  num_devices = load.size
  costs = sequence_cost(arr, d_model=d_model) if arr.size else np.zeros(0)
  load, counts = load.copy(), counts.copy()
  # Device time still to place: every ring on the devices it needs, every short sequence.
  todo = sum(need * ring_time(seqs, need)[1] for seqs, need in groups) + short_work
  rings: list[tuple[tuple[int, ...], tuple[int, ...], int]] = []
  left: list[int] = []
  for seqs, need in sorted(groups, key=lambda g: budget.order(g[0], costs[list(g[0])].sum())):
    todo -= need * ring_time(seqs, need)[1]
    options = []
    for c in _ring_sizes(need, num_devices, widen):
      cell, member = ring_time(seqs, c)
      firsts, starts, idle = _runs(load, c)
      room = np.lib.stride_tricks.sliding_window_view(counts, c)[firsts].max(axis=1) < budget.most
      if not room.any():
        continue
      firsts, starts, idle = firsts[room], starts[room], idle[room]
      ends = starts + member
      # A ring ends sooner when wider or on a run free sooner, but device time is lost to
      # the pool: its empty slots, exposed hops and members waiting for the last one.
      # "share": that time spread over the pool adds to the end. "bound": the schedule
      # ends no sooner than this ring, nor than the mean device once all else is placed
      # (ties: the least device time lost).
      lost = c * member + idle
      if rule == "share":
        keys = np.stack([ends + lost / num_devices, np.zeros_like(ends)])
      else:
        busy = load.sum() + c * member + idle
        keys = np.stack([np.maximum(ends, (busy + todo) / num_devices), lost])
      k = int(np.lexsort(keys[::-1])[0])
      options.append((*keys[:, k], ends[k], c, int(firsts[k]), cell))
    if not options:  # every run of devices has run its budget
      left += seqs
      continue
    *_, end, c, first, cell = min(options)
    load[first:first + c] = end
    counts[first:first + c] += 1
    rings.append((seqs, tuple(range(first, first + c)), cell))

  return rings, load, counts, left


def _place_shorts(arr, rings, load, counts, left, cap, cost, budget: Budget) -> Schedule:
  """The schedule: `rings` (placed, devices busy until `load`, `counts` micro-batches each;
  `left`: sequences left out) and the short sequences."""
  num_devices = load.size
  load, counts, left = load.copy(), counts.copy(), list(left)
  # Short sequences, heaviest first, where they end soonest (see the module docstring).
  # A ring lasts as long as its slowest member, so fill that makes a member the slowest
  # delays all of them.
  cells = [(r, k) for r, (_, devices, _) in enumerate(rings) for k in range(len(devices))]
  spare = np.concatenate([cell - member_tokens(arr[list(seqs)], len(devices))
                          for seqs, devices, cell in rings] or [np.zeros(0, np.int64)])
  ring_of = np.array([r for r, _ in cells], np.int64)
  extra = np.zeros(len(cells))  # fill attention per cell
  most = np.zeros(len(rings))   # its ring's largest
  fill: dict[tuple[int, int], list[int]] = {cell_id: [] for cell_id in cells}
  local: list[list[list[int]]] = [[] for _ in range(num_devices)]
  held: list[list[int]] = [[] for _ in range(num_devices)]  # tokens per local batch
  sizes = local_sizes(cap)
  size_cost = np.array([cost.cell(int(size)) for size in sizes])
  free = np.zeros(num_devices, np.int64)     # most slots a batch has before it grows
  last = np.full(num_devices, cap + 1)       # tokens in the newest batch (none: cap + 1)
  short = [i for i in range(arr.size) if arr[i] <= cap]
  for i in sorted(short, key=lambda i: budget.order((i,), arr[i])):
    n = int(arr[i])
    attention = cost.short(n) - cost.cell(n)
    # Per device: a batch with room (free), the newest batch grown to the next size, or
    # a new batch of the smallest size that holds it, within the budget.
    new = np.where(counts < budget.most, size_cost[np.searchsorted(sizes, n)], np.inf)
    grow = np.where(last + n <= cap, size_cost[np.searchsorted(sizes, np.minimum(last + n, cap))]
                    - size_cost[np.searchsorted(sizes, np.minimum(last, cap))], np.inf)
    adds = np.where(free >= n, 0.0, np.minimum(grow, new))
    ends = load + attention + adds
    d = int(np.argmin(ends))
    fits = np.flatnonzero(spare >= n)
    if fits.size:  # the cell that delays its ring least
      delay = np.maximum(0.0, extra[fits] + attention - most[ring_of[fits]])
      j = int(fits[np.argmin(delay)])
      r, members = ring_of[j], list(rings[ring_of[j]][1])
      if load[members].max() + delay.min() <= ends[d]:
        fill[cells[j]].append(i)
        spare[j] -= n
        extra[j] += attention
        load[members] += max(0.0, extra[j] - most[r])
        most[r] = max(most[r], extra[j])
        continue
    if np.isinf(ends[d]):  # no room anywhere within the budget
      left.append(i)
      continue
    if free[d] >= n:  # the first batch with room
      b = next(b for b, t in enumerate(held[d]) if local_cell(t, cap) - t >= n)
    elif grow[d] <= new[d]:
      b = len(held[d]) - 1
    else:
      local[d].append([])
      held[d].append(0)
      counts[d] += 1
      b = len(held[d]) - 1
    local[d][b].append(i)
    held[d][b] += n
    free[d] = max(local_cell(t, cap) - t for t in held[d])
    last[d] = held[d][-1]
    load[d] = ends[d]

  return Schedule(
      rings=tuple(Ring(seqs, devices, tuple(tuple(fill[r, k]) for k in range(len(devices))),
                       cell) for r, (seqs, devices, cell) in enumerate(rings)),
      local=tuple(tuple(tuple(b) for b in batches) for batches in local),
      left=tuple(sorted(left)))

"""Hybrid Data Parallelism planner: which devices run which sequence in which micro-step.

ByteScale's HDP (arXiv 2502.21231, Sec. 4-5) pools the data- and context-parallel ranks.
Data-aware sharding: a sequence of L <= tokens_per_device tokens runs whole on one
device (several may share a device); a longer one runs on a ring of r = ceil(L /
tokens_per_device) devices (`devices_needed`; up to 2r when it shares the ring, below),
a contiguous run inside an aligned power-of-two block of `block_size(r)` < 2r devices,
so the `data = N/c, context = c` view of the same devices (c >= that block) holds it in
one row and its ring attention goes round that row (masking what is not its own).

A ring member's share of one long sequence is more than half its slots, so a ring of one
sequence leaves room only for short ones. Long sequences may therefore share a ring
(`share_groups`): each member split zigzag over all of the ring's devices, on at most
twice the devices it needs. A device serves at most one ring in a micro-step; short
sequences fill the slots left on any device, ring members included (the executor runs a
micro-step as one program over the view of its largest ring's block, and a device's
short sequences run beside its ring shares). The planner tries one ring per sequence and
shared rings and keeps the plan with the shorter lock-step time; the lower bound on
micro-steps is ceil(tokens / (num_devices * tokens_per_device)); aligned blocks
fragment, so a plan may need a step more.

DP-Balance adapted to lock-step SPMD: ByteScale evens each rank's total cost over its own
micro-batches; here all devices run each micro-step together, so a step lasts as long as
its most loaded device and the plan costs sum_m max_d cost[m, d]. The greedy is LPT-like:
rings first (widest, then heaviest), then short sequences heaviest first; each goes
where it raises that sum the least; ties go, for a ring, to the step whose maximum is
closest above its cost (best fit), for a short sequence to the emptiest cell, then to the
earliest step. Heavy work thus fills a step side by side and light work fills the gaps
under each step's maximum, evening every device's cost within the step. The plan uses the
fewest micro-steps, from the token lower bound up, in which this greedy places everything.

Example:
  steps = plan([9000, 300, 5000, 120], num_devices=4, tokens_per_device=4096)
  # [[(0, (0, 1, 2, 3)), (1, (0,)), (2, (0, 1, 2, 3)), (3, (1,))]]
  # (9000 and 5000 share a ring of 4; 300 and 120 sit beside their shares)
  summary(steps, [9000, 300, 5000, 120], num_devices=4, tokens_per_device=4096).imbalance
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxsys.parallel import cost

Plan = list[list[tuple[int, tuple[int, ...]]]]


def devices_needed(length: int, tokens_per_device: int) -> int:
  """Devices a sequence is split over: ceil(length / tokens_per_device)."""
  return max(1, -(-int(length) // tokens_per_device))


def block_size(devices: int) -> int:
  """The aligned power-of-two block (the view's context size) a run of `devices` lies in."""
  return 1 << max(int(devices) - 1, 0).bit_length()


def ring_size(length: int, tokens_per_device: int) -> int:
  """The context size a static data x context mesh needs for the sequence: the power of
  two >= devices_needed (so a `data = N/c, context = c` mesh can form it)."""
  return block_size(devices_needed(length, tokens_per_device))


def pack_rows(lengths, row_tokens: int) -> list[list[int]]:
  """First-fit decreasing: sequence indices per row of at most `row_tokens` tokens."""
  lengths = np.asarray(lengths, np.int64)
  if lengths.size and lengths.max() > row_tokens:
    raise ValueError(f"a sequence of {int(lengths.max())} tokens does not fit a row of "
                     f"{row_tokens}; size the static ring for the longest sequence")
  order = sorted(range(lengths.size), key=lambda i: (-lengths[i], i))
  free = np.zeros(0, np.int64)
  rows: list[list[int]] = []
  for i in order:
    fits = np.flatnonzero(free >= lengths[i])
    if fits.size:
      r = int(fits[0])
    else:
      r = len(rows)
      rows.append([])
      free = np.append(free, row_tokens)
    rows[r].append(i)
    free[r] -= lengths[i]
  return rows


def _check(lengths: Sequence[int], num_devices: int, tokens_per_device: int) -> np.ndarray:
  """The lengths as int64, after one-line errors for every bad argument."""
  if not isinstance(tokens_per_device, (int, np.integer)) or tokens_per_device < 1:
    raise ValueError(f"tokens_per_device={tokens_per_device!r}: must be an int >= 1 "
                     "(the tokens one device holds in a micro-step)")
  if (not isinstance(num_devices, (int, np.integer)) or num_devices < 1
      or num_devices & (num_devices - 1)):
    raise ValueError(f"num_devices={num_devices!r}: must be a power of two (1, 2, 4, ...); "
                     "rings are aligned power-of-two groups, so every ring size c needs a "
                     "data = N/c, context = c view of the devices")
  arr = np.asarray(lengths)
  if arr.size and (arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer)):
    raise ValueError(f"lengths: must be a flat sequence of ints, got dtype {arr.dtype} "
                     f"shape {arr.shape}")
  arr = arr.astype(np.int64).reshape(-1)
  pool = num_devices * tokens_per_device
  for i, n in enumerate(arr):
    if n < 1:
      raise ValueError(f"lengths[{i}]={n}: a sequence needs at least 1 token")
    if n > pool:
      raise ValueError(
          f"document {i} has {n} tokens, more than the pool holds (num_devices * "
          f"tokens_per_device = {num_devices} * {tokens_per_device} = {pool}); lower "
          f"data.max_len to <= {pool} or set data.truncate_long=true")
  return arr


def _place(lengths, groups, rings, costs, steps, num_devices, tokens_per_device):
  """The greedy for a fixed number of micro-steps: entries, or None where it cannot fit."""
  n_dev, cap = num_devices, tokens_per_device
  cell_cost = np.zeros((steps, n_dev))
  cell_tokens = np.zeros((steps, n_dev), np.int64)
  ring_of = np.zeros((steps, n_dev), np.int64)  # 0: no ring, else the ring size served
  step_max = np.zeros(steps)
  entries: list[list[tuple[int, tuple[int, ...]]]] = [[] for _ in range(steps)]

  groups = sorted(groups, key=lambda g: (-g[1], -sum(costs[i] for i in g[0]) / g[1], g[0]))
  for members, r in groups:
    b = block_size(r)
    per_cost = sum(costs[i] for i in members) / r
    # Runs of r ring-free devices inside aligned blocks of b: run_end[m, k, j] says
    # devices [k*b + j, k*b + j + r) are free in step m.
    free = (ring_of.reshape(steps, n_dev // b, b) == 0).astype(np.int64)
    ends = np.concatenate([np.zeros((steps, n_dev // b, 1), np.int64), free.cumsum(axis=2)], 2)
    run_at = (ends[..., r:] - ends[..., :-r]) == r  # [M, N/b, b - r + 1]
    fits = run_at.any(axis=2)
    if not fits.any():
      return None
    raise_by = np.broadcast_to(np.maximum(0.0, per_cost - step_max)[:, None], fits.shape)
    best = np.min(np.where(fits, raise_by, np.inf))
    cand = fits & (raise_by <= best * (1 + 1e-12) + 1e-9)
    # Ties: the step whose maximum is closest above (best fit), then the fullest block
    # (whole blocks stay free for wide rings), then the earliest.
    ms, ks = np.nonzero(cand)
    pick = np.lexsort((ks, ms, free.sum(axis=2)[ms, ks], step_max[ms]))[0]
    m, k = ms[pick], ks[pick]
    # The last run in the block, so the block's first devices stay free together.
    start = k * b + int(np.flatnonzero(run_at[m, k])[-1])
    devs = tuple(range(start, start + r))
    cell_cost[m, list(devs)] = per_cost
    cell_tokens[m, list(devs)] = int(np.sum(-(-lengths[list(members)] // r)))
    ring_of[m, list(devs)] = r
    step_max[m] = max(step_max[m], per_cost)
    entries[m] += [(i, devs) for i in members]

  short_ids = [i for i in range(len(lengths)) if rings[i] == 1]
  short_ids.sort(key=lambda i: (-costs[i], i))
  for i in short_ids:
    fits = cell_tokens + lengths[i] <= cap
    if not fits.any():
      return None
    new_cost = cell_cost + costs[i]
    raise_by = np.maximum(0.0, new_cost - step_max[:, None])
    # Least raise of sum_m max_d; ties: the emptiest cell (evens the step), the earliest.
    best = np.min(np.where(fits, raise_by, np.inf))
    cand = fits & (raise_by <= best * (1 + 1e-12) + 1e-9)
    flat = np.argmin(np.where(cand, new_cost, np.inf))
    m, d = np.unravel_index(flat, cand.shape)
    cell_cost[m, d] = new_cost[m, d]
    cell_tokens[m, d] += lengths[i]
    step_max[m] = max(step_max[m], cell_cost[m, d])
    entries[m].append((i, (int(d),)))
  return entries


def share_groups(lengths, tokens_per_device: int, num_devices: int
                 ) -> list[tuple[tuple[int, ...], int]]:
  """Long sequences (more than tokens_per_device) in groups that share a ring:
  [(member indices, devices g)], every member split zigzag over the same g devices.

  First-fit decreasing by length: a sequence joins the group whose ring grows least for
  it, if that saves devices against a ring of its own and every member stays on at most
  twice the devices it needs; else it opens its own ring of devices_needed devices. A
  ring member's share is more than half its slots, so a ring of one long sequence leaves
  room only for short ones; packed together, long sequences fill their devices.
  """
  lengths = np.asarray(lengths, np.int64)
  need = {i: devices_needed(int(n), tokens_per_device) for i, n in enumerate(lengths)}
  long = sorted((i for i in need if need[i] > 1), key=lambda i: (-lengths[i], i))
  members: list[list[int]] = []
  # Per group: its devices, the fewest devices a member needs, its tokens, and the most
  # tokens a device holds of it (its share) on its devices.
  g, least, tokens, share = (np.zeros(len(long), np.int64) for _ in range(4))
  share_on = lambda k, c, n: int(np.sum(-(-lengths[members[k]] // c))) + -(-n // c)
  for i in long:
    n, k = int(lengths[i]), len(members)
    top = np.minimum(2 * np.minimum(least[:k], need[i]), num_devices)
    # Grown to fit it (shares only fall as the ring grows): no group can need fewer devices
    # than its tokens over tokens_per_device.
    floor = np.maximum(g[:k], -(-(tokens[:k] + n) // tokens_per_device))
    zero = (share[:k] + -(-n // np.maximum(g[:k], 1)) <= tokens_per_device) & (g[:k] <= top)
    best = None
    if zero.any():
      best = (0, int(np.argmax(zero)), None)
    else:
      for j in np.lexsort((np.arange(k), floor - g[:k])):
        j, lower = int(j), int(floor[j] - g[j])
        if best is not None and (lower, j) > best[:2]:
          break
        if lower >= need[i] or floor[j] > top[j]:
          continue
        grown = int(floor[j])
        while grown <= top[j] and share_on(j, grown, n) > tokens_per_device:
          grown += 1
        if grown <= top[j] and grown - g[j] < need[i] and (best is None or
                                                          (grown - g[j], j) < best[:2]):
          best = (int(grown - g[j]), j, grown)
    if best is None:
      members.append([i])
      g[k], least[k], tokens[k], share[k] = need[i], need[i], n, -(-n // need[i])
    else:
      _, j, grown = best
      grown = g[j] if grown is None else grown
      members[j].append(i)
      g[j], least[j], tokens[j] = grown, min(least[j], need[i]), tokens[j] + n
      share[j] = share_on(j, grown, 0)
  return [(tuple(m), int(g[k])) for k, m in enumerate(members)]


def min_steps(lengths: Sequence[int], *, num_devices: int, tokens_per_device: int) -> int:
  """The token lower bound on micro-steps: all tokens over one micro-step's slots."""
  arr = _check(lengths, num_devices, tokens_per_device)
  return -(-int(arr.sum()) // (num_devices * tokens_per_device))


def plan(lengths: Sequence[int], *, num_devices: int, tokens_per_device: int,
         d_model: int = cost.DEFAULT_D_MODEL) -> Plan:
  """Micro-steps of (sequence index, device ids) entries; see the module docstring."""
  arr = _check(lengths, num_devices, tokens_per_device)
  if not arr.size:
    return []
  rings = np.array([devices_needed(n, tokens_per_device) for n in arr], np.int64)
  costs = cost.sequence_cost(arr, d_model=d_model)
  # Two ways to ring the long sequences: one ring each, or rings shared (fewer slots
  # left empty, heavier rings); the plan with the shorter lock-step time wins.
  alone = [((i,), int(r)) for i, r in enumerate(rings) if r > 1]
  shared = share_groups(arr, tokens_per_device, num_devices)
  step_cost = float(cost.flop_model(d_model).linear(tokens_per_device))  # a full cell's matmuls
  plans = [_fewest_steps(arr, groups, rings, costs, num_devices, tokens_per_device)
           for groups in ([alone, shared] if len(shared) < len(alone) else [alone])]
  entries = min(plans, key=lambda e: _lock_step_time(e, arr, costs, num_devices, step_cost))
  # Drop steps the greedy left empty, then order each step's entries by device.
  return [sorted(step, key=lambda e: (e[1][0], e[0])) for step in entries if step]


def _fewest_steps(lengths, groups, rings, costs, num_devices, tokens_per_device):
  """The greedy's entries for the fewest micro-steps, from the token bound up, it fits."""
  steps = min_steps(lengths, num_devices=num_devices, tokens_per_device=tokens_per_device)
  while True:  # terminates: with one step per sequence everything fits
    entries = _place(lengths, groups, rings, costs, steps, num_devices, tokens_per_device)
    if entries is not None:
      return entries
    steps += 1


def _lock_step_time(entries, lengths, costs, num_devices: int, step_cost: float) -> float:
  """sum over micro-steps of the most loaded device's cost; a micro-step's fixed shapes
  also run every device's whole cell through the matmuls (`step_cost`, padding too)."""
  total = 0.0
  for step in entries:
    if step:
      load = np.zeros(num_devices)
      for i, devs in step:
        load[list(devs)] += costs[i] / len(devs)
      total += load.max() + step_cost
  return total


@dataclasses.dataclass(frozen=True)
class Summary:
  """A plan's load, per micro-step and device.

  tokens, cost [steps, devices]: tokens held and forward FLOPs per layer (cost.sequence_cost).
  step_imbalance [steps]: most loaded device's cost over the mean, per micro-step.
  imbalance: sum_m max_d cost / sum_m mean_d cost, lock-step time over perfect balance.
  utilisation: real tokens / (steps * devices * tokens_per_device), no padding counted.
  """
  tokens: np.ndarray
  cost: np.ndarray
  step_imbalance: np.ndarray
  imbalance: float
  utilisation: float


# Rounds of later documents `fit_documents` tries after the first run.
EXTRA_ROUNDS = 3


def fit_documents(lengths: Sequence[int], *, budget: int, capacity: int,
                  plan: Callable[[list[int]], Any], micro_batches: Callable[[Any], int]
                  ) -> tuple[list[int], Any]:
  """(kept indices, their plan): which of the offered documents one step takes, in a few
  plans (about (1 + EXTRA_ROUNDS) log2 of the documents), not one per document.

  The longest run of documents from the first whose plan fits into `budget` micro-batches
  (`micro_batches(plan(lengths))` on the busiest device), found by binary search below
  the longest run whose tokens fit the pool's `capacity` (no plan holds more); the first
  document is always kept. Then, the same way, the longest run of the later documents
  (in order, within the tokens left) that still fits, in up to EXTRA_ROUNDS rounds, each
  past the document the round before stopped at: the one-plan-per-document greedy's
  choices, mostly (on the stdlib and long-tailed lengths, 8 and 64 slots: within 0.2 to
  6 points of its capacity filled; experiments/bench_hdp_planner.py). `plan(lengths)`
  plans the given lengths.
  """
  lengths = [int(n) for n in lengths]
  fits = lambda trial: micro_batches(trial) <= budget
  whole = plan(lengths)
  if not lengths or fits(whole):
    return list(range(len(lengths))), whole

  def longest(kept: list[int], candidates: list[int], best):
    """kept + the longest run of `candidates` that still fits (binary search), its plan."""
    lo, hi, plans = 0, len(candidates), {0: best}
    while lo < hi:
      mid = (lo + hi + 1) // 2
      plans[mid] = plan([lengths[i] for i in kept + candidates[:mid]])
      lo, hi = (mid, hi) if fits(plans[mid]) else (lo, mid - 1)
    return kept + candidates[:lo], plans[lo]

  within = int(np.searchsorted(np.cumsum(lengths), capacity, side="right"))
  kept, best = longest([0], list(range(1, min(max(1, within), len(lengths) - 1))),
                       plan(lengths[:1]))
  # Each round skips the document that did not fit and tries the rest.
  left = list(range(kept[-1] + 2, len(lengths)))
  for _ in range(EXTRA_ROUNDS):
    room, later = capacity - sum(lengths[i] for i in kept), []
    for i in left:
      if lengths[i] <= room:
        later.append(i)
        room -= lengths[i]
    if not later:
      break
    before = len(kept)
    kept, best = longest(kept, later, best)
    left = later[len(kept) - before + 1:]
  return kept, best


def summary(steps: Plan, lengths: Sequence[int], *, num_devices: int, tokens_per_device: int,
            d_model: int = cost.DEFAULT_D_MODEL) -> Summary:
  """Per-device tokens and cost of a plan (any plan of this format, e.g. a baseline's)."""
  arr = _check(lengths, num_devices, tokens_per_device)
  tokens = np.zeros((len(steps), num_devices), np.int64)
  work = np.zeros((len(steps), num_devices))
  for m, step in enumerate(steps):
    for i, devs in step:
      c = len(devs)
      tokens[m, list(devs)] += -(-int(arr[i]) // c)
      work[m, list(devs)] += cost.sequence_cost(int(arr[i]), d_model=d_model) / c
  mean = work.mean(axis=1) if len(steps) else np.zeros(0)
  step_imb = np.divide(work.max(axis=1, initial=0.0), mean, out=np.ones_like(mean),
                       where=mean > 0)
  total_mean = mean.sum()
  imbalance = float(work.max(axis=1, initial=0.0).sum() / total_mean) if total_mean else 1.0
  slots = len(steps) * num_devices * tokens_per_device
  util = float(arr.sum() / slots) if slots else 1.0
  return Summary(tokens, work, step_imb, imbalance, util)

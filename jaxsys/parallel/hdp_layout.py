"""One HDP micro-step as one batch: the plan's cells laid out over a `data x context` view.

A micro-step of `hdp.plan` gives each of N devices a cell of `tokens_per_device` slots:
at most one ring sequence's share, and whole short sequences. The step runs as one
program over the view `data = N/c, context = c` of the same devices, c the aligned block
of the step's largest ring: a
batch of N/c rows of c cells, device d holding cell d % c of row d // c (the order
`jax.sharding.Mesh(devices.reshape(N/c, c), ("data", "context"))` splits a
[N/c, c * tokens_per_device] array in). A sequence on r devices (a contiguous run
inside an aligned block of block_size(r) <= c, so inside one row) is cut into 2r
near-equal chunks and device i of its run holds chunks i and 2r-1-i (zigzag: even
causal work); ring attention goes round the whole row, and masks the rest.

Every token carries its document position (the causal key ring attention masks by) and
its sequence's segment id; within a cell ids increase along the cell, so the flash
kernels' min/max tile skipping works. Padding slots get loss_mask 0 and segment ids of
their own (each pads only with itself), so a ring step never computes padding x padding.

Example:
  view, batch = pack_step(steps[0], docs, num_devices=8, tokens_per_device=512)
  # batch["inputs"]: [8 // view, view * 512]
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxsys.data.packing import FIELDS
from jaxsys.parallel import hdp

# Padding tokens' segment ids start here (real sequences number from 1), one per slot.
PAD_SEGMENT = 1 << 30


def ring_shares(length: int, ring: int) -> list[np.ndarray]:
  """Token indices device i of a ring of `ring` holds: zigzag chunks i and 2r-1-i of 2r."""
  chunks = np.array_split(np.arange(length), 2 * ring)
  return [np.concatenate([chunks[i], chunks[2 * ring - 1 - i]]) for i in range(ring)]


def view_size(step: Sequence[tuple[int, tuple[int, ...]]]) -> int:
  """The context size of a micro-step's view: the aligned block of its largest ring."""
  return hdp.block_size(max((len(devices) for _, devices in step), default=1))


def pack_step(step: Sequence[tuple[int, tuple[int, ...]]], docs: Sequence[np.ndarray], *,
              num_devices: int, tokens_per_device: int, view: int | None = None
              ) -> tuple[int, dict[str, np.ndarray]]:
  """(c, batch): the micro-step's packed fields (packing.FIELDS), [N/c, c * tokens_per_device].

  docs[i] are sequence i's tokens: its inputs are docs[i][:-1], its targets docs[i][1:].
  view: c, so that every ring lies in one row of c devices (default: the aligned block
  of the step's largest ring).
  """
  c = view_size(step) if view is None else view
  if num_devices % c:
    raise ValueError(f"pack_step: view={c} does not divide num_devices={num_devices}")
  split = [devices for _, devices in step if devices[0] // c != devices[-1] // c]
  if split:
    raise ValueError(f"pack_step: view={c} splits the ring on devices {split[0]} over two "
                     f"rows; use a view of at least {view_size(step)}")
  cap = tokens_per_device
  cells = {k: np.zeros((num_devices, cap), np.float32 if k == "loss_mask" else np.int32)
           for k in FIELDS}
  cells["segment_ids"][:] = PAD_SEGMENT + np.arange(num_devices * cap).reshape(num_devices, cap)
  fill = np.zeros(num_devices, np.int64)
  # Rings first, so a cell's ids rise along it (a ring's cell holds nothing else).
  ordered = sorted(step, key=lambda e: (len(e[1]) == 1, e[1][0], e[0]))
  for seg, (i, devices) in enumerate(ordered, start=1):
    tokens = np.asarray(docs[i])
    length = tokens.size - 1
    shares = ring_shares(length, len(devices)) if len(devices) > 1 else [np.arange(length)]
    for d, idx in zip(devices, shares):
      lo, hi = fill[d], fill[d] + idx.size
      if hi > cap:
        raise ValueError(f"pack_step: device {d} would hold {hi} tokens, more than "
                         f"tokens_per_device={cap}; the plan does not fit its cells")
      cells["inputs"][d, lo:hi] = tokens[idx]
      cells["targets"][d, lo:hi] = tokens[idx + 1]
      cells["segment_ids"][d, lo:hi] = seg
      cells["positions"][d, lo:hi] = idx
      cells["loss_mask"][d, lo:hi] = 1.0
      fill[d] = hi
  return c, {k: v.reshape(num_devices // c, c * cap) for k, v in cells.items()}

r"""HDP's planning time per step: which offered documents a step takes, and its plan.

The library of `experiments/bench_hdp_planner.py`: `run` and `table` (planning),
`count_programs` and `programs_table` (programs), `relocation_seconds`.

No devices needed: the per-rank planner (`hdp_schedule.schedule`, what HDP training runs,
with its tight rings) plans for --devices slots of --tokens_per_device tokens,
--micro_steps micro-batches a step. Each step is offered what the loader offers
(`hdp_step.loader_budget`: half as many again as a step holds), drawn from the stdlib's
byte lengths and from the long-tailed lengths (`hdp_sim`), and each fit keeps what one
step takes:
  one schedule:  `hdp_schedule.fit`, training's: one schedule with a budget of
                 micro-batches per device;
  binary search: `hdp.fit_documents` (the removed lock-step executor's), a few plans;
  one plan per document: each offered document kept if the plan still fits (the planner
                 before both), timed up to --baseline_max_devices.
Prints a markdown table: plans and CPU seconds per step (median over --steps; the planner
runs on one thread, so on an idle core that is its wall time), and the share of the
step's token capacity the kept documents fill.

Then, at each of --program_devices, the programs `hdp_step.HDPStep` would run for
--batches steps of training's fit (`hdp_step.compiled_programs`), and the padding of
their buckets (cells in steps of tpd / 8, local micro-batches of tpd / 2^k slots): a ring
program compiles once per ring shape (ring size, cell) and is relocated onto every other
block of slots and cell it runs on (`relocate.Programs`); local programs compile each.

With --relocation_ring=c (on 4c devices: XLA_FLAGS=--xla_force_host_platform_device_count=8
for c=2), what a relocation costs against a compile: the tiny model's ring program of c
slots and --relocation_tpd tokens a cell, compiled for 3 blocks of slots, serialized once
and relocated from the first onto 3 others (median seconds).
"""
from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxsys import mesh as mesh_lib
from jaxsys.configs import tiny_lm
from jaxsys.data.packing import FIELDS
from jaxsys.optim.inner import make_optimizer
from jaxsys.parallel import hdp, hdp_schedule, hdp_sim, relocate
from jaxsys.train import config_check, hdp_step
from jaxsys.train import state as state_lib

def one_plan_per_document(lengths, *, budget: int, plan, micro_batches):
  """The baseline: in order, each document the plan still fits is kept (a plan each)."""
  whole = plan(list(lengths))
  if micro_batches(whole) <= budget:
    return list(range(len(lengths))), whole
  kept: list[int] = []
  for i, n in enumerate(lengths):
    trial = plan([lengths[j] for j in kept] + [n])
    if micro_batches(trial) <= budget or not kept:
      kept, whole = kept + [i], trial
  return kept, whole


def _offers(name: str, devices: int, tokens_per_device: int, micro_steps: int, steps: int):
  """`steps` offers of whole documents (lengths), as the loader would make them."""
  pool = (hdp_sim.stdlib_lengths() if name == "stdlib"
          else hdp_sim.long_tail_lengths(20000, seed=0))
  pool = np.minimum(pool, devices * tokens_per_device)  # data.max_len: the pool's tokens
  slots = devices * tokens_per_device * micro_steps
  budget = hdp_step.loader_budget(slots, int(pool.max()))
  return [hdp_sim.sample_batch(pool, budget, seed).tolist() for seed in range(steps)]


def measure(*, devices: int, tokens_per_device: int, micro_steps: int, steps: int,
            distribution: str, baseline: bool) -> dict:
  """Median plans and seconds per step, and the capacity filled, of the planner (and the
  baseline when asked)."""
  calls = []

  schedule = hdp_schedule.schedule

  def counted(*args, **kwargs):
    calls.append(1)
    return schedule(*args, **kwargs)
  plan = lambda lengths: counted(lengths, num_devices=devices,
                                 tokens_per_device=tokens_per_device, widen=False)
  micro_batches = lambda sched: int(sched.micro_batches().max(initial=0))
  capacity = micro_steps * devices * tokens_per_device

  def one_schedule(lengths):
    hdp_schedule.schedule = counted  # hdp_schedule.fit's one call, counted
    try:
      return hdp_schedule.fit(lengths, budget=micro_steps, num_devices=devices,
                              tokens_per_device=tokens_per_device, widen=False)
    finally:
      hdp_schedule.schedule = schedule
  fits = {"one schedule": one_schedule, "binary search": lambda lengths: hdp.fit_documents(
      lengths, budget=micro_steps, capacity=capacity, plan=plan, micro_batches=micro_batches)}
  if baseline:
    fits["one plan per document"] = lambda lengths: one_plan_per_document(
        lengths, budget=micro_steps, plan=plan, micro_batches=micro_batches)
  offers = _offers(distribution, devices, tokens_per_device, micro_steps, steps)
  out = {}
  for name, fit in fits.items():
    plans, seconds, filled = [], [], []
    for lengths in offers:
      calls.clear()
      start = time.process_time()
      kept, _ = fit(lengths)
      seconds.append(time.process_time() - start)
      plans.append(len(calls))
      filled.append(sum(lengths[i] for i in kept) / capacity)
    out[name] = dict(offered=statistics.median(map(len, offers)),
                     plans=statistics.median(plans), seconds=statistics.median(seconds),
                     filled=statistics.median(filled))
  return out


def run(*, devices, tokens_per_device: int, micro_steps: int, steps: int,
        baseline_max_devices: int) -> list[dict]:
  rows = []
  for distribution in ("stdlib", "long_tail"):
    for n in devices:
      result = measure(devices=n, tokens_per_device=tokens_per_device, micro_steps=micro_steps,
                       steps=steps, distribution=distribution,
                       baseline=n <= baseline_max_devices)
      rows += [dict(distribution=distribution, devices=n, fit=name, **r)
               for name, r in result.items()]
  return rows


def count_programs(*, devices: int, tokens_per_device: int, micro_steps: int, batches: int,
                   distribution: str) -> dict:
  """Distinct programs over `batches` steps of training's fit, and their buckets' padding:
  the share of ring and of local slots that hold no token."""
  found = {"ring": set(), "ring shape": set(), "local": set()}
  slots = {"ring": 0, "local": 0}
  tokens = dict(slots)
  for lengths in _offers(distribution, devices, tokens_per_device, micro_steps, batches):
    kept, sched = hdp_schedule.fit(lengths, budget=micro_steps, num_devices=devices,
                                   tokens_per_device=tokens_per_device, widen=False)
    lengths = np.array([lengths[i] for i in kept])
    for kind, keys in hdp_step.compiled_programs(sched, lengths, tokens_per_device).items():
      found[kind] |= keys
    ring_slots = sum(len(r.devices) * r.cell for r in sched.rings)
    ring_tokens = sum(int(lengths[list(r.seqs + sum(r.fill, ()))].sum()) for r in sched.rings)
    slots["ring"] += ring_slots
    tokens["ring"] += ring_tokens
    slots["local"] += sched.slots(lengths, tokens_per_device) - ring_slots
    tokens["local"] += int(lengths.sum()) - ring_tokens
  return dict(distribution=distribution, devices=devices, batches=batches,
              **{f"{kind} programs": len(keys) for kind, keys in found.items()},
              **{f"{kind} padding": 1 - tokens[kind] / max(1, slots[kind]) for kind in slots})


def programs_table(rows) -> str:
  lines = ["| lengths | devices | steps | compiled ring programs (size, cell) | ring blocks "
           "(block, cell) | relocations | local programs | ring slots empty | local slots "
           "empty |", "|---" * 9 + "|"]
  lines += [f"| {r['distribution']} | {r['devices']} | {r['batches']} | "
            f"{r['ring shape programs']} | {r['ring programs']} | "
            f"{r['ring programs'] - r['ring shape programs']} | {r['local programs']} | "
            f"{r['ring padding']:.1%} | {r['local padding']:.1%} |" for r in rows]
  return "\n".join(lines)


def relocation_seconds(*, ring: int, tokens_per_device: int, repeats: int = 3) -> dict:
  """Median seconds to compile the tiny model's ring program of `ring` slots for a block
  (`repeats` blocks), to serialize the first block's once, and to relocate it onto another
  (`repeats` others), on (repeats + 1) * ring devices; `fresh`: no compile came from jax's
  persistent cache."""
  run = config_check.parse(tiny_lm.get_config("size=tiny"))
  n = (repeats + 1) * ring
  mesh = mesh_lib.make_mesh(f"data={n}", jax.devices()[:n])
  optimizer = make_optimizer(run.optimizer, run.total_steps)
  abstract = state_lib.abstract_train_state(run.model, optimizer, 0)
  state_sh = state_lib.state_shardings(abstract, run.model, optimizer, mesh)
  executor = hdp_step.make_step(run.model, optimizer, mesh, state_sh, tokens_per_device)
  acc = jax.eval_shape(lambda p: (jnp.zeros(()), jnp.zeros(()), p), abstract.params)
  batch = {f: jax.ShapeDtypeStruct((1, ring * tokens_per_device),
                                   jnp.float32 if f == "loss_mask" else jnp.int32)
           for f in FIELDS}
  args = (acc[2], batch, acc)
  rings = [executor.program(tuple(range(b * ring, (b + 1) * ring)))
           for b in range(repeats + 1)]  # (jitted, batch sharding over its view, ...)
  compiled, compiles, fresh = [], [], True
  for fn, *_ in rings[:repeats]:
    start = time.perf_counter()
    one, new = relocate.compile_fresh(fn, args)
    compiles.append(time.perf_counter() - start)
    compiled.append(one)
    fresh &= new
  start = time.perf_counter()
  source = relocate.Source(compiled[0], rings[0][1].mesh, args)  # serialized once a shape
  serialize = time.perf_counter() - start
  relocations = []
  for _, batch_sh, *_ in rings[1:]:
    start = time.perf_counter()
    source.onto(batch_sh.mesh)
    relocations.append(time.perf_counter() - start)
  return dict(ring=ring, tokens_per_device=tokens_per_device, fresh=fresh,
              compile_s=statistics.median(compiles), serialize_s=serialize,
              relocate_s=statistics.median(relocations))


def table(rows) -> str:
  lines = ["| lengths | devices | fit | documents offered | plans per step | CPU s per step | "
           "capacity filled |", "|---|---|---|---|---|---|---|"]
  lines += [f"| {r['distribution']} | {r['devices']} | {r['fit']} | {r['offered']:.0f} | "
            f"{r['plans']:.0f} | {r['seconds']:.3f} | {r['filled']:.1%} |" for r in rows]
  return "\n".join(lines)

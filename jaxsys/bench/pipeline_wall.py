r"""A pipelined step's wall time against the time its schedule predicts, one core a stage.

The library of `experiments/bench_pipeline_wall.py`: `launch` starts the binary's workers,
`rows` measures in each and `table` prints the result. It runs `stage=p` (p = --stages,
default 2) as p processes joined by `jax.distributed` on loopback, one CPU device each,
each pinned to a core of its own (`taskset`): a step's wall time is then its critical
path, stages waiting on each other through real cross-process collectives, not the sum of
all stages' work (bench_pipeline's CPU table, whose simulated devices share the cores).

1. Costs, measured in each process on its own core (wall time, median of --repeats after a
   warm-up; every process's recorded, the slowest's used): the executor's own chunk programs
   (`pipeline.chunk.Chunk`: forward F, backward B, and the zero-bubble split into B_in and W) on
   one microbatch, and a send to the next stage (one `ppermute` of a microbatch's
   activation, timed as the per-iteration cost of a loop of them, so dispatch is not in it);
   and, as a check, that send where it follows a forward as in the step (the link idle
   while the core computes): a loop of (forward, send) less a loop of forwards; and a send
   of a chunk's weights.
2. Predicted: `schedules.timed` of each schedule under those costs, in the ticks the
   executor runs (`Schedule.executed`), lock step (every tick as long as its slowest stage,
   then its sends) and asynchronous (Megatron-style, for reference), plus the step's
   weight moves: a schedule whose chunks sit off the layout's loop (ZBV's V) gets those
   chunks' weights across the stage axis before the ticks and sends their gradients back
   after them (`executor.rows_moved`), each a send of a chunk's weights.
3. Measured: the wall time of one jitted `pipeline_loss_and_grads` step (median of
   --repeats after a warm-up). measured - predicted, over the ticks, is what a tick costs
   beyond its actions and sends: the executor's own per-tick work (the embedding and head
   phases, the switch, slot reads and writes) and whatever the prediction misses.
4. The tick's own work, measured: the same step with no layers in its chunks (every action
   then costs next to nothing; the sends, embedding, head, slot writes and switch stay),
   less the sends the lock step counts. "With it" adds it to the lock-step prediction.
5. Steal: the share of the worker's core the hypervisor took during the measured step
   (/proc/stat), load on a VM that the load average does not show.

A small vocabulary (--vocab_size) keeps the head and embedding out of the comparison; the
schedule's costs have no term for them. The host needs p cores with nothing else on them.

`--bandwidth=100mbit` (root; iproute2) runs the workers in a network namespace whose
loopback Linux traffic control holds to that rate (`jaxsys.lab.link`, as the network lab
does): the sends cross a link of that speed, the measured send cost is that link's, and
the prediction is tested across it. `none` (the default) is the host's own loopback.
"""
from __future__ import annotations

import dataclasses
import os
import subprocess

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxsys.bench import log, median_seconds
from jaxsys import mesh as mesh_lib
from jaxsys import xla_flags
from jaxsys.data import packing
from jaxsys.lab import link as link_lib
from jaxsys.lab.launch import free_port
from jaxsys.models import transformer
from jaxsys.parallel import pipeline, schedules

VIRTUAL = {"interleaved_1f1b": 2, "zbv": 2}  # virtual stages each schedule runs with here


def _core_times() -> np.ndarray:
  """(steal, all) jiffies of the cores this process may run on, from /proc/stat: on a VM
  the hypervisor's steal is load that `uptime` does not show."""
  cores = {f"cpu{c}" for c in os.sched_getaffinity(0)}
  with open("/proc/stat") as stat:
    rows = [line.split() for line in stat if line.split()[0] in cores]
  return np.sum([[int(r[8]), sum(int(x) for x in r[1:9])] for r in rows], axis=0)


def _batch(rows: int, seq: int, vocab_size: int, seed: int = 0):
  return packing.random_packed_batch(rows, seq, docs_per_row=2, vocab_size=vocab_size, seed=seed)


def _placed(tree, mesh, specs=None):
  """Host arrays as global arrays on `mesh` (`specs`: their PartitionSpecs, default
  replicated), each process filling its own devices: works in one process or many."""
  specs = jax.tree.map(lambda _: P(), tree) if specs is None else specs
  return jax.tree.map(lambda x, spec: jax.make_array_from_callback(
      x.shape, NamedSharding(mesh, spec), lambda idx, x=np.asarray(x): x[idx]), tree, specs)


def measure_costs(cfg: transformer.TransformerConfig, layers_per_chunk: int, seq: int, *,
                  mesh, repeats: int) -> dict[str, float]:
  """Wall seconds of one microbatch (one row of `seq` tokens) through a chunk of
  `layers_per_chunk` layers on this process's first device: forward, backward, B_in, W
  (the executor's own programs); and of one send of its activation to the next stage
  (`comm`, every process of `mesh` taking part)."""
  device = jax.local_devices()[0]
  cfg = dataclasses.replace(cfg, n_layers=layers_per_chunk)
  params = jax.device_put(transformer.init_params(cfg, jax.random.key(0))["layers"], device)
  mb = jax.device_put(_batch(1, seq, cfg.vocab_size), device)
  _, attention_fn = transformer.default_inputs(cfg, mb["inputs"], None, None)
  chunk = pipeline.chunk.Chunk(cfg, attention_fn)
  x = jax.device_put(jax.random.normal(jax.random.key(1), (1, seq, cfg.d_model), cfg.dtype),
                     device)
  forward = jax.jit(chunk.forward)
  y, res = forward(params, x, mb)
  _, _, stash = jax.jit(chunk.backward_input)(params, res, y, mb)
  out = {"forward": median_seconds(forward, params, x, mb, repeats=repeats)}
  for name, args in (("backward", (params, res, y, mb)),
                     ("backward_input", (params, res, y, mb)),
                     ("backward_weight", (params, res, y, stash, mb))):
    out[name] = median_seconds(jax.jit(getattr(chunk, name)), *args, repeats=repeats)
  out["comm"] = _send_seconds(mesh, jax.ShapeDtypeStruct(x.shape, x.dtype), repeats=repeats)
  # A chunk's weights (or gradients) crossing the stage axis: a V's moves (rows_moved).
  out["comm_weights"] = _send_seconds(
      mesh, jax.tree.map(lambda a: jax.ShapeDtypeStruct((1, *a.shape), a.dtype), params),
      repeats=repeats, sends=2)
  out["comm_beside_compute"] = _send_beside_compute_seconds(
      mesh, chunk, params, x, mb, repeats=repeats)
  return out


def _to_next_stage(x, stages: int):
  """x sent on to stage s + 1 (the last stage's to the first), as the executor's ring."""
  return jax.lax.ppermute(x, pipeline.AXIS, [(i, (i + 1) % stages) for i in range(stages)])


def _send_seconds(mesh, shapes, *, repeats: int, sends: int = 64) -> float:
  """Seconds of one ppermute of arrays of `shapes` (a pytree of ShapeDtypeStructs, each
  device's) to the next stage: a loop of `sends` of them, timed whole, over `sends`."""
  p = dict(mesh.shape)[pipeline.AXIS]

  def loop(x):
    def body(x, _):
      return _to_next_stage(x, p), None
    return jax.lax.scan(body, x, None, length=sends)[0]
  fn = jax.jit(jax.shard_map(loop, mesh=mesh, in_specs=P(pipeline.AXIS),
                             out_specs=P(pipeline.AXIS)))
  x = _placed(jax.tree.map(lambda s: np.zeros((p * s.shape[0], *s.shape[1:]), s.dtype), shapes),
              mesh, jax.tree.map(lambda _: P(pipeline.AXIS), shapes))
  return median_seconds(fn, x, repeats=repeats) / sends


def _send_beside_compute_seconds(mesh, chunk, params, x, mb, *, repeats: int,
                                 sends: int = 8) -> float:
  """Seconds a send adds when it follows a chunk's forward, as the step's sends do: a loop
  of `sends` (forward, then ppermute of its output to the next stage), less the same loop
  without the ppermute, over `sends`. The link idles while the core computes."""
  p = dict(mesh.shape)[pipeline.AXIS]
  host = lambda t: jax.tree.map(np.asarray, t)
  params, mb = _placed(host(params), mesh), _placed(host(mb), mesh)

  def loop(send: bool):
    def run(params, x, mb):
      def body(x, _):
        y = chunk.forward(params, x, mb)[0]
        if send:
          y = _to_next_stage(y, p)
        return y, None
      return jax.lax.scan(body, x, None, length=sends)[0]
    return jax.jit(jax.shard_map(run, mesh=mesh, in_specs=(P(), P(pipeline.AXIS), P()),
                                 out_specs=P(pipeline.AXIS)))
  xs = _placed(np.tile(np.asarray(x), (p, 1, 1)), mesh, P(pipeline.AXIS))
  with_send = median_seconds(loop(True), params, xs, mb, repeats=repeats)
  alone = median_seconds(loop(False), params, xs, mb, repeats=repeats)
  return max(with_send - alone, 0.0) / sends


def _step_seconds(cfg, params, schedule, batch, mesh, *, repeats: int) -> float:
  """Wall seconds of one `pipeline_loss_and_grads` step of the first cfg.n_layers layers of
  `params` (0: a step of the ticks alone)."""
  layout = pipeline.Layout(stages=schedule.stages, virtual=schedule.virtual_stages,
                           vocab_size=cfg.vocab_size, vocab_parallel=False)
  params = dict(params, layers=jax.tree.map(lambda x: x[:cfg.n_layers], params["layers"]))
  staged = pipeline.to_stages(layout, params)
  staged = _placed(staged, mesh, pipeline.layout.param_specs(layout, staged))
  step = jax.jit(lambda p, b: pipeline.pipeline_loss_and_grads(cfg, schedule, layout, p, b,
                                                               mesh=mesh))
  return median_seconds(step, staged, batch, repeats=repeats)


def _every_process(costs: dict[str, float]) -> dict[str, list[float]]:
  """Each cost as every process measured it on its own core, in process order."""
  names = sorted(costs)
  table = multihost_utils.process_allgather(np.array([costs[k] for k in names]))
  return {k: [float(x) for x in np.asarray(table).reshape(-1, len(names))[:, i]]
          for i, k in enumerate(names)}


def rows(names, stages: int, microbatches, *, d_model: int, n_layers: int, seq: int,
         vocab_size: int, repeats: int) -> dict:
  """Every schedule's predicted and measured step time at `stages` and each m, on a
  stage mesh over the first `stages` devices (in the launcher's workers: all of them)."""
  cfg = transformer.TransformerConfig(vocab_size=vocab_size, d_model=d_model, n_layers=n_layers,
                                      n_heads=4, n_kv_heads=2, d_ff=4 * d_model,
                                      attention_impl="xla")
  mesh = mesh_lib.make_mesh(f"stage={stages}", jax.devices()[:stages])
  params = transformer.init_params(cfg, jax.random.key(0))
  costs_by_chunk, out = {}, []
  for m in microbatches:
    batch = _placed(_batch(m, seq, vocab_size, seed=m), mesh)
    for name in names:
      v = VIRTUAL.get(name, 1)
      if m < schedules.min_microbatches(name, stages) or (v > 1 and m % stages):
        continue
      per_chunk = n_layers // (stages * v)
      if per_chunk not in costs_by_chunk:
        costs_by_chunk[per_chunk] = _every_process(
            measure_costs(cfg, per_chunk, seq, mesh=mesh, repeats=repeats))
      # Lock step waits for the slowest stage: each cost as the slowest process measured it.
      c = {k: max(v) for k, v in costs_by_chunk[per_chunk].items()}
      # Costs are of a whole stage's layers: a chunk of 1/v of them costs 1/v.
      costs = schedules.Costs(forward=v * c["forward"], backward=v * c["backward"],
                              comm=c["comm"], backward_input=v * c["backward_input"],
                              backward_weight=v * c["backward_weight"])
      schedule = pipeline.make_schedule(name, stages=stages, microbatches=m, virtual_stages=v)
      timing = schedules.timed(schedule, costs)
      # A V's chunks off the layout's loop: their weights cross the link before the ticks
      # and their gradients after them, one chunk's each way a step (measured sends).
      moves = 2 * pipeline.executor.rows_moved(schedule) * c["comm_weights"]
      predicted = timing.lockstep + moves
      step = lambda n: _step_seconds(dataclasses.replace(cfg, n_layers=n), params, schedule,
                                     batch, mesh, repeats=repeats)
      before = _core_times()
      measured = step(n_layers)
      steal, total = _core_times() - before
      # The tick's own work, measured: the same step with no layers in its chunks (its
      # actions cost ~nothing; the sends, embedding, head, slot writes and switch stay),
      # less the sends the lock step already counts.
      empty = step(0)
      ns = 1e-9  # the actions at a nanosecond each (Costs takes no zero): the sends alone
      sends = schedules.timed(schedule, dataclasses.replace(
          costs, forward=ns, backward=ns, backward_input=ns, backward_weight=ns)).lockstep
      calibrated = predicted + empty - sends
      ticks = schedule.executed.ticks
      out.append(dict(schedule=name, virtual=v, microbatches=m, ticks=ticks,
                      shape="fused" if schedule.executed is schedule.fused else "table",
                      predicted_lockstep=predicted, weight_moves=moves,
                      predicted_async=timing.asynchronous + moves,
                      measured=measured, ratio=measured / predicted,
                      per_tick_extra=(measured - predicted) / ticks,
                      lockstep_bubble=timing.lockstep_bubble, measured_empty=empty,
                      tick_work=(empty - sends) / ticks, predicted_calibrated=calibrated,
                      ratio_calibrated=measured / calibrated,
                      steal=float(steal / max(total, 1))))
      log(f"{name} m={m}: predicted {predicted * 1e3:.1f} ms (with the tick's work "
           f"{calibrated * 1e3:.1f}), measured {measured * 1e3:.1f} ms")
  return {"stages": stages, "processes": jax.process_count(), "d_model": d_model,
          "n_layers": n_layers, "seq": seq, "vocab_size": vocab_size, "repeats": repeats,
          "costs": {str(k): v for k, v in costs_by_chunk.items()}, "rows": out}


def table(result: dict) -> str:
  lines = ["| schedule | m | ticks | weight moves (ms) | predicted lock step (ms) "
           "| measured (ms) | measured / predicted | extra a tick (ms) | tick's work (ms) "
           "| with it: predicted (ms) | measured / predicted | predicted async (ms) "
           "| steal |",
           "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for r in result["rows"]:
    lines.append(f"| {r['schedule']} | {r['microbatches']} | {r['shape']} {r['ticks']} | "
                 f"{r['weight_moves'] * 1e3:.1f} | {r['predicted_lockstep'] * 1e3:.1f} | "
                 f"{r['measured'] * 1e3:.1f} | "
                 f"{r['ratio']:.3f} | {r['per_tick_extra'] * 1e3:.2f} | "
                 f"{r['tick_work'] * 1e3:.2f} | {r['predicted_calibrated'] * 1e3:.1f} | "
                 f"{r['ratio_calibrated']:.3f} | {r['predicted_async'] * 1e3:.1f} | "
                 f"{r['steal']:.1%} |")
  ms = lambda xs: "/".join(f"{x * 1e3:.2f}" for x in xs)
  costs = "; ".join(f"{k} layers a chunk: " + ", ".join(f"{n} {ms(v)}" for n, v in c.items())
                    for k, c in result["costs"].items())
  return ("\n".join(lines) + f"\n\nCosts per microbatch, ms, as each process measured them "
          f"(the slowest is the prediction's): {costs}")


def launch(stages: int, worker: list[str], *, rate_bps: float | None = None,
           timeout: float = 3600) -> None:
  """Starts `stages` workers, each the command line `worker` (the binary and its flags) with
  its --process_id and --coordinator added, with one CPU device, pinned to core i, joined on
  loopback (shaped to `rate_bps` in a network namespace of their own when given); returns
  once all have exited 0. ValueError: fewer cores than stages."""
  cores = sorted(os.sched_getaffinity(0))
  if len(cores) < stages:
    raise ValueError(f"--stages={stages} needs {stages} cores, one a stage; this process "
                     f"may run on {len(cores)} ({cores})")
  link = link_lib.Link(f"jaxsys-pw{os.getpid()}", rate_bps).up() if rate_bps else None
  prefix = link.prefix() if link else []
  # A free port of the namespace's loopback: a fresh namespace has every port free.
  coordinator = f"127.0.0.1:{free_port() if link is None else 4321}"
  env = dict(os.environ, XLA_FLAGS=xla_flags.with_cpu_devices(1), JAX_PLATFORMS="cpu")
  try:
    procs = [subprocess.Popen(
        [*prefix, "taskset", "-c", str(cores[i]), *worker, f"--process_id={i}",
         f"--coordinator={coordinator}"], env=env) for i in range(stages)]
    codes = [p.wait(timeout=timeout) for p in procs]
  finally:
    if link:
      link.down()
  if any(codes):
    raise RuntimeError(f"bench_pipeline_wall workers exited with {codes}")

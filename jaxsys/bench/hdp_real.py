"""The real HDP run for experiments/bench_hdp.py --part=real: two layouts, one executor.

One global batch of whole stdlib documents (jaxsys.data.documents, truncated to max_len)
trains one step four ways on the same devices, at equal tokens:

  hdp_per_rank:       `hdp_schedule.schedule` run by `hdp_step.HDPStep` (training's
                      default): each device its own micro-batches, every ring on the
                      devices its document needs;
  hdp_per_rank_wide:  the same with widen=True (a ring may take up to twice the devices
                      it needs where the FLOP estimate says that ends sooner);
  static_padded:      a static data x context mesh with context sized for max_len, one
                      document per row padded to the row (the textbook static CP baseline);
  static_packed:      the same mesh, documents packed first-fit decreasing into its rows,
                      each row laid out zigzag over the ring (what a static packed loader
                      feeds).
The static layouts run through `HDPStep.run_programs`, a micro-step one program over the
`data = N/c, context = c` view of all slots. The documents are those the per-rank
schedule fits into batch_steps micro-batches per device.

Per layout: micro-steps (per-rank: the most micro-batches a device runs), padding waste
(empty slots over all slots run), token imbalance (static: most loaded device over the
mean, per micro-step, averaged; per-rank: over the whole step), FLOP imbalance (the time
the layout takes on a pool where every device runs at the same FLOP rate, over perfect
balance; FLOPs as `cost.sequence_cost` counts them, real tokens only) and the measured
step time (median over batches after a compile step).

On simulated CPU devices all 8 "devices" share the host's cores, so a micro-step costs
the sum of the devices' work, not the slowest device's: the measured time shows padding
and wasted compute, not imbalance; the imbalance columns show what an accelerator pool
would wait for.
"""
from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import numpy as np

from jaxsys.configs import tiny_lm
from jaxsys import mesh as mesh_lib
from jaxsys.data.documents import make_document_loader
from jaxsys.data.packing import FIELDS
from jaxsys.optim.inner import make_optimizer
from jaxsys.parallel import context, cost, hdp, hdp_layout, hdp_sim
from jaxsys.train import config_check, hdp_step
from jaxsys.train import state as state_lib

LAYOUTS = ("hdp_per_rank", "hdp_per_rank_wide", "static_padded", "static_packed")
PER_RANK = {"hdp_per_rank": False, "hdp_per_rank_wide": True}  # layout -> widen


def static_rows(lengths, *, packed: bool, row_tokens: int) -> list[list[int]]:
  """Rows of a static mesh: FFD-packed documents, or one document per row."""
  if packed:
    return hdp.pack_rows(lengths, row_tokens)
  return [[i] for i in range(len(lengths))]


def row_fields(docs, row: list[int], row_tokens: int, ring: int) -> dict[str, np.ndarray]:
  """One static row: its documents concatenated, padded, then laid out zigzag over the ring."""
  out = {k: np.zeros(row_tokens, np.float32 if k == "loss_mask" else np.int32) for k in FIELDS}
  out["segment_ids"][:] = hdp_layout.PAD_SEGMENT + np.arange(row_tokens)
  at = 0
  for seg, i in enumerate(row, start=1):
    d = np.asarray(docs[i])
    n = d.size - 1
    out["inputs"][at:at + n], out["targets"][at:at + n] = d[:-1], d[1:]
    out["segment_ids"][at:at + n], out["positions"][at:at + n] = seg, np.arange(n)
    out["loss_mask"][at:at + n] = 1.0
    at += n
  return {k: np.asarray(context.to_layout(v[None], ring, "zigzag"))[0] for k, v in out.items()}


def static_programs(docs, steps, *, num_devices: int, tokens_per_device: int, ring: int
                    ) -> list[hdp_step.Program]:
  """A program per micro-step of `layout_plan`'s static steps over all slots: its rows
  (the entries on each ring) [N/ring, ring * tpd], empty rows padded."""
  per_step, row_tokens = num_devices // ring, ring * tokens_per_device
  out = []
  for step in steps:
    rows = [[] for _ in range(per_step)]
    for i, devs in step:
      rows[devs[0] // ring].append(i)
    fields = [row_fields(docs, r, row_tokens, ring) for r in rows]
    out.append(hdp_step.Program(tuple(range(num_devices)), ring, tokens_per_device,
                                {k: np.stack([f[k] for f in fields]) for k in FIELDS}))
  return out


def layout_plan(name: str, lengths, *, num_devices: int, tokens_per_device: int, ring: int):
  """A static layout as micro-steps of (sequence, devices) entries, for hdp.summary."""
  rows = static_rows(lengths, packed=name == "static_packed", row_tokens=ring * tokens_per_device)
  per_step = num_devices // ring
  return [[(i, tuple(range(k * ring, (k + 1) * ring)))
           for k, row in enumerate(rows[s:s + per_step]) for i in row]
          for s in range(0, len(rows), per_step)]


def per_rank_stats(sched, lengths, *, tokens_per_device: int, d_model: int) -> dict:
  """A per-rank schedule's numbers, as the static layouts' (see the module docstring)."""
  lengths = np.asarray(lengths, np.int64)
  counts = sched.micro_batches()
  n = counts.size
  tokens = np.zeros(n)
  for ring in sched.rings:
    for seq, devs in ring.entries():
      tokens[[ring.devices[k] for k in devs]] += lengths[seq] / len(devs)
  for d, batches in enumerate(sched.local):
    tokens[d] += sum(int(lengths[list(b)].sum()) for b in batches)
  model = cost.flop_model(d_model)
  span = hdp_sim.schedule_times(sched, lengths, tokens_per_device=tokens_per_device,
                                model=model).max()
  perfect = 3.0 * float(np.sum(model.attention(lengths) + model.linear(lengths))) / n
  return dict(micro_steps=float(counts.max()),
              waste=1.0 - lengths.sum() / sched.slots(lengths, tokens_per_device),
              flop_imbalance=float(span / perfect),
              token_imbalance=float(tokens.max() / tokens.mean()))


def static_stats(steps, lengths, *, num_devices: int, tokens_per_device: int,
                   d_model: int) -> dict:
  s = hdp.summary(steps, lengths, d_model=d_model, num_devices=num_devices,
                  tokens_per_device=tokens_per_device)
  mean_tokens = s.tokens.mean(axis=1)
  return dict(micro_steps=float(len(steps)), waste=1.0 - s.utilisation,
              flop_imbalance=s.imbalance,
              token_imbalance=float(np.mean(s.tokens.max(axis=1) / np.maximum(mean_tokens, 1))))


def real_part(*, size: str = "tiny", tokens_per_device: int = 1024, max_len: int = 8192,
              batch_steps: int = 2, batches: int = 3, seed: int = 0, log=print) -> list[dict]:
  """Rows of per-layout numbers (see the module docstring) over `batches` global batches."""
  mesh = mesh_lib.make_mesh("data=-1")
  n = mesh.size
  ring = hdp_sim.static_ring(max_len, n, tokens_per_device)
  run = config_check.parse(tiny_lm.get_config(f"size={size}"))
  model_cfg = run.model
  data = dataclasses.replace(run.data, source="stdlib", max_len=max_len, truncate_long=True)
  # The loader offers more than batch_steps micro-batches' slots; the per-rank schedule
  # keeps the documents it fits into batch_steps micro-batches per device and gives the
  # rest back (as jaxsys/train/hdp_step.py does in training); every layout gets the same
  # documents.
  budget = hdp_step.loader_budget(n * tokens_per_device * batch_steps, max_len)
  loader = make_document_loader(data, "train", seed=seed, tokens_per_batch=budget)
  optimizer = make_optimizer(run.optimizer, run.total_steps)
  abstract = state_lib.abstract_train_state(model_cfg, optimizer, seed)
  state_sh = state_lib.state_shardings(abstract, model_cfg, optimizer, mesh)
  args = (model_cfg, optimizer, mesh, state_sh, tokens_per_device)
  per_rank = {name: hdp_step.make_step(*args, widen=w) for name, w in PER_RANK.items()}
  init = jax.jit(lambda: state_lib.init_train_state(model_cfg, optimizer, seed),
                 out_shardings=state_sh)
  geometry = dict(num_devices=n, tokens_per_device=tokens_per_device)
  batch_list = []
  for _ in range(batches):
    docs = next(loader)["tokens"]
    kept, _ = per_rank["hdp_per_rank"].fit(docs, batch_steps)
    if len(kept) < len(docs):
      loader.give_back(sorted(set(range(len(docs))) - set(kept)))
    batch_list.append([docs[i] for i in kept])
  for run in per_rank.values():
    run.compile_for(init(), batch_list)
  rows = []
  for name in LAYOUTS:
    state, times, stats = init(), [], []
    for b, docs in enumerate([batch_list[0]] + batch_list):  # the first one warms up
      lengths = [len(d) - 1 for d in docs]
      t = time.perf_counter()
      if name in per_rank:
        sched = per_rank[name].plan(lengths)
        state, m = per_rank[name].run(state, docs, sched)
      else:
        steps = layout_plan(name, lengths, ring=ring, **geometry)
        programs = static_programs(docs, steps, ring=ring, **geometry)
        # The same executor runs a static mesh's micro-steps, one program each.
        state, m = per_rank["hdp_per_rank"].run_programs(state, programs)
      jax.block_until_ready(m)
      if b:
        times.append(time.perf_counter() - t)
        if name in per_rank:
          s = per_rank_stats(sched, lengths, tokens_per_device=tokens_per_device,
                             d_model=model_cfg.d_model)
        else:
          s = static_stats(steps, lengths, d_model=model_cfg.d_model, **geometry)
        stats.append(dict(**s, tokens=int(sum(lengths)), loss=float(m["loss"])))
    row = {"layout": name, "ring": ring if name.startswith("static") else "1..%d" % ring,
           "step_s": statistics.median(times),
           **{k: float(np.mean([s[k] for s in stats])) for k in stats[0]}}
    log(f"{name}: {row}")
    rows.append(row)
  return rows


def real_table(rows: list[dict]) -> str:
  """Markdown: one line per layout, per-rank HDP's step time as the 1.00x reference."""
  hdp_time = next(r["step_s"] for r in rows if r["layout"] == "hdp_per_rank")
  lines = ["| layout | ring | micro-steps | padding waste | token imbalance | FLOP imbalance "
           "| step time (s) | vs HDP |", "|---|---|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    lines.append(f"| {r['layout']} | {r['ring']} | {r['micro_steps']:.1f} | {r['waste']:.1%} | "
                 f"{r['token_imbalance']:.3f} | {r['flop_imbalance']:.3f} | {r['step_s']:.2f} | "
                 f"{r['step_s'] / hdp_time:.2f}x |")
  return "\n".join(lines)

"""The real HDP run for experiments/bench_hdp.py --part=real: three layouts, one executor.

One global batch of whole stdlib documents (jaxsys.data.documents, truncated to max_len)
trains one step three ways on the same devices, at equal tokens, through the same
executor (`hdp_step.HDPStep.run_packed`, ring attention over `context`):

  hdp:           `hdp.plan`: each document on a ring of just as many devices as it needs,
                 short ones whole on single devices (views data=N/c, context=c);
  static_padded: a static data x context mesh with context sized for max_len, one
                 document per row padded to the row (the textbook static CP baseline);
  static_packed: the same mesh, documents packed first-fit decreasing into its rows, each
                 row laid out zigzag over the ring (what a static packed loader feeds).

Per layout: micro-steps, padding waste (empty slots over all slots), the per-micro-step
imbalance of tokens and of FLOPs (most loaded device over the mean, `hdp.summary`'s cost
model) and the measured step time (median over batches after a compile step).

On simulated CPU devices all 8 "devices" share the host's cores, so a micro-step costs
the sum of the devices' work, not the slowest device's: the measured time shows padding
and wasted compute, not imbalance; the imbalance columns show what an accelerator pool
would wait for.
"""
from __future__ import annotations

import statistics
import time

import jax
import ml_collections
import numpy as np

from configs import tiny_lm
from jaxsys import mesh as mesh_lib
from jaxsys.data.documents import make_document_loader
from jaxsys.data.packing import FIELDS
from jaxsys.models import transformer
from jaxsys.optim.inner import make_optimizer
from jaxsys.parallel import context, hdp, hdp_layout, hdp_sim
from jaxsys.train import hdp_step
from jaxsys.train import state as state_lib

LAYOUTS = ("hdp", "static_padded", "static_packed")


def static_rows(lengths, *, packed: bool, row_tokens: int) -> list[list[int]]:
  """Rows of a static mesh: FFD-packed documents, or one document per row."""
  if packed:
    return hdp_sim.pack_rows(lengths, row_tokens)
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


def static_micro_batches(docs, steps, *, num_devices: int, tokens_per_device: int, ring: int):
  """(ring, fields [N/ring, ring * tpd]) per micro-step of `layout_plan`'s static steps:
  its rows (the entries on each ring), empty rows padded."""
  per_step, row_tokens = num_devices // ring, ring * tokens_per_device
  for step in steps:
    rows = [[] for _ in range(per_step)]
    for i, devs in step:
      rows[devs[0] // ring].append(i)
    fields = [row_fields(docs, r, row_tokens, ring) for r in rows]
    yield ring, {k: np.stack([f[k] for f in fields]) for k in FIELDS}


def layout_plan(name: str, lengths, *, num_devices: int, tokens_per_device: int, ring: int):
  """The layout as micro-steps of (sequence, devices) entries, for hdp.summary."""
  if name == "hdp":
    return hdp.plan(lengths, num_devices=num_devices, tokens_per_device=tokens_per_device)
  rows = static_rows(lengths, packed=name == "static_packed", row_tokens=ring * tokens_per_device)
  per_step = num_devices // ring
  return [[(i, tuple(range(k * ring, (k + 1) * ring)))
           for k, row in enumerate(rows[s:s + per_step]) for i in row]
          for s in range(0, len(rows), per_step)]


def micro_batches(name: str, docs, steps, *, num_devices: int, tokens_per_device: int,
                  ring: int):
  """The layout's micro-steps as (c, fields) for `HDPStep.run_packed`."""
  if name == "hdp":
    return (hdp_layout.pack_step(m, docs, num_devices=num_devices,
                                 tokens_per_device=tokens_per_device) for m in steps)
  return static_micro_batches(docs, steps, num_devices=num_devices,
                              tokens_per_device=tokens_per_device, ring=ring)


def real_part(*, size: str = "tiny", tokens_per_device: int = 1024, max_len: int = 8192,
              batch_steps: int = 2, batches: int = 3, seed: int = 0, log=print) -> list[dict]:
  """Rows of per-layout numbers (see the module docstring) over `batches` global batches."""
  mesh = mesh_lib.make_mesh("data=-1")
  n = mesh.size
  ring = hdp_sim.static_ring(max_len, n, tokens_per_device)
  config = tiny_lm.get_config(f"size={size}")
  model_cfg = transformer.TransformerConfig.from_config(config.model)
  data = ml_collections.ConfigDict(dict(source="stdlib", tokenizer="byte", vocab_size=256,
                                        max_len=max_len, truncate_long=True))
  # The loader offers more than batch_steps micro-steps' slots; HDP keeps the documents
  # its plan fits into batch_steps micro-steps and gives the rest back (as
  # jaxsys/train/hdp_step.py does in training); every layout gets the same documents.
  budget = hdp_step.loader_budget(n * tokens_per_device * batch_steps, max_len)
  loader = make_document_loader(data, "train", seed=seed, tokens_per_batch=budget)
  optimizer = make_optimizer(config.optimizer, config.total_steps)
  abstract = state_lib.abstract_train_state(model_cfg, optimizer, seed)
  state_sh = state_lib.state_shardings(abstract, model_cfg, optimizer, mesh)
  run = hdp_step.HDPStep(model_cfg, optimizer, mesh, state_sh, tokens_per_device)
  init = jax.jit(lambda: state_lib.init_train_state(model_cfg, optimizer, seed),
                 out_shardings=state_sh)
  geometry = dict(num_devices=n, tokens_per_device=tokens_per_device)
  batch_list = []
  for _ in range(batches):
    docs = next(loader)["tokens"]
    kept, _ = run.fit(docs, batch_steps)
    if len(kept) < len(docs):
      loader.give_back(sorted(set(range(len(docs))) - set(kept)))
    batch_list.append([docs[i] for i in kept])
  run.compile_all(init().params)
  rows = []
  for name in LAYOUTS:
    state, times, stats = init(), [], []
    for b, docs in enumerate([batch_list[0]] + batch_list):  # the first one warms up
      lengths = [len(d) - 1 for d in docs]
      steps = layout_plan(name, lengths, ring=ring, **geometry)
      t = time.perf_counter()
      state, m = run.run_packed(state, micro_batches(name, docs, steps, ring=ring, **geometry))
      jax.block_until_ready(m)
      if b:
        times.append(time.perf_counter() - t)
        s = hdp.summary(steps, lengths, d_model=model_cfg.d_model, **geometry)
        mean_tokens = s.tokens.mean(axis=1)
        stats.append(dict(
            micro_steps=len(steps), waste=1.0 - s.utilisation, flop_imbalance=s.imbalance,
            token_imbalance=float(np.mean(s.tokens.max(axis=1) / np.maximum(mean_tokens, 1))),
            tokens=int(sum(lengths)), loss=float(m["loss"])))
    row = {"layout": name, "ring": ring if name != "hdp" else "1..%d" % ring,
           "step_s": statistics.median(times),
           **{k: float(np.mean([s[k] for s in stats])) for k in stats[0]}}
    log(f"{name}: {row}")
    rows.append(row)
  return rows


def real_table(rows: list[dict]) -> str:
  """Markdown: one line per layout, HDP's step time as the 1.00x reference."""
  hdp_time = next(r["step_s"] for r in rows if r["layout"] == "hdp")
  lines = ["| layout | ring | micro-steps | padding waste | token imbalance | FLOP imbalance "
           "| step time (s) | vs HDP |", "|---|---|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    lines.append(f"| {r['layout']} | {r['ring']} | {r['micro_steps']:.1f} | {r['waste']:.1%} | "
                 f"{r['token_imbalance']:.3f} | {r['flop_imbalance']:.3f} | {r['step_s']:.2f} | "
                 f"{r['step_s'] / hdp_time:.2f}x |")
  return "\n".join(lines)

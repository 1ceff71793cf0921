r"""Context-parallel attention on simulated CPU devices: memory, traffic, work balance, time.

  python -m experiments.bench_context --seq_len=8192 --devices=4 --repeats=3 \
      --out=/tmp/bench_context.json

(The script sets 8 simulated CPU devices itself when XLA_FLAGS does not name a count.)
One sequence of T = --seq_len tokens (B, Hq, Hkv, D from the flags, f32, causal) split
over n = --devices devices; it prints three markdown tables and writes every number to
--out:

1. Memory and traffic: `memory_analysis().temp_size_in_bytes` of the compiled fwd+bwd
   (grads of sum(out) wrt q, k, v) of each algorithm (`context.ALGORITHMS`: the ring,
   all-gather K/V, and Ulysses where both head counts divide by n) under shard_map in
   zigzag order, against single-device
   `xla_attention` at the same T, and the bytes each device sends per collective kind
   (from the compiled HLO, loops counted in full). A shard_map program compiles to ONE
   SPMD executable, the program every device runs on its shards, so its sizes are
   already per device; the table shows the check: the executable's argument bytes equal
   one device's q, k, v shards (not the global arrays).
2. Work: score tiles the blockwise kernel visits on each device over the ring's n steps
   (`context.ring_tiles`; forward and backward visit the same tiles), and the score
   elements they hold (tiles x B*Hq*block_q*block_k), per layout; max/mean is the load
   imbalance (1.0 = even).
3. Time: median wall time of the jitted fwd+bwd over --repeats calls (after a warm-up),
   ring per layout, all-gather in zigzag order and single-device xla flash, in
   interleaved rounds. The n simulated
   devices share the host's cores, so the ring's time is an upper bound on a real
   device's, not a speed-up measurement.
"""
from __future__ import annotations

from jaxsys import comm_bytes
from jaxsys import xla_flags

xla_flags.default_cpu_devices(8)

import functools
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from jax.sharding import PartitionSpec as P

from jaxsys.kernels.attention_xla import xla_attention
from jaxsys.parallel import context
from jaxsys.train import aot


def _define_flags() -> None:
  """Defines the flags: only when this file runs as a script, so tests can import it
  beside other benchmarks (absl refuses a flag name defined twice in one process)."""
  global _SEQ_LEN, _DEVICES, _BATCH, _HEADS, _KV_HEADS, _HEAD_DIM, _LAYOUTS, _REPEATS, _OUT
  _SEQ_LEN = flags.DEFINE_integer("seq_len", 8192, "Sequence length T.")
  _DEVICES = flags.DEFINE_integer("devices", 4, "Ring size n (simulated CPU devices).")
  _BATCH = flags.DEFINE_integer("batch", 1, "Batch size B.")
  _HEADS = flags.DEFINE_integer("heads", 4, "Query heads Hq.")
  _KV_HEADS = flags.DEFINE_integer("kv_heads", 2, "Key/value heads Hkv (divides Hq).")
  _HEAD_DIM = flags.DEFINE_integer("head_dim", 64, "Head dim D.")
  _LAYOUTS = flags.DEFINE_list("layouts", list(context.LAYOUTS), "Layouts to compare.")
  _REPEATS = flags.DEFINE_integer("repeats", 3, "Timed calls per case (0: skip timing).")
  _OUT = flags.DEFINE_string("out", None, "Optional JSON path with every number.")


AXIS = "context"
MIB = 2**20


def _shapes(seq_len, batch, heads, kv_heads, head_dim):
  q = jax.ShapeDtypeStruct((batch, seq_len, heads, head_dim), jnp.float32)
  kv = jax.ShapeDtypeStruct((batch, seq_len, kv_heads, head_dim), jnp.float32)
  return q, kv, kv


def _fwd_bwd(attn):
  """q, k, v -> grads of sum(attn(q, k, v)) wrt q, k, v."""
  return jax.grad(lambda q, k, v: jnp.sum(attn(q, k, v)), (0, 1, 2))


def _context(n: int, layout: str, algorithm: str = "ring"):
  """`algorithm` over the first n devices, on arrays already in `layout` order."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]), (AXIS,))
  local = functools.partial(context.ALGORITHMS[algorithm], axis_name=AXIS, layout=layout)
  return jax.shard_map(local, mesh=mesh, in_specs=P(None, AXIS), out_specs=P(None, AXIS),
                       check_vma=False)


def _compiled(n: int, layout: str | None, shapes, algorithm: str = "ring"):
  """The compiled fwd+bwd: `algorithm` over n devices, or single-device xla_attention."""
  attn = xla_attention if layout is None else _context(n, layout, algorithm)
  return jax.jit(_fwd_bwd(attn)).lower(*shapes).compile()


def memory(n: int, shapes) -> dict:
  """Per-device temp bytes and sent bytes of each algorithm's fwd+bwd, single-device temp
  bytes, and the per-device check."""
  single = _compiled(1, None, shapes).memory_analysis()
  out = dict(single_temp_bytes=int(single.temp_size_in_bytes),
             local_shard_bytes=int(sum(s.size // n * s.dtype.itemsize for s in shapes)),
             global_bytes=int(sum(s.size * s.dtype.itemsize for s in shapes)))
  for algorithm in context.ALGORITHMS:
    if algorithm == "ulysses" and (shapes[0].shape[2] % n or shapes[1].shape[2] % n):
      continue  # it splits the heads over the devices: both counts must divide by n
    compiled = _compiled(n, "zigzag", shapes, algorithm)
    mem, hlo = compiled.memory_analysis(), compiled.as_text()
    sent = {kind: comm_bytes.collective_bytes_from_hlo(hlo, n, trips=True, kind=kind)
            for kind in aot.COLLECTIVES}
    out[algorithm] = dict(temp_bytes=int(mem.temp_size_in_bytes),
                          ratio=mem.temp_size_in_bytes / single.temp_size_in_bytes,
                          argument_bytes=int(mem.argument_size_in_bytes),
                          sent_bytes={k: int(v) for k, v in sent.items() if v})
  return out


def work(n: int, seq_len: int, batch: int, heads: int, layouts) -> list[dict]:
  """Per layout: tiles and score elements the kernel visits per device (forward)."""
  rows = []
  for layout in layouts:
    tiles, (bq, bk) = context.ring_tiles(n, seq_len // n, layout, batch=batch, heads=heads)
    per_device = tiles.sum(1)
    rows.append(dict(layout=layout, block_q=bq, block_k=bk, tiles=per_device.tolist(),
                     elements=(per_device * batch * heads * bq * bk).tolist(),
                     max_over_mean=float(per_device.max() / per_device.mean())))
  return rows


def timing(n: int, shapes, layouts, repeats: int, seed: int = 0) -> dict:
  """Median seconds of one fwd+bwd call per case, timed in interleaved rounds."""
  rng = np.random.default_rng(seed)
  args = [jnp.asarray(rng.standard_normal(s.shape, dtype=np.float32)) for s in shapes]
  fns = {f"ring_{layout}": _compiled(n, layout, shapes) for layout in layouts}
  fns["all_gather_zigzag"] = _compiled(n, "zigzag", shapes, "all_gather")
  fns["single_xla"] = _compiled(1, None, shapes)
  times = {name: [] for name in fns}
  for name, fn in fns.items():
    jax.block_until_ready(fn(*args))  # warm-up
  for _ in range(repeats):
    for name, fn in fns.items():
      start = time.perf_counter()
      jax.block_until_ready(fn(*args))
      times[name].append(time.perf_counter() - start)
  return {name: statistics.median(t) for name, t in times.items()}


def run(*, seq_len: int, devices: int, batch: int, heads: int, kv_heads: int, head_dim: int,
        layouts, repeats: int, out_path: str | None = None) -> dict:
  for layout in layouts:
    if layout not in context.LAYOUTS:
      raise ValueError(f"bench_context: unknown layout {layout!r}; valid: "
                       f"{', '.join(context.LAYOUTS)}")
  if devices > len(jax.devices()):
    raise ValueError(f"bench_context: devices={devices} but only {len(jax.devices())} exist")
  shapes = _shapes(seq_len, batch, heads, kv_heads, head_dim)
  result = dict(config=dict(seq_len=seq_len, devices=devices, batch=batch, heads=heads,
                            kv_heads=kv_heads, head_dim=head_dim, dtype="float32", causal=True),
                jax_version=jax.__version__,
                memory=memory(devices, shapes),
                work=work(devices, seq_len, batch, heads, layouts))
  if repeats:
    result["seconds"] = timing(devices, shapes, layouts, repeats)
  if out_path:
    with open(out_path, "w") as f:
      json.dump(result, f, indent=1)
  return result


def tables(result) -> str:
  c, m = result["config"], result["memory"]
  parts = [
      f"T={c['seq_len']} over n={c['devices']} (B={c['batch']}, Hq={c['heads']}, "
      f"Hkv={c['kv_heads']}, D={c['head_dim']}, f32, causal)",
      "| fwd+bwd per device | temp MiB | / single-device flash | sent MiB by kind |\n"
      "|---|---|---|---|\n"
      + "".join(f"| {a} (zigzag) | {m[a]['temp_bytes'] / MIB:.1f} | {m[a]['ratio']:.3f} | "
                + (", ".join(f"{k} {b / MIB:.2f}" for k, b in m[a]['sent_bytes'].items())
                   or "none") + " |\n" for a in context.ALGORITHMS if a in m)
      + f"| single-device xla flash | {m['single_temp_bytes'] / MIB:.1f} | 1 | none |\n"
      f"| executable's argument bytes (= one device's q, k, v shards "
      f"{m['local_shard_bytes'] / MIB:.2f}; global {m['global_bytes'] / MIB:.2f}) | "
      f"{m['ring']['argument_bytes'] / MIB:.2f} | | |"]
  lines = ["| layout | tile | tiles per device | score elements per device (M) | max/mean |",
           "|---|---|---|---|---|"]
  for w in result["work"]:
    elements = ", ".join(f"{e / 1e6:.1f}" for e in w["elements"])
    lines.append(f"| {w['layout']} | {w['block_q']}x{w['block_k']} | "
                 f"{', '.join(map(str, w['tiles']))} | {elements} | {w['max_over_mean']:.3f} |")
  parts.append("\n".join(lines))
  if "seconds" in result:
    lines = ["| fwd+bwd | median s |", "|---|---|"]
    lines += [f"| {name} | {t:.3f} |" for name, t in result["seconds"].items()]
    parts.append("\n".join(lines))
  return "\n\n".join(parts)


def main(argv):
  del argv
  result = run(seq_len=_SEQ_LEN.value, devices=_DEVICES.value, batch=_BATCH.value,
               heads=_HEADS.value, kv_heads=_KV_HEADS.value, head_dim=_HEAD_DIM.value,
               layouts=_LAYOUTS.value, repeats=_REPEATS.value, out_path=_OUT.value)
  print(tables(result))


if __name__ == "__main__":
  _define_flags()
  app.run(main)

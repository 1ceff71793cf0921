"""Checkpoint save, load and training-loop stall of `jaxsys.checkpoint.manager.Checkpointer`.

The library of `experiments/bench_checkpoint.py` (its flags name the arguments below): `run`
measures 1-4 below and `tables` makes their tables; `run_training` measures 5 and `run_table`
makes its table.
For each state size (`tiny`: configs/tiny_lm.py's model, 3.3M parameters; `100m`: d_model
768, 12 layers, 12 heads, d_ff 2048, vocabulary 10,240: 100.7M parameters) it builds the
TrainState a run checkpoints, parameters and AdamW moments (3x the parameter bytes,
float32), filled with random values (zeros would flatter a compressing writer), sharded
over --mesh (fsdp=8) by `jaxsys.train.state.state_shardings`, and measures, every number
--repeats times (median [min, max]; within a repeat the kinds of a measurement alternate,
in an order that rotates from repeat to repeat, so a busy spell of the shared machine or of
the VM's disk hits them alike):

1. This disk's sequential bandwidth, in the same process: a file of the state's size
   written with os.write in 64 MiB chunks, then os.fsync (write + fsync = the durable
   rate a checkpoint can reach); read back after its pages are dropped from the guest's
   page cache (posix_fadvise DONTNEED, on the clean pages the fsync left; a VM host may
   still cache them) and again from the page cache. The same for --shm_dir (/dev/shm,
   RAM: its "write" is page allocation + memcpy, fsync a no-op).
2. Save throughput = state bytes / time from `Checkpointer.save` to the save being
   committed (`wait_until_finished` of its orbax manager: the step directory renamed into
   place, its CRC-32 manifest written inside it just before); and to sealed + durable
   (`Checkpointer.wait`: since the manifest is part of the commit, nothing more; then an
   fsync of every file and directory of the step and of its parent).
   TensorStore fsyncs the array data files it writes (its `file_io_sync` default) but
   orbax's JSON metadata and the commit rename are not fsynced, hence the second number.
   Against the disk's write + fsync bandwidth (target: >= 70%), as medians and, since this
   VM's disk is bursty, pair by pair: each repeat times the probe right before (or, every
   other repeat, right after) the default save. The same for a synchronous
   Checkpointer (`async_save=False`), for an asynchronous one on /dev/shm (an "in-memory
   snapshot"), and for the orbax option sets of --variants (no zstd, zarr3, no OCDBT,
   smaller OCDBT data files), swapped into the Checkpointer's manager
   (`make_checkpointer`). The checkpointers keep every step and `prune` deletes the
   previous one after each timed save (timed on its own: with max_to_keep, orbax deletes
   it inside the next save's background finalize, so `wait` would include it).
3. Load throughput: `Checkpointer.restore` of the step into the same shardings, after the
   step's pages are dropped from the guest page cache; and into the shardings of
   --reshard_mesh (data=2,tensor=4: the same shapes, other shardings; plain orbax
   resharding), through `resharding_restore_vs_same_layout`, the hook a layout-converting
   restore plugs into with its own restore callable; and a layout-converting one
   (`replicas_to_one_model`): the state saved as 2 stacked replicas (an outer-optimizer
   run's form) read back as saved, against the loop's conversion to one model on
   --reshard_mesh (pieces read straight into that mesh, then the replicas' mean).
4. The training-loop stall per save: the wall time `save()` blocks its caller for an
   asynchronous save (disk, /dev/shm) and a synchronous one, called with the cores idle
   (the saves of 2.); and as the loop sees it: `save()` called right after the real
   jitted train step (`make_setup`'s, with donation; 8 rows of --step_seq tokens),
   and the next step's time while the write competes for the cores, against the same step
   with no save in flight. The step restored from that save is then checked equal to the
   state at save time (the step donates the buffers the save reads).

`tables` makes two markdown tables of them (measurements; orbax options); the result, also
written to `json_path` (--json), holds every sample. With `profile` (--profile) it logs
where one asynchronous and one synchronous save(), each called right after a train step,
spend the caller's time (cProfile, cumulative).

`run_training` (--part=run) measures instead what a training run loses to its checkpoints:

5. For each size, --run_steps steps of the real jitted train step (8 rows of --step_seq
   tokens), run as `jaxsys.train.loop` runs them (at most two steps in flight; every
   --every steps the metrics fetched, then the save), from the same starting state in
   three modes: no checkpoints; an asynchronous Checkpointer (keep=--keep) saving every
   --every steps; a synchronous one (`async_save=False`, then `wait`: committed before the
   next step). Each mode's wall time runs from the first step to the last step done and
   every save committed (the last asynchronous one included). Per repeat the modes run in
   an order rotated from repeat to repeat; the cost per checkpoint is that repeat's time
   over its no-checkpoint run divided by the checkpoints saved.
"""
from __future__ import annotations

import cProfile
import dataclasses
import io
import json
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from jaxsys.bench import log
from jaxsys.configs import tiny_lm
from jaxsys import hugepages
from jaxsys import mesh as mesh_lib
from jaxsys import metrics as metrics_lib
from jaxsys.checkpoint import layouts
from jaxsys.checkpoint.manager import Checkpointer
from jaxsys.data import packing
from jaxsys.models import transformer
from jaxsys.train import config_check
from jaxsys.train import state as state_lib
from jaxsys.train.setup import make_setup

CHUNK = 64 << 20  # bytes per os.write / os.readv of the bandwidth probe

SIZE_NAMES = ("tiny", "100m")

# orbax options of the state item (Checkpointer's state_options). "default" is the
# Checkpointer as it is (manager.STATE_OPTIONS: no compression, 64 MiB OCDBT files);
# "orbax_zstd" is orbax's own default (OCDBT, zarr2, zstd level 1).
VARIANTS: dict[str, dict[str, Any] | None] = {
    "default": None,
    "orbax_zstd": {},
    "no_compression": dict(use_compression=False),
    "no_compression_zarr3": dict(use_compression=False, use_zarr3=True),
    "no_compression_no_ocdbt": dict(use_compression=False, use_ocdbt=False),
}


# ---------------------------------------------------------------------------
# States
# ---------------------------------------------------------------------------


def model_config(size: str) -> transformer.TransformerConfig:
  if size == "tiny":
    return transformer.TransformerConfig.from_config(tiny_lm.get_config().model)
  if size == "100m":
    return transformer.TransformerConfig(vocab_size=10240, d_model=768, n_layers=12, n_heads=12,
                                         n_kv_heads=12, d_ff=2048, attention_impl="xla")
  raise ValueError(f"--sizes: {size!r} is unknown; valid: {', '.join(SIZE_NAMES)}")


def train_setup(model_cfg: transformer.TransformerConfig, mesh, step_seq: int):
  """The loop's own train step (jit, shardings, donation) for 8 rows of `step_seq` tokens."""
  run = config_check.parse(tiny_lm.get_config())
  run = dataclasses.replace(run, model=model_cfg, data=dataclasses.replace(
      run.data, batch_size=8, seq_len=step_seq))
  return make_setup(run, mesh)


def random_state(setup, seed: int = 0):
  """A TrainState of the setup's shape and shardings, every float leaf random: parameters
  and first moments ~N(0, 0.02^2), second moments (0.001 N)^2 (non-negative, as AdamW's)."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(setup.abstract)

  def fill():
    keys = jax.random.split(jax.random.key(seed), len(flat))
    out = []
    for key, (path, leaf) in zip(keys, flat):
      if not jnp.issubdtype(leaf.dtype, jnp.floating):
        out.append(jnp.zeros(leaf.shape, leaf.dtype))
        continue
      x = jax.random.normal(key, leaf.shape, leaf.dtype)
      second_moment = any(getattr(k, "name", None) == "nu" for k in path)
      out.append(jnp.square(0.001 * x) if second_moment else 0.02 * x)
    return treedef.unflatten(out)

  return jax.jit(fill, out_shardings=setup.state_sh)()


def state_bytes(tree) -> int:
  return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


# ---------------------------------------------------------------------------
# Files: bandwidth, page cache, durability
# ---------------------------------------------------------------------------


def fs_type(path: str) -> str:
  """The file system type of the mount holding `path` (from /proc/mounts; '' if unknown)."""
  path, best, kind = os.path.realpath(path), "", ""
  try:
    with open("/proc/mounts", encoding="utf-8") as f:
      for line in f:
        parts = line.split()
        mount = parts[1]
        inside = path == mount or path.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):
          best, kind = mount, parts[2]
  except OSError:
    pass
  return kind


def files_under(directory: str) -> list[str]:
  return [os.path.join(root, n) for root, _, names in os.walk(directory) for n in names]


def drop_page_cache(paths) -> bool:
  """Drops the files' clean pages from the guest page cache (fsync first, then
  posix_fadvise DONTNEED); False where that cannot drop anything (tmpfs: RAM is the store)."""
  paths = list(paths)
  if not paths or not hasattr(os, "posix_fadvise") or fs_type(paths[0]) in ("tmpfs", "ramfs"):
    return False
  for path in paths:
    fd = os.open(path, os.O_RDONLY)
    try:
      os.fsync(fd)
      os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
      os.close(fd)
  return True


def fsync_tree(directory: str) -> None:
  """fsyncs every file and directory under `directory`, and its parent (the rename)."""
  dirs = [directory]
  for root, subdirs, names in os.walk(directory):
    dirs += [os.path.join(root, d) for d in subdirs]
    for name in names:
      fd = os.open(os.path.join(root, name), os.O_RDONLY)
      try:
        os.fsync(fd)
      finally:
        os.close(fd)
  for d in dirs + [os.path.dirname(os.path.abspath(directory))]:
    fd = os.open(d, os.O_RDONLY)
    try:
      os.fsync(fd)
    finally:
      os.close(fd)


def _read_all(path: str, buf: bytearray) -> int:
  fd, n = os.open(path, os.O_RDONLY), 0
  try:
    view = memoryview(buf)
    while k := os.readv(fd, [view]):
      n += k
  finally:
    os.close(fd)
  return n


def file_bandwidth(directory: str, nbytes: int) -> dict[str, Any]:
  """Seconds to write `nbytes` sequentially (os.write in CHUNK pieces), to fsync them, and
  to read them back with the guest page cache dropped and from the page cache."""
  path = os.path.join(directory, f"bandwidth.{os.getpid()}.tmp")
  data = memoryview(np.random.default_rng(0).bytes(min(CHUNK, nbytes)))
  fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # never an existing file
  try:
    try:
      t0, written = time.perf_counter(), 0
      while written < nbytes:
        written += os.write(fd, data[:min(len(data), nbytes - written)])
      write_s = time.perf_counter() - t0
      os.fsync(fd)
      write_fsync_s = time.perf_counter() - t0
    finally:
      os.close(fd)
    dropped = drop_page_cache([path])
    buf = bytearray(min(CHUNK, nbytes))
    t0 = time.perf_counter()
    assert _read_all(path, buf) == nbytes
    read_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    _read_all(path, buf)
    read_hot_s = time.perf_counter() - t0
  finally:
    os.unlink(path)
  return dict(bytes=nbytes, write_s=write_s, write_fsync_s=write_fsync_s, read_s=read_s,
              read_hot_s=read_hot_s, cache_dropped=dropped)


# ---------------------------------------------------------------------------
# Checkpointers
# ---------------------------------------------------------------------------

DATA = {"position": 0}  # stand-ins for the loader position and the model meta of a run
META = {"bench": "bench_checkpoint"}


KEEP_ALL = 1 << 30  # orbax deletes no step itself: `prune` does, outside the timed saves


def make_checkpointer(directory: str, *, async_save: bool = True,
                      options: dict[str, Any] | None = None) -> Checkpointer:
  """A `Checkpointer` that keeps every step (`prune` deletes them), its state stored with
  `options` (default: the Checkpointer's own, `manager.STATE_OPTIONS`)."""
  return Checkpointer(directory, keep=KEEP_ALL, async_save=async_save, state_options=options)


def prune(ckpt: Checkpointer) -> float:
  """Deletes every step but the latest, as max_to_keep=1 would in orbax's background
  finalize (where it would lengthen `wait_until_finished`); returns the seconds taken."""
  steps = sorted(ckpt.all_steps())
  t0 = time.perf_counter()
  for step in steps[:-1]:
    shutil.rmtree(ckpt.step_dir(step))
  if len(steps) > 1:
    ckpt._manager.reload()
  return time.perf_counter() - t0


def timed_save(ckpt: Checkpointer, step: int, state) -> dict[str, float]:
  """Seconds from the call of `ckpt.save` until: it returns (the caller's stall), orbax has
  committed the step, the step is sealed (`Checkpointer.wait`), and it is fsynced; then
  the seconds `prune` takes to delete the previous step (not in the others)."""
  t0 = time.perf_counter()
  ckpt.save(step, state, data=DATA, meta=META, force=True)
  block = time.perf_counter() - t0
  ckpt._manager.wait_until_finished()  # the step directory renamed into place, with its manifest
  commit = time.perf_counter() - t0
  ckpt.wait()  # (the manifest is part of the commit: kept for the tables' columns)
  sealed = time.perf_counter() - t0
  fsync_tree(ckpt.step_dir(step))
  durable = time.perf_counter() - t0
  return dict(block_s=block, commit_s=commit, sealed_s=sealed, durable_s=durable,
              delete_previous_s=prune(ckpt))


def timed_restore(restore: Callable[[], Any], drop_cache: Callable[[], bool]) -> tuple[float, bool]:
  """(seconds of `restore()` until its arrays are ready, whether the page cache was dropped)."""
  dropped = drop_cache()
  t0 = time.perf_counter()
  out = restore()
  jax.block_until_ready(out)
  seconds = time.perf_counter() - t0
  del out
  return seconds, dropped


def resharding_restore_vs_same_layout(restore: Callable[[], Any],
                                      same_layout_restore: Callable[[], Any], *, nbytes: int,
                                      repeats: int, drop_cache: Callable[[], bool] = lambda: False,
                                      label: str = "resharded") -> dict[str, Any]:
  """THE HOOK for "resharding (or layout-converting) restore vs same-layout restore".

  `restore()` and `same_layout_restore()` each restore the same checkpoint and return the
  restored pytree (e.g. `lambda: ckpt.restore(step, other_target)[0]`, or a restore that
  converts replica-stacked / pipelined / vocab-padded layouts through
  `jaxsys.checkpoint.layouts`). They are timed alternately `repeats` times, each after
  `drop_cache()` (returns whether the page cache was dropped), until every array is ready.
  Returns {"label", "bytes", "same_layout_s": [...], "restore_s": [...], "cache_dropped"}:
  `bench_rows` makes it two table rows with GB/s and the time ratio.
  """
  same, other, dropped = [], [], True
  for _ in range(repeats):
    s, d1 = timed_restore(same_layout_restore, drop_cache)
    o, d2 = timed_restore(restore, drop_cache)
    same.append(s)
    other.append(o)
    dropped = dropped and d1 and d2
  return dict(label=label, bytes=nbytes, same_layout_s=same, restore_s=other,
              cache_dropped=dropped)


REPLICAS = 2  # of the layout-converting restore's checkpoint


def replicas_to_one_model(setup, state, one_target, directory: str, *, repeats: int,
                          label: str) -> dict[str, Any]:
  """A layout-converting restore, timed through the hook: `state`'s step, parameters and
  optimizer state saved as REPLICAS stacked replicas (an outer-optimizer run's form), read
  back as they were, against the loop's conversion into one model in `one_target`'s
  shardings (`layouts.stacked_target` pieces read straight into that mesh, then
  `layouts.convert`: the replicas' mean). Checks the conversion gives `state` back."""
  fields = lambda t: {"step": t.step, "params": t.params, "opt_state": t.opt_state}
  stack = lambda tree, mesh: dict(tree, **{k: layouts.stacked_target(tree[k], REPLICAS, mesh)
                                           for k in ("params", "opt_state")})
  mesh = jax.tree.leaves(state)[0].sharding.mesh
  saved = stack(fields(setup.saved), mesh)
  one = fields(one_target)
  read = stack(one, jax.tree.leaves(one_target)[0].sharding.mesh)
  shardings = lambda tree: jax.tree.map(lambda x: x.sharding, tree)
  stacked = jax.jit(lambda s: dict(fields(s), **{k: layouts.stack_replicas(v, REPLICAS) for k, v
                                                 in fields(s).items() if k != "step"}),
                    out_shardings=shardings(saved))(state)
  ckpt = make_checkpointer(directory)
  try:
    ckpt.save(1, stacked, data=DATA, meta=META, force=True)
    ckpt.wait()
    del stacked
    source, target = layouts.Form(REPLICAS, "diloco"), layouts.Form()

    def to_one(got):
      params, opt_state = layouts.convert(setup.optimizer, got["params"], got["opt_state"],
                                          source, target, "mean")
      return dict(got, params=params, opt_state=opt_state)
    to_one = jax.jit(to_one, out_shardings=shardings(one))
    phases = {"read_s": [], "convert_s": []}

    def converted():
      t0 = time.perf_counter()
      got = jax.block_until_ready(ckpt.restore(1, read, partial=True)[0])
      t1 = time.perf_counter()
      out = jax.block_until_ready(to_one(got))
      phases["read_s"].append(t1 - t0)
      phases["convert_s"].append(time.perf_counter() - t1)
      return out
    equal = all(jax.tree.leaves(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)),
                                             converted(), fields(state))))
    for xs in phases.values():
      xs.clear()  # the check's call, warm, is not a sample
    files = files_under(ckpt.step_dir(1))
    out = resharding_restore_vs_same_layout(
        converted, lambda: ckpt.restore(1, saved)[0], nbytes=REPLICAS * state_bytes(state),
        repeats=repeats, drop_cache=lambda: drop_page_cache(files), label=label)
  finally:
    ckpt.close()
  return dict(out, converted_equal=equal, **phases)


def _profile(fn: Callable[[], Any], top: int = 14) -> str:
  prof = cProfile.Profile()
  prof.enable()
  fn()
  prof.disable()
  out = io.StringIO()
  pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(top)
  return out.getvalue()


# ---------------------------------------------------------------------------
# One size
# ---------------------------------------------------------------------------


def _own_cpu_s() -> float:
  t = os.times()
  return t.user + t.system


def _other_share(busy0, own0) -> float | None:
  """The share of the host's CPU other processes used since (busy0, own0) =
  (metrics_lib.host_cpu_seconds(), _own_cpu_s())."""
  busy1, own1 = metrics_lib.host_cpu_seconds(), _own_cpu_s()
  if not (busy0 and busy1):
    return None
  return max(0.0, busy1[0] - busy0[0] - (own1 - own0)) / max(busy1[1] - busy0[1], 1e-9)


def reshard_target(setup, model_cfg: transformer.TransformerConfig, reshard_spec: str,
                   size: str) -> tuple[str, Any]:
  """(mesh spec, abstract state) of the resharding restore: the state's shardings on
  `reshard_spec`'s mesh, or on data=4,tensor=2 where the model does not fit that mesh."""
  target = lambda spec: state_lib.with_shardings(setup.abstract, state_lib.state_shardings(
      setup.abstract, model_cfg, setup.optimizer, mesh_lib.make_mesh(spec)))
  try:
    return reshard_spec, target(reshard_spec)
  except ValueError as e:  # e.g. tiny's 2 kv heads over tensor=4
    log(f"{size}: --reshard_mesh={reshard_spec} does not fit ({e}); using data=4,tensor=2")
    return "data=4,tensor=2", target("data=4,tensor=2")


def loop_stalls(setup, state, batch, ckpts: dict[str, Checkpointer], *, step: int,
                repeats: int) -> tuple[Any, int, dict[str, list[float]]]:
  """4. as the loop sees it, `repeats` times for each checkpointer but the synchronous one:
  a train step with no save in flight, save() called right after a step (its stall) and
  the next step while that save writes. Returns (state, the last step saved, samples)."""
  loop_kinds = [k for k in ckpts if k != "sync_disk"]
  loop = {"no_save": [], **{f"{w}_{k}": [] for k in loop_kinds for w in ("after", "block")}}
  for _ in range(repeats):
    for kind in loop_kinds:
      t0 = time.perf_counter()
      state, _ = setup.train_fn(state, batch)
      jax.block_until_ready(state)
      loop["no_save"].append(time.perf_counter() - t0)
      step += 1
      t0 = time.perf_counter()
      ckpts[kind].save(step, state, data=DATA, meta=META, force=True)  # right after a step
      t1 = time.perf_counter()
      state, _ = setup.train_fn(state, batch)  # donates the buffers being saved
      jax.block_until_ready(state)
      loop[f"after_{kind}"].append(time.perf_counter() - t1)
      loop[f"block_{kind}"].append(t1 - t0)
      ckpts[kind].wait()
      prune(ckpts[kind])
  return state, step, loop


def measure_size(size: str, *, repeats: int, disk_dir: str, shm_dir: str | None, mesh_spec: str,
                 reshard_spec: str, variants, step_seq: int, profile: bool) -> dict[str, Any]:
  """Every measurement of one state size (see the module docstring); raw samples."""
  t_start, busy0, own0 = time.perf_counter(), metrics_lib.host_cpu_seconds(), _own_cpu_s()
  model_cfg = model_config(size)
  mesh = mesh_lib.make_mesh(mesh_spec)
  setup = train_setup(model_cfg, mesh, step_seq)
  state = random_state(setup)
  jax.block_until_ready(state)
  nbytes = state_bytes(state)
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(setup.abstract.params))
  batch = setup.batch_fn(packing.random_packed_batch(
      8, step_seq, docs_per_row=2, vocab_size=model_cfg.vocab_size))
  for _ in range(2):  # compile + warm up
    state, _ = setup.train_fn(state, batch)
  jax.block_until_ready(state)
  log(f"{size}: {n_params / 1e6:.1f}M params, state {nbytes / 1e9:.3f} GB on {mesh_spec} "
      f"({time.perf_counter() - t_start:.0f}s to build)")
  out: dict[str, Any] = dict(size=size, params=n_params, bytes=nbytes, mesh=mesh_spec,
                             model=dataclasses.asdict(model_cfg), step_rows=8, step_seq=step_seq)
  root = os.path.join(disk_dir, size)
  shm_root = os.path.join(shm_dir, size) if shm_dir else None

  # 1 and 2, alternating within each repeat (the disk's speed drifts): the bandwidth of the
  # disk and of RAM; saves: async and sync on disk, async on /dev/shm, option variants.
  # (Steps are numbered in the order they are saved.)
  out["bandwidth"] = {"disk": [], **({"shm": []} if shm_root else {})}
  for d in [root] + ([shm_root] if shm_root else []):
    os.makedirs(d)
  ckpts = {"async_disk": make_checkpointer(os.path.join(root, "async"))}
  ckpts["sync_disk"] = make_checkpointer(os.path.join(root, "sync"), async_save=False)
  if shm_root:
    ckpts["async_shm"] = make_checkpointer(os.path.join(shm_root, "async"))
  for name in variants:
    if VARIANTS[name] is not None:
      ckpts[name] = make_checkpointer(os.path.join(root, name), options=VARIANTS[name])
  saves = {k: [] for k in ckpts}
  step = 0
  try:
    units = [("disk", root)] + ([("shm", shm_root)] if shm_root else []) + [
        (k, c) for k, c in ckpts.items() if k != "async_disk"]
    for r in range(repeats):
      # Each repeat starts elsewhere in the list: every kind takes its turn right after the
      # heaviest writes (the VM's disk slows down after a burst), none always first.
      shift = r * len(units) // repeats
      for kind, where in units[shift:] + units[:shift]:
        if kind == "shm":
          out["bandwidth"][kind].append(file_bandwidth(where, nbytes))
        elif kind == "disk":  # the probe next to the default save (first in turns): a pair
          step += 1
          pair = [lambda: out["bandwidth"]["disk"].append(file_bandwidth(root, nbytes)),
                  lambda: saves["async_disk"].append(timed_save(ckpts["async_disk"], step, state))]
          for measure in pair[::1 if r % 2 == 0 else -1]:
            measure()
        else:
          step += 1
          saves[kind].append(timed_save(where, step, state))
      log(f"{size}: repeat {r + 1}/{repeats}: disk write+fsync "
          f"{out['bandwidth']['disk'][-1]['write_fsync_s']:.2f}s, saves " + ", ".join(
              f"{k} {v[-1]['commit_s']:.2f}s" for k, v in saves.items()))
    out["saves"] = saves
    out["step_bytes_on_disk"] = {
        kind: sum(os.path.getsize(p) for p in files_under(ckpt.step_dir(ckpt.latest_step())))
        for kind, ckpt in ckpts.items()}

    # 3. Loads: same layout and resharded (the hook); each option variant's checkpoint.
    saved = ckpts["async_disk"]
    saved_step = saved.latest_step()
    same_target = setup.saved
    reshard_spec, other_target = reshard_target(setup, model_cfg, reshard_spec, size)
    drop = lambda c=saved, s=saved_step: drop_page_cache(files_under(c.step_dir(s)))
    equal = lambda tree: all(jax.tree.leaves(jax.tree.map(
        lambda a, b: bool(jnp.array_equal(a, b)), tree, state)))
    restored, _ = saved.restore(saved_step, same_target)  # also: the bytes came back
    out["restored_equal"] = equal(restored)
    del restored
    out["reshard"] = resharding_restore_vs_same_layout(
        lambda: saved.restore(saved_step, other_target)[0],
        lambda: saved.restore(saved_step, same_target)[0], nbytes=nbytes, repeats=repeats,
        drop_cache=drop, label=f"{mesh_spec} -> {reshard_spec}")
    out["reshard_mesh"] = reshard_spec
    out["convert"] = replicas_to_one_model(
        setup, state, other_target, os.path.join(root, "replicas"), repeats=repeats,
        label=f"{REPLICAS} replicas on {mesh_spec} -> one model on {reshard_spec}")
    out["loads"] = {"async_disk": out["reshard"]["same_layout_s"]}
    for kind in ckpts:
      if kind in VARIANTS:
        c = ckpts[kind]
        restored, _ = c.restore(c.latest_step(), same_target)
        out["restored_equal"] = out["restored_equal"] and equal(restored)
        del restored
        out["loads"][kind] = [timed_restore(
            lambda c=c: c.restore(c.latest_step(), same_target)[0],
            lambda c=c: drop_page_cache(files_under(c.step_dir(c.latest_step()))))[0]
            for _ in range(repeats)]
    log(f"{size}: loads " + ", ".join(f"{k} {_med(v):.2f}s" for k, v in out["loads"].items())
        + f", resharded {_med(out['reshard']['restore_s']):.2f}s, {REPLICAS} replicas as they "
        f"were {_med(out['convert']['same_layout_s']):.2f}s, converted to one model "
        f"{_med(out['convert']['restore_s']):.2f}s")

    # 4. The step as the loop sees it: right after an async save() returns, against none.
    state, step, loop = loop_stalls(setup, state, batch, ckpts, step=step, repeats=repeats)
    out["loop"] = loop
    # Untimed: what a save read while the next step donated its buffers is what was saved.
    step += 1
    snapshot = jax.tree.map(np.array, state)  # host copy of what is saved
    ckpts["async_disk"].save(step, state, data=DATA, meta=META, force=True)
    state, _ = setup.train_fn(state, batch)
    jax.block_until_ready(state)
    ckpts["async_disk"].wait()
    restored, _ = ckpts["async_disk"].restore(step, same_target)
    out["saved_during_step_equal"] = all(jax.tree.leaves(jax.tree.map(
        lambda a, b: bool(np.array_equal(np.asarray(a), b)), restored, snapshot)))
    del restored, snapshot
    prune(ckpts["async_disk"])
    log(f"{size}: step {_med(loop['no_save']):.3f}s, right after an async save "
        f"{_med(loop['after_async_disk']):.3f}s")

    if profile:  # each save() called right after a train step, as in the loop
      for kind, ckpt in (("async", ckpts["async_disk"]), ("sync", ckpts["sync_disk"])):
        state, _ = setup.train_fn(state, batch)
        jax.block_until_ready(state)
        step += 1
        out[f"profile_{kind}_save"] = _profile(
            lambda: ckpt.save(step, state, data=DATA, meta=META, force=True))
        ckpt.wait()
        prune(ckpt)
      log(f"{size}: async save() profile\n{out['profile_async_save']}")
      log(f"{size}: sync save() profile\n{out['profile_sync_save']}")
  finally:
    for ckpt in ckpts.values():
      ckpt.close()
  out["seconds"] = time.perf_counter() - t_start
  out["other_processes_cpu_share"] = _other_share(busy0, own0)
  return out


# ---------------------------------------------------------------------------
# Run, tables
# ---------------------------------------------------------------------------


def run(sizes, *, repeats: int = 3, disk_dir: str = "", shm_dir: str | None = "/dev/shm",
        mesh_spec: str = "fsdp=8", reshard_spec: str = "data=2,tensor=4", variants=tuple(VARIANTS),
        step_seq: int = 64, profile: bool = False, json_path: str = "") -> dict[str, Any]:
  """Measures every size in fresh temporary directories (removed at the end); returns (and
  writes to `json_path`) every sample."""
  unknown = [v for v in variants if v not in VARIANTS]
  if unknown:
    raise ValueError(f"--variants: {unknown} unknown; valid: {', '.join(VARIANTS)}")
  for size in sizes:
    model_config(size)  # a bad name fails before any work
  if repeats < 1:
    raise ValueError(f"--repeats={repeats} must be >= 1")
  load0, busy0, own0 = os.getloadavg(), metrics_lib.host_cpu_seconds(), _own_cpu_s()
  disk = tempfile.mkdtemp(prefix="bench_checkpoint.", dir=disk_dir or None)
  shm = None
  if shm_dir and os.path.isdir(shm_dir):
    shm = tempfile.mkdtemp(prefix="bench_checkpoint.", dir=shm_dir)
  result = dict(_started(repeats, disk, load0), shm_dir=shm,
                shm_fs=fs_type(shm) if shm else None)
  try:
    for size in sizes:
      result["sizes"].append(measure_size(
          size, repeats=repeats, disk_dir=disk, shm_dir=shm, mesh_spec=mesh_spec,
          reshard_spec=reshard_spec, variants=variants, step_seq=step_seq, profile=profile))
  finally:
    shutil.rmtree(disk, ignore_errors=True)
    if shm:
      shutil.rmtree(shm, ignore_errors=True)
  return _finished(result, busy0, own0, json_path)


def _started(repeats: int, disk: str, load0) -> dict[str, Any]:
  """What every measurement's result records of the machine and the run, before its sizes."""
  return dict(machine=metrics_lib.machine_info(), orbax=ocp.__version__,
              tensorstore=_version("tensorstore"), argv=sys.argv, repeats=repeats,
              disk_dir=disk, disk_fs=fs_type(disk), huge_pages=hugepages.enabled(),
              load_avg_start=load0, sizes=[])


def _finished(result: dict[str, Any], busy0, own0, json_path: str) -> dict[str, Any]:
  """`result` with the load at its end and other processes' CPU share, written to
  `json_path` when given."""
  result["load_avg_end"] = os.getloadavg()
  result["other_processes_cpu_share"] = _other_share(busy0, own0)
  if json_path:
    with open(json_path, "w") as f:
      json.dump(result, f, indent=1)
  return result


def _version(module: str) -> str:
  try:
    return __import__(module).__version__
  except (ImportError, AttributeError):
    return ""


def _med(xs) -> float:
  return statistics.median(xs)


def _t(x: float) -> str:
  return f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.2f} s"


def _spread(xs) -> str:
  return f"{_t(_med(xs))} [{_t(min(xs))}, {_t(max(xs))}]"


def _gbs(nbytes: int, xs) -> float:
  return nbytes / _med(xs) / 1e9


def bench_rows(s: dict[str, Any]) -> list[dict[str, str]]:
  """The measurement table's rows of one size: what, time, GB/s, against what."""
  n, rows = s["bytes"], []
  bw = s["bandwidth"]
  disk_w = _gbs(n, [b["write_fsync_s"] for b in bw["disk"]])
  disk_r = _gbs(n, [b["read_s"] for b in bw["disk"]])
  shm_w = _gbs(n, [b["write_s"] for b in bw["shm"]]) if "shm" in bw else None

  def row(what, xs, gbs=True, vs="", nbytes=n):
    rows.append(dict(what=what, time=_spread(xs), gbs=f"{_gbs(nbytes, xs):.2f}" if gbs else "",
                     vs=vs))

  row("disk: write + fsync (os.write, 64 MiB chunks)", [b["write_fsync_s"] for b in bw["disk"]],
      vs="100% (reference)")
  row("disk: write, before fsync", [b["write_s"] for b in bw["disk"]])
  cold = "guest page cache dropped" if all(b["cache_dropped"] for b in bw["disk"]) else \
      "page cache"
  row(f"disk: read ({cold})", [b["read_s"] for b in bw["disk"]], vs="100% (reference)")
  row("disk: read (page cache)", [b["read_hot_s"] for b in bw["disk"]])
  if "shm" in bw:
    row("/dev/shm: write (RAM)", [b["write_s"] for b in bw["shm"]], vs="100% (reference)")
    row("/dev/shm: read (RAM)", [b["read_s"] for b in bw["shm"]])
  sv = s["saves"]
  pct = lambda xs, ref: f"{_gbs(n, xs) / ref:.0%} of write + fsync"
  row("save async, disk: save() -> committed", [x["commit_s"] for x in sv["async_disk"]],
      vs=pct([x["commit_s"] for x in sv["async_disk"]], disk_w))
  row("save async, disk: -> sealed + fsync (durable)", [x["durable_s"] for x in sv["async_disk"]],
      vs=pct([x["durable_s"] for x in sv["async_disk"]], disk_w))
  paired = [b["write_fsync_s"] / x["durable_s"] for b, x in zip(bw["disk"], sv["async_disk"])]
  row("save async, disk: -> sealed + fsync, each against the probe next to it",
      [x["durable_s"] for x in sv["async_disk"]],
      vs=f"{_med(paired):.0%} [{min(paired):.0%}, {max(paired):.0%}] of write + fsync")
  deletes = [x["delete_previous_s"] for x in sv["async_disk"][1:]]
  if deletes:
    row("delete the previous step (max_to_keep's work, off the caller)", deletes, gbs=False,
        vs="not in the save times")
  row("save sync, disk: save() -> committed", [x["commit_s"] for x in sv["sync_disk"]],
      vs=pct([x["commit_s"] for x in sv["sync_disk"]], disk_w))
  if "async_shm" in sv:
    xs = [x["commit_s"] for x in sv["async_shm"]]
    row("save async, /dev/shm: save() -> committed", xs,
        vs=f"{_gbs(n, xs) / shm_w:.0%} of /dev/shm write")
  best = max((k for k in sv if k in VARIANTS), default=None,
             key=lambda k: _gbs(n, [x["commit_s"] for x in sv[k]]))
  if best:
    row(f"save async, disk, {best}: -> committed", [x["commit_s"] for x in sv[best]],
        vs=pct([x["commit_s"] for x in sv[best]], disk_w))
    row(f"save async, disk, {best}: -> sealed + fsync", [x["durable_s"] for x in sv[best]],
        vs=pct([x["durable_s"] for x in sv[best]], disk_w))
  rs = s["reshard"]
  state = "cold" if rs["cache_dropped"] else "page cache"
  row(f"load, same layout ({s['mesh']}), {state}", rs["same_layout_s"],
      vs=f"{_gbs(n, rs['same_layout_s']) / disk_r:.0%} of disk read")
  row(f"load, resharded {rs['label']}, {state}", rs["restore_s"],
      vs=f"{_med(rs['restore_s']) / _med(rs['same_layout_s']):.2f}x same-layout time")
  cv = s["convert"]
  row(f"load, {REPLICAS}-replica checkpoint as saved, {state}", cv["same_layout_s"],
      nbytes=cv["bytes"])
  row(f"load, layout-converting: {cv['label']} (mean), {state}", cv["restore_s"],
      nbytes=cv["bytes"],
      vs=f"{_med(cv['restore_s']) / _med(cv['same_layout_s']):.2f}x same-layout time; of it "
      f"the read {_t(_med(cv['read_s']))}, the merge {_t(_med(cv['convert_s']))}")
  a = [x["block_s"] for x in sv["async_disk"]]
  y = [x["block_s"] for x in sv["sync_disk"]]
  row("stall: async save() returns (disk, cores idle before)", a, gbs=False,
      vs=f"{_med(y) / _med(a):.0f}x smaller than sync")
  row("stall: sync save() returns (disk)", y, gbs=False)
  if "async_shm" in sv:
    m = [x["block_s"] for x in sv["async_shm"]]
    row("stall: async save() returns (/dev/shm, cores idle before)", m, gbs=False,
        vs=f"{_med(y) / _med(m):.0f}x smaller than sync")
  lp = s["loop"]
  for kind, where in (("async_disk", "disk"), ("async_shm", "/dev/shm")):
    if f"block_{kind}" in lp:
      xs = lp[f"block_{kind}"]
      row(f"stall: async save() called right after a train step ({where})", xs, gbs=False,
          vs=f"{_med(y) / _med(xs):.0f}x smaller than sync")
  base = _med(lp["no_save"])
  row(f"train step (8 x {s['step_seq']} tokens), no save in flight", lp["no_save"], gbs=False,
      vs="the step before each save below")
  for kind, where in (("async_disk", "disk"), ("async_shm", "/dev/shm")):
    if f"after_{kind}" in lp:
      xs = lp[f"after_{kind}"]
      row(f"train step right after that async save() returns ({where})", xs, gbs=False,
          vs=f"+{_t(_med(xs) - base)} ({_med(xs) / base - 1:+.0%})")
  return rows


def variant_rows(s: dict[str, Any]) -> list[dict[str, str]]:
  n = s["bytes"]
  disk_w = _gbs(n, [b["write_fsync_s"] for b in s["bandwidth"]["disk"]])
  disk_r = _gbs(n, [b["read_s"] for b in s["bandwidth"]["disk"]])
  base = _med(s["loop"]["no_save"])
  out = []
  for kind in ("async_disk", *[k for k in s["saves"] if k in VARIANTS]):
    commit = [x["commit_s"] for x in s["saves"][kind]]
    durable = [x["durable_s"] for x in s["saves"][kind]]
    loads = s["loads"][kind]
    after = s["loop"][f"after_{kind}"]
    name = ("default (Checkpointer: no compression, 64 MiB OCDBT files)"
            if kind == "async_disk" else kind)
    out.append(dict(
        options=name, on_disk=f"{s['step_bytes_on_disk'][kind] / n:.3f}",
        commit=_spread(commit),
        commit_gbs=f"{_gbs(n, commit):.2f} ({_gbs(n, commit) / disk_w:.0%})",
        durable_gbs=f"{_gbs(n, durable):.2f} ({_gbs(n, durable) / disk_w:.0%})",
        load=_spread(loads), load_gbs=f"{_gbs(n, loads):.2f} ({_gbs(n, loads) / disk_r:.0%})",
        step=f"{_t(_med(after))} ({_med(after) / base - 1:+.0%})"))
  return out


def _size_label(s) -> str:
  return f"{s['size']} ({s['params'] / 1e6:.1f}M params, {s['bytes'] / 1e9:.3f} GB)"


def tables(result: dict[str, Any]) -> str:
  lines = ["| state | measurement | time, median [min, max] | GB/s | vs |",
           "|---|---|---:|---:|---|"]
  for s in result["sizes"]:
    for r in bench_rows(s):
      lines.append(f"| {_size_label(s)} | {r['what']} | {r['time']} | {r['gbs']} | {r['vs']} |")
  lines += ["", "| state | orbax options (state item) | bytes on disk / state | save -> committed "
            "| GB/s committed (% of disk write + fsync) | GB/s sealed + fsync | load, cold "
            "| load GB/s (% of disk read) | train step right after save() (vs none) |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
  for s in result["sizes"]:
    for r in variant_rows(s):
      lines.append(f"| {_size_label(s)} | {r['options']} | {r['on_disk']} | {r['commit']} | "
                   f"{r['commit_gbs']} | {r['durable_gbs']} | {r['load']} | {r['load_gbs']} | "
                   f"{r['step']} |")
  checks = "; ".join(
      f"{s['size']}: restored == saved {s['restored_equal']}, {REPLICAS} replicas converted "
      f"to one model == the model {s['convert']['converted_equal']}, saved while the next "
      f"step donated its buffers: restored == state at save {s['saved_during_step_equal']}"
      + (f", other processes used {s['other_processes_cpu_share']:.0%} of the host's CPU"
         if s.get("other_processes_cpu_share") is not None else "") for s in result["sizes"])
  malloc = ("huge-page malloc (glibc.malloc.hugetlb=1)" if result.get("huge_pages") else
            "malloc in 4 KiB pages (JAXSYS_HUGE_PAGES=0 or no THP)")
  lines += ["", f"Checks: {checks}. {malloc}. {_load_note(result)}"]
  return "\n".join(lines)


def _load_note(result: dict[str, Any]) -> str:
  """The load average at the run's start and end, and other processes' share of the CPU."""
  other = result.get("other_processes_cpu_share")
  return (f"Load average {result['load_avg_start'][0]:.2f} at the start, "
          f"{result['load_avg_end'][0]:.2f} at the end"
          + (f"; other processes used {other:.0%} of the host's CPU over the run." if other
             is not None else "."))


# ---------------------------------------------------------------------------
# A training run with checkpoints (--part=run)
# ---------------------------------------------------------------------------

RUN_MODES = ("none", "async", "sync")


def train_run(setup, state, batch, *, steps: int, every: int, ckpt: Checkpointer | None,
              sync: bool = False) -> tuple[Any, dict[str, Any]]:
  """`steps` train steps as the loop runs them, saving into `ckpt` every `every` steps
  (`sync`: waiting for each save to commit); seconds until the last step is done and
  every save committed."""
  pending, blocks, committed = [], [], []
  t0 = time.perf_counter()
  for i in range(1, steps + 1):
    state, m = setup.train_fn(state, batch)
    pending.append(m)
    if len(pending) > 1:  # at most two steps in flight, as jaxsys.train.loop keeps them
      jax.block_until_ready(pending[-2])
    if i % every == 0:
      loss = float(jax.device_get(pending[-1]["loss"]))  # the loop logs before it saves
      pending.clear()
      if ckpt is not None:
        t = time.perf_counter()
        ckpt.save(i, state, data=DATA, meta=META, force=True)
        if sync:
          ckpt.wait()
        blocks.append(time.perf_counter() - t)
        committed.append(os.path.isdir(ckpt.step_dir(i)))  # before the next step starts
  jax.block_until_ready(state)
  steps_s = time.perf_counter() - t0
  if ckpt is not None:
    ckpt.wait()  # the last asynchronous save, too, is part of the run
  wall = time.perf_counter() - t0
  return state, dict(wall_s=wall, steps_s=steps_s, block_s=blocks,
                     committed_at_return=committed, loss=loss,
                     kept=sorted(ckpt.all_steps()) if ckpt is not None else [])


def measure_run(size: str, *, steps: int, every: int, repeats: int, keep: int, disk_dir: str,
                mesh_spec: str, step_seq: int) -> dict[str, Any]:
  """The three modes of 5. for one size, `repeats` times in rotated order; raw samples."""
  t_start = time.perf_counter()
  model_cfg = model_config(size)
  setup = train_setup(model_cfg, mesh_lib.make_mesh(mesh_spec), step_seq)
  state0 = random_state(setup)
  batch = setup.batch_fn(packing.random_packed_batch(
      8, step_seq, docs_per_row=2, vocab_size=model_cfg.vocab_size))
  fresh = jax.jit(lambda s: jax.tree.map(jnp.copy, s), out_shardings=setup.state_sh)
  state = fresh(state0)
  for _ in range(2):  # compile + warm up (the step donates its input: a copy of state0)
    state, _ = setup.train_fn(state, batch)
  jax.block_until_ready(state)
  del state
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(setup.abstract.params))
  out: dict[str, Any] = dict(size=size, params=n_params, bytes=state_bytes(state0),
                             mesh=mesh_spec, step_rows=8, step_seq=step_seq, steps=steps,
                             every=every, keep=keep, checkpoints=steps // every,
                             runs={m: [] for m in RUN_MODES}, order=[])
  log(f"{size}: {n_params / 1e6:.1f}M params on {mesh_spec}, {steps} steps of 8 x {step_seq} "
      f"tokens a mode ({time.perf_counter() - t_start:.0f}s to build)")
  for r in range(repeats):
    order = RUN_MODES[r % len(RUN_MODES):] + RUN_MODES[:r % len(RUN_MODES)]
    out["order"].append(list(order))
    for mode in order:
      directory = os.path.join(disk_dir, f"{size}.{mode}.{r}")
      ckpt = None if mode == "none" else Checkpointer(directory, keep=keep,
                                                      async_save=mode == "async")
      state = jax.block_until_ready(fresh(state0))
      os.sync()  # the previous mode's writes do not land in this one
      busy0, own0 = metrics_lib.host_cpu_seconds(), _own_cpu_s()
      try:
        state, sample = train_run(setup, state, batch, steps=steps, every=every, ckpt=ckpt,
                                  sync=mode == "sync")
      finally:
        if ckpt is not None:
          ckpt.close()
        shutil.rmtree(directory, ignore_errors=True)
      sample["other_processes_cpu_share"] = _other_share(busy0, own0)
      out["runs"][mode].append(sample)
      del state
      log(f"{size}: repeat {r + 1}/{repeats}, {mode}: {sample['wall_s']:.1f}s "
          f"(steps done at {sample['steps_s']:.1f}s), loss {sample['loss']:.4f}")
  out["seconds"] = time.perf_counter() - t_start
  return out


def check_run_args(sizes, *, steps: int, every: int, repeats: int, keep: int) -> None:
  """Raises ValueError (one line) for arguments --part=run cannot measure."""
  for size in sizes:
    model_config(size)
  if repeats < 1 or steps < 1 or not 1 <= every <= steps or keep < 1:
    raise ValueError(f"--repeats={repeats}, --run_steps={steps}, --every={every}, --keep={keep}: "
                     "need repeats, run_steps, keep >= 1 and 1 <= every <= run_steps")


def run_training(sizes, *, steps: int = 100, every: int = 10, repeats: int = 3, keep: int = 3,
                 disk_dir: str = "", mesh_spec: str = "fsdp=8", step_seq: int = 64,
                 json_path: str = "") -> dict[str, Any]:
  """5. for every size, in a fresh temporary directory (removed at the end); returns (and
  writes to `json_path`) every sample."""
  check_run_args(sizes, steps=steps, every=every, repeats=repeats, keep=keep)
  load0, busy0, own0 = os.getloadavg(), metrics_lib.host_cpu_seconds(), _own_cpu_s()
  disk = tempfile.mkdtemp(prefix="bench_checkpoint.", dir=disk_dir or None)
  result = _started(repeats, disk, load0)
  try:
    for size in sizes:
      result["sizes"].append(measure_run(size, steps=steps, every=every, repeats=repeats,
                                         keep=keep, disk_dir=disk, mesh_spec=mesh_spec,
                                         step_seq=step_seq))
  finally:
    shutil.rmtree(disk, ignore_errors=True)
  return _finished(result, busy0, own0, json_path)


def _spread_s(xs, fmt: str = "{:.1f} s") -> str:
  return f"{fmt.format(_med(xs))} [{fmt.format(min(xs))}, {fmt.format(max(xs))}]"


def run_table(result: dict[str, Any]) -> str:
  """One markdown row per size and mode: wall time, tokens/s, cost per checkpoint."""
  lines = ["| state | mode | wall time, 100 steps | tokens/s | cost per checkpoint (vs none) "
           "| save() returns | other processes' CPU |",
           "|---|---|---:|---:|---:|---:|---:|"]
  names = {"none": "no checkpoints", "async": "async save every {every}",
           "sync": "sync save every {every} (committed before the next step)"}
  for s in result["sizes"]:
    lines[0] = lines[0].replace("100 steps", f"{s['steps']} steps")
    tokens = s["steps"] * s["step_rows"] * s["step_seq"]
    base = [x["wall_s"] for x in s["runs"]["none"]]
    for mode in RUN_MODES:
      runs = s["runs"][mode]
      wall = [x["wall_s"] for x in runs]
      cost = blocks = ""
      if mode != "none":
        cost = _spread([(w - b) / s["checkpoints"] for w, b in zip(wall, base)])
        blocks = _spread([t for x in runs for t in x["block_s"]])
      shares = [x["other_processes_cpu_share"] for x in runs
                if x["other_processes_cpu_share"] is not None]
      every = f"{s['every']} steps" if s["every"] > 1 else "step"
      lines.append(f"| {_size_label(s)} | {names[mode].format(every=every)} | "
                   f"{_spread_s(wall)} | {_spread_s([tokens / w for w in wall], '{:,.0f}')} | "
                   f"{cost} | {blocks} | {f'{_med(shares):.0%}' if shares else ''} |")
  checks = "; ".join(
      f"{s['size']}: {s['steps']} steps of 8 x {s['step_seq']} tokens, {s['checkpoints']} "
      f"checkpoints a run, every mode's loss after the last step "
      + ("identical" if len({x["loss"] for m in RUN_MODES for x in s["runs"][m]}) == 1
         else "DIFFERENT") + f" ({s['runs']['none'][0]['loss']:.4f}); every sync save "
      "committed before the next step: "
      f"{all(c for x in s['runs']['sync'] for c in x['committed_at_return'])}; orders "
      + ", ".join("/".join(o) for o in s["order"]) for s in result["sizes"])
  lines += ["", f"Checks: {checks}. {_load_note(result)}"]
  return "\n".join(lines)

"""One compilation per program shape: a compiled program run on other devices.

jax compiles a jitted program once per device assignment, so the same program over
another set of devices (an HDP ring on another block of slots) compiles again. An XLA
executable names its devices only through its assignment: the backend's
`deserialize_executable`, which jax's persistent compilation cache loads with, takes a new
one. `Programs` compiles a program once per shape (mesh shape, argument shapes) and loads
that executable onto each other mesh of the same shape, or compiles per mesh where it
cannot (another jax's internals), so results never depend on it.

Only a fresh compile is loaded elsewhere: XLA:CPU serializes an executable that jax's
persistent compilation cache loaded without its kernels (run elsewhere: "NOT_FOUND:
Function add_multiply_fusion not found", jax 0.10.2), so one served by that cache runs
where it was compiled for and the shape's next fresh compile becomes its source.
"""
from __future__ import annotations

import functools
import threading
from typing import Any, Callable

import jax
import numpy as np
from absl import logging
from jax.sharding import Mesh, NamedSharding

# What an unsupported relocation raises (a missing or changed jax internal, a runtime error).
_UNSUPPORTED = (AttributeError, ImportError, NotImplementedError, RuntimeError, TypeError,
                ValueError)


# jax's event for a program its persistent compilation cache served (jax.monitoring).
_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_hits = threading.local()


def _count_hit(event: str, **kwargs) -> None:
  del kwargs
  if event == _CACHE_HIT:
    _hits.count = getattr(_hits, "count", 0) + 1


@functools.cache
def _listen() -> None:
  jax.monitoring.register_event_listener(_count_hit)


def compile_fresh(jitted, args) -> tuple[Any, bool]:
  """(`jitted` compiled for `args`, whether compiled here: not served by jax's persistent
  cache)."""
  _listen()
  before = getattr(_hits, "count", 0)
  compiled = jitted.lower(*args).compile()
  return compiled, getattr(_hits, "count", 0) == before


class Programs:
  """Jitted functions that differ only in their mesh (the same function and shardings on
  meshes of one shape), run as one compiled program per shape: `programs(jitted, mesh,
  *args)` runs `jitted` (a `jax.jit` over `mesh`) on args."""

  def __init__(self):
    # shape -> a fresh program, ready to load onto the shape's other meshes.
    self._sources: dict[tuple, Source] = {}
    self._loaded: dict[tuple, Callable] = {}  # (shape, devices) -> program there
    # Programs compiled here, served by jax's persistent cache, and relocated.
    self.compiles, self.cache_loads, self.relocations = 0, 0, 0
    self.relocating = True  # until a relocation fails

  def __call__(self, jitted, mesh: Mesh, *args):
    key = shape_key(mesh, args)
    here = (key, tuple(d.id for d in mesh.devices.flat))
    if here not in self._loaded:
      self._loaded[here] = self._load(key, jitted, mesh, args)
    return self._loaded[here](*args)

  def _load(self, key, jitted, mesh: Mesh, args) -> Callable:
    if key in self._sources and self.relocating:
      try:
        program = self._sources[key].onto(mesh)
        self.relocations += 1
        return program
      except _UNSUPPORTED as e:
        logging.warning("relocate: compiling per mesh from now on; relocation failed: %r", e)
        self.relocating = False
    compiled, fresh = compile_fresh(jitted, args)
    if not fresh:
      self.cache_loads += 1
      return compiled
    self.compiles += 1
    if self.relocating:
      try:
        self._sources[key] = Source(compiled, mesh, args)
      except _UNSUPPORTED as e:
        logging.warning("relocate: compiling per mesh from now on; cannot relocate: %r", e)
        self.relocating = False
    return compiled


def shape_key(mesh: Mesh, args) -> tuple:
  """What a program of `Programs` compiles for, besides its devices."""
  leaves, tree = jax.tree.flatten(args)
  return (mesh.axis_names, mesh.devices.shape, tree,
          tuple((np.shape(x), x.dtype) for x in leaves))


class Source:
  """A fresh compiled program over `mesh` for arguments shaped as `args`, serialized once
  to load onto other meshes of its shape (`onto`). Raises one of `_UNSUPPORTED` where it
  cannot."""

  def __init__(self, compiled, mesh: Mesh, args):
    # pylint: disable=protected-access
    executable = compiled._executable
    if compiled._params.const_args:  # arrays on `mesh`'s devices, passed as arguments
      raise NotImplementedError("constants passed as arguments")
    tree = jax.tree.structure((args, {}))
    if tree != compiled.in_tree:
      raise TypeError(f"arguments {tree} are not the program's {compiled.in_tree}")
    self.kept = sorted(executable._kept_var_idx)  # jit drops unused arguments
    runtime = compiled.runtime_executable()
    parameters = len(runtime.get_parameter_layouts())
    if parameters != len(self.kept):
      raise ValueError(f"{parameters} parameters, {len(self.kept)} inputs")
    place = {d.id: i for i, d in enumerate(mesh.devices.flat)}
    self.places = [place[d.id] for d in runtime.local_devices()]  # the assignment's order
    self.mesh, self.backend = mesh, runtime.local_devices()[0].client
    self.serialized = self.backend.serialize_executable(runtime)
    self.in_sh, self.out_sh = executable._in_shardings, executable._out_shardings
    self.out_avals, self.out_tree = executable.out_avals, compiled.out_tree

  def onto(self, mesh: Mesh) -> Callable:
    """The program as a function over `mesh`: its executable loaded with `mesh`'s devices
    in the source mesh's devices' places."""
    # pylint: disable=import-outside-toplevel
    from jax._src import compiler
    from jax._src.lib import xla_client as xc
    devices = [mesh.devices.flat[i] for i in self.places]
    options = compiler.get_compile_options(num_replicas=1, num_partitions=len(devices),
                                           device_assignment=np.array([devices]))
    loaded = self.backend.deserialize_executable(self.serialized,
                                                 xc.DeviceList(tuple(devices)), options)
    if list(loaded.local_devices()) != devices:
      raise ValueError(f"loaded on {loaded.local_devices()}, not {devices}")
    in_sh = [_moved(s, self.mesh, mesh) for s in self.in_sh]
    out_sh = [_moved(s, self.mesh, mesh) for s in self.out_sh]
    kept, out_avals, out_tree = self.kept, self.out_avals, self.out_tree

    def run(*args):
      leaves = jax.tree.leaves(args)
      # Already there, as the jitted function's inputs are: no copy (donation keeps them).
      inputs = [jax.device_put(leaves[i], s) for i, s in zip(kept, in_sh)]
      outs = loaded.execute_sharded(inputs).disassemble_into_single_device_arrays()
      return jax.tree.unflatten(out_tree, [
          jax.make_array_from_single_device_arrays(a.shape, s, shards)
          for a, s, shards in zip(out_avals, out_sh, outs)])
    return run


def _moved(sharding, source: Mesh, mesh: Mesh) -> NamedSharding:
  """`sharding` over `source` as the same over `mesh`."""
  if not isinstance(sharding, NamedSharding) or sharding.mesh != source:
    raise TypeError(f"{sharding} is not a NamedSharding over the program's mesh")
  return NamedSharding(mesh, sharding.spec, memory_kind=sharding.memory_kind)

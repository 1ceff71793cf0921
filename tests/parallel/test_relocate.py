"""relocate.Programs: one compile per program shape, the same results on every mesh."""
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxsys.parallel import relocate


def ring(mesh: Mesh):
  """A ring hop over `mesh`'s axis `c` with a donated sum and an argument it drops."""
  n = mesh.shape["c"]

  def fn(x, acc, unused):
    del unused
    hop = jax.shard_map(lambda a: jax.lax.ppermute(a, "c", [(i, (i + 1) % n) for i in range(n)]),
                        mesh=mesh, in_specs=P("c"), out_specs=P("c"))
    y = hop(x) * jnp.arange(x.size, dtype=x.dtype)
    return {"sum": acc + jnp.sin(y).sum(), "y": y}
  split, rep = NamedSharding(mesh, P("c")), NamedSharding(mesh, P())
  return jax.jit(fn, in_shardings=(split, rep, rep), out_shardings={"sum": rep, "y": split},
                 donate_argnums=1)


def inputs(mesh: Mesh, size: int, seed: int):
  x = np.random.default_rng(seed).standard_normal(size).astype(np.float32)
  rep = NamedSharding(mesh, P())
  return (jax.device_put(x, NamedSharding(mesh, P("c"))), jax.device_put(jnp.float32(seed), rep),
          jax.device_put(jnp.zeros(3), rep))


# Blocks of 4 devices (one in reverse order) and of 2: two shapes.
BLOCKS = [(0, 1, 2, 3), (4, 5, 6, 7), (6, 4, 2, 0), (0, 1), (6, 7), (2, 3)]


def mesh_of(block) -> Mesh:
  return Mesh(np.array([jax.devices()[i] for i in block]), ("c",))


class ProgramsTest(absltest.TestCase):

  def run_blocks(self, programs, size: int, blocks=BLOCKS):
    """Each block's results through `programs` and compiled for the block, as numpy (a
    size of its own per test: the tests share jax's persistent cache, tests/conftest.py)."""
    out = []
    for seed, block in enumerate(blocks):
      mesh, fn = mesh_of(block), ring(mesh_of(block))
      got = programs(fn, mesh, *inputs(mesh, size, seed))
      self.assertEqual(got["y"].sharding, NamedSharding(mesh, P("c")))
      self.assertEqual({s.device for s in got["sum"].addressable_shards}, set(mesh.devices.flat))
      args = inputs(mesh, size, seed)
      want = fn(*args)
      self.assertTrue(args[1].is_deleted())  # donated, as the jitted function's is
      out.append((jax.device_get(got), jax.device_get(want)))
    return out

  def test_one_compile_per_shape_and_the_block_compiled_results(self):
    programs = relocate.Programs()
    for got, want in self.run_blocks(programs, 16):
      np.testing.assert_array_equal(got["y"], want["y"])
      np.testing.assert_array_equal(got["sum"], want["sum"])
    self.assertEqual((programs.compiles, programs.relocations), (2, len(BLOCKS) - 2))
    self.assertTrue(programs.relocating)

  def test_a_failed_relocation_compiles_per_mesh(self):
    onto = relocate.Source.onto

    def unsupported(*args):
      raise AttributeError("another jax")
    relocate.Source.onto = unsupported
    try:
      programs = relocate.Programs()
      with self.assertLogs("absl", level="WARNING") as logs:
        results = self.run_blocks(programs, 32)
    finally:
      relocate.Source.onto = onto
    for got, want in results:
      np.testing.assert_array_equal(got["y"], want["y"])
    self.assertEqual((programs.compiles, programs.relocations), (len(BLOCKS), 0))
    self.assertLen(logs.records, 1)

  @absltest.skipIf(jax.config.jax_compilation_cache_dir is None, "no persistent cache")
  def test_a_program_from_the_persistent_cache_runs_only_where_compiled(self):
    """It re-serializes without its kernels: the shape's next fresh compile is the source."""
    self.run_blocks(relocate.Programs(), 48, BLOCKS[:1])  # into the cache
    programs = relocate.Programs()
    for got, want in self.run_blocks(programs, 48, BLOCKS[:3]):
      np.testing.assert_array_equal(got["y"], want["y"])
      np.testing.assert_array_equal(got["sum"], want["sum"])
    self.assertEqual((programs.cache_loads, programs.compiles, programs.relocations), (1, 1, 1))

  def test_refuses_arguments_the_program_does_not_take(self):
    # A size no other test compiles: at 16 this compile, cached, served another worker's
    # first block from the persistent cache, one relocation fewer there (a flaky count).
    mesh = mesh_of(BLOCKS[0])
    compiled = ring(mesh).lower(*inputs(mesh, 8, 0)).compile()
    with self.assertRaisesRegex(TypeError, "not the program's"):
      relocate.Source(compiled, mesh, inputs(mesh, 8, 0)[:2])


if __name__ == "__main__":
  absltest.main()

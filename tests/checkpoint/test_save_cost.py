"""What a save costs beyond its bytes: no program per array for small replicated arrays."""
import logging

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxsys.checkpoint.manager import MIN_REPLICA_SLICE_BYTES, Checkpointer


def test_small_replicated_arrays_are_saved_whole_from_one_replica(tmp_path, caplog):
  """orbax would split every array replicated over the 8 devices into 8 slices, one slice
  program per shape and a dispatch per shard (72 programs for the test model's first
  save). Below MIN_REPLICA_SLICE_BYTES a slice, one replica writes the whole array; the
  state restores the same either way."""
  replicated = NamedSharding(jax.make_mesh((8,), ("data",)), P())
  # Shapes no other test slices: a program compiled before would not be lowered again.
  state = {f"w{i}": jax.device_put(jnp.arange(8 * 37 * (i + 3), dtype=jnp.float32)
                                   .reshape(8 * (i + 3), 37), replicated) for i in range(3)}
  assert all(x.nbytes // 8 < MIN_REPLICA_SLICE_BYTES for x in state.values())
  ckpt = Checkpointer(str(tmp_path))
  try:
    with jax.log_compiles(), caplog.at_level(logging.WARNING):
      ckpt.save(1, state, data={}, meta={})
      ckpt.wait()
    lowered = [r.getMessage() for r in caplog.records if "MLIR module conversion" in r.getMessage()]
    assert not [m for m in lowered if "jit(slice)" in m], lowered
    restored, _ = ckpt.restore(1, state)
  finally:
    ckpt.close()
  for name, x in state.items():
    np.testing.assert_array_equal(restored[name], x)

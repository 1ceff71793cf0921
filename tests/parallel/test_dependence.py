"""dependence.depends_on: which residuals of a vjp are functions of the weights alone."""
import jax
import jax.numpy as jnp

from jaxsys.parallel import dependence


def test_plain_and_scanned_functions():
  def fn(w, x):
    a = w.reshape(4, 2).T  # weights only
    b = x @ w  # data
    def body(c, wi):
      return c * wi + jnp.sum(x), (wi * 2.0, c)  # ys: weight-only, carry-dependent
    carry, (ws, cs) = jax.lax.scan(body, jnp.zeros(()), w.reshape(-1))
    return a, b, carry, ws, cs, jnp.sin(w)

  w, x = jnp.ones((8,)), jnp.ones((3, 8))
  assert dependence.depends_on(fn, (w, x), (False, True)) == [False, True, True, False, True, False]


def test_vjp_residuals_of_a_layer():
  def residuals(w, x):
    return jax.tree.leaves(jax.vjp(lambda w, x: jnp.tanh(x @ w.reshape(8, 8)), w, x)[1])

  w, x = jnp.ones((64,)), jnp.ones((3, 8))
  data = dependence.depends_on(residuals, (w, x), (False, True))
  shapes = [leaf.shape for leaf in residuals(w, x)]
  # The reshaped weight is not data; the activations are.
  assert [s for s, d in zip(shapes, data) if not d] == [(8, 8)]
  assert all(d for s, d in zip(shapes, data) if s != (8, 8))

"""Decoding with a KV cache against the full-sequence model re-run at every step."""
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import absltest, parameterized
from jax.sharding import PartitionSpec as P

from jaxsys import mesh as mesh_lib
from jaxsys.kernels import quant_matmul as qm
from jaxsys.models import generate as gen
from jaxsys.models import transformer
from jaxsys.quant import ptq, rules

CFG = transformer.TransformerConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                    d_ff=64)
MIXED_RULES = (rules.Rule("layers/(wq|wk|wv)", "w8a8_int8"),  # every format in one model
               rules.Rule("layers/(wo|w_gate)", "w8a8_fp8"),
               rules.Rule("layers/(w_up|w_down)", "w4a16", group_size=16),
               rules.Rule("unembedding", "w8a8_int8"))
LENGTHS = (5, 9, 1, 7)  # one batch, prompts of different lengths
NEW = 6


def _cfg(**kw):
  return transformer.TransformerConfig(**{**CFG.__dict__, **kw})


@functools.lru_cache(maxsize=None)
def _params(cfg):
  return transformer.init_params(cfg, jax.random.key(0))


def _prompts(padding="right", lengths=LENGTHS, vocab=CFG.vocab_size):
  rng = np.random.default_rng(1)
  rows = [rng.integers(0, vocab, n).tolist() for n in lengths]
  return rows, *gen.pad_prompts(rows, padding, pad_id=3)


def _reference(cfg, params, rows, tokens, impl="auto"):
  """Logits [B, N, V] of the full model re-run on prompt + tokens[:, :i] at every step i."""
  n = tokens.shape[1]
  width = max(map(len, rows)) + n
  apply = jax.jit(lambda p, x: transformer.apply(cfg, p, x))
  out = []
  for i in range(n):
    seqs = [list(r) + list(t[:i]) for r, t in zip(rows, np.asarray(tokens))]
    batch = np.array([s + [0] * (width - len(s)) for s in seqs], np.int32)  # causal: padding after
    with transformer.qmatmul_impl(impl):
      logits = apply(params, batch)
    out.append(np.stack([logits[b, len(s) - 1] for b, s in enumerate(seqs)]))
  return np.stack(out, axis=1)


class GenerateTest(parameterized.TestCase):

  @parameterized.parameters(
      dict(kv_heads=2, padding="right"),  # GQA
      dict(kv_heads=2, padding="left"),
      dict(kv_heads=1, padding="right"),  # MQA
      dict(kv_heads=2, padding="right", attention="pallas"),  # the kernel, interpreted on CPU
  )
  def test_greedy_equals_full_recompute(self, kv_heads, padding, attention="auto"):
    cfg = _cfg(n_kv_heads=kv_heads, attention_impl=attention)
    params = _params(cfg)
    rows, prompts, lengths = _prompts(padding)
    out = gen.generate(cfg, params, prompts, lengths, max_new_tokens=NEW, padding=padding,
                       return_logits=True)
    chex.assert_shape(out.tokens, (len(rows), NEW))
    chex.assert_type(out.tokens, jnp.int32)
    ref = _reference(cfg, params, rows, out.tokens)
    np.testing.assert_allclose(out.logits, ref, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(out.tokens, ref.argmax(-1))
    np.testing.assert_array_equal(out.lengths, [NEW] * len(rows))
    if padding == "right":  # the benchmark's baseline decoder gives the same tokens
      base = gen.greedy_without_cache(cfg, params, prompts, lengths, max_new_tokens=NEW)
      np.testing.assert_array_equal(base.tokens, out.tokens)

  def test_cache_longer_than_needed_and_eos(self):
    rows, prompts, lengths = _prompts()
    params = _params(CFG)
    free = gen.generate(CFG, params, prompts, lengths, max_new_tokens=NEW)
    eos = int(free.tokens[0, 2])  # row 0 emits it at step 2
    out = gen.generate(CFG, params, prompts, lengths, max_new_tokens=NEW, max_len=40, eos_id=eos)
    for b in range(len(rows)):
      hits = np.flatnonzero(np.asarray(free.tokens[b]) == eos)
      stop = hits[0] + 1 if hits.size else NEW
      self.assertEqual(int(out.lengths[b]), stop)
      np.testing.assert_array_equal(out.tokens[b, :stop], free.tokens[b, :stop])
      np.testing.assert_array_equal(out.tokens[b, stop:], eos)  # after EOS: EOS again
    self.assertLessEqual(int(out.lengths[0]), 3)

  @parameterized.parameters(*[dict(scheme=s, impl="xla") for s in (*qm.SCHEMES, "mixed")],
                            dict(scheme="mixed", impl="pallas"))
  def test_quantized_matches_its_own_full_recompute(self, scheme, impl):
    # The LM head too: the quantized unembedding runs through qmatmul as well. "mixed" has
    # all three formats in one model (one compile for the slow interpret-mode kernels).
    rule_set = MIXED_RULES if scheme == "mixed" else rules.default_rules(scheme, group_size=16,
                                                                          head=True)
    q = ptq.quantize_params(CFG, _params(CFG), rule_set)
    self.assertEqual({w.scheme for w in q["layers"].values() if isinstance(w, qm.QWeight)},
                     set(qm.SCHEMES) if scheme == "mixed" else {scheme})
    rows, prompts, lengths = _prompts()
    out = gen.generate(CFG, q, prompts, lengths, max_new_tokens=3, qmatmul_impl=impl,
                       return_logits=True)
    ref = _reference(CFG, q, rows, out.tokens, impl=impl)
    np.testing.assert_allclose(out.logits, ref, atol=1e-4, rtol=1e-4)
    jaxpr = jax.make_jaxpr(lambda q: gen.generate(CFG, q, prompts, lengths, max_new_tokens=3,
                                                  qmatmul_impl=impl).tokens)(q)
    self.assertEqual("pallas_call" in str(jaxpr), impl == "pallas")
    np.testing.assert_array_equal(out.tokens, ref.argmax(-1))

  def test_bf16_compute(self):
    cfg = _cfg(dtype="bfloat16")
    params = _params(cfg)
    rows, prompts, lengths = _prompts()
    out = gen.generate(cfg, params, prompts, lengths, max_new_tokens=4, return_logits=True)
    ref = _reference(cfg, params, rows, out.tokens)
    # bf16 activations: one decode step's sums are not the full pass's, bit for bit.
    np.testing.assert_allclose(out.logits, ref, atol=5e-2, rtol=5e-2)
    np.testing.assert_array_equal(out.tokens, ref.argmax(-1))

  def test_sampling(self):
    rows, prompts, lengths = _prompts()
    params = _params(CFG)
    run = lambda key, **kw: gen.generate(CFG, params, prompts, lengths, key, max_new_tokens=NEW,
                                         return_logits=True, sampling=gen.Sampling(**kw))
    greedy = run(None)
    a = run(jax.random.key(1), temperature=1.0)
    np.testing.assert_array_equal(a.tokens, run(jax.random.key(1), temperature=1.0).tokens)
    self.assertFalse(np.array_equal(a.tokens, run(jax.random.key(2), temperature=1.0).tokens))
    self.assertFalse(np.array_equal(a.tokens, greedy.tokens))
    np.testing.assert_array_equal(run(jax.random.key(1), temperature=0.7, top_k=1).tokens,
                                  greedy.tokens)
    # Every drawn token is among its step's top k, and inside its nucleus.
    k = run(jax.random.key(3), temperature=2.0, top_k=3)
    top3 = np.argsort(-np.asarray(k.logits), axis=-1)[..., :3]
    self.assertTrue(np.all((top3 == np.asarray(k.tokens)[..., None]).any(-1)))
    p = run(jax.random.key(4), temperature=1.0, top_p=0.5)
    probs = np.asarray(jax.nn.softmax(p.logits, axis=-1))
    chosen = np.take_along_axis(probs, np.asarray(p.tokens)[..., None], -1)
    more_likely = np.where(probs > chosen, probs, 0).sum(-1)
    self.assertTrue(np.all(more_likely < 0.5))

  def test_the_decode_loop_carries_no_stacked_layer_array(self):
    """The weights and caches enter the loop one array a layer: the loop's state holds no
    [layers, ...] stack that each step would slice a layer out of (a copy of every layer's
    weights each step on XLA:CPU, docs/results/generation.md)."""
    cfg = _cfg(n_layers=3)
    params = _params(cfg)
    _, prompts, lengths = _prompts()
    fn = gen._compiled(cfg, NEW, prompts.shape[1] + NEW, gen.Sampling(), None, "auto", False,
                       None)
    text = fn.lower(params, prompts, lengths, jax.random.key(0)).compile().as_text()
    tokens = f"s32[{prompts.shape[0]},{NEW}]"  # the decode loop's output buffer
    (state,) = [line.split(" while(")[0] for line in text.splitlines()
                if " while(" in line and tokens in line.split(" while(")[0]]
    shape = lambda dims: f"[{','.join(map(str, dims))}]"
    layers = params["layers"]
    self.assertFalse([k for k, w in layers.items() if shape(w.shape) in state], state[:400])
    self.assertIn(shape(layers["w_up"].shape[1:]), state)  # each layer's own weight
    self.assertEqual(state.count(shape((prompts.shape[0], prompts.shape[1] + NEW, 2, 8))),
                     2 * cfg.n_layers)  # each layer's own K and V cache

  def test_each_step_draws_from_fold_in_key_i(self):
    """Step i's tokens are categorical(fold_in(key, i)) of its logits tempered, cut to the
    top k and then to the nucleus, with the masks computed here in numpy."""
    rows, prompts, lengths = _prompts()
    key, t, top_k, top_p = jax.random.key(7), 0.8, 5, 0.9
    out = gen.generate(CFG, _params(CFG), prompts, lengths, key, max_new_tokens=NEW,
                       return_logits=True,
                       sampling=gen.Sampling(temperature=t, top_k=top_k, top_p=top_p))
    for i in range(NEW):
      logits = np.asarray(out.logits[:, i], np.float32) / np.float32(t)
      order = np.argsort(-logits, axis=-1, kind="stable")
      ranked = np.take_along_axis(logits, order, -1)
      probs = np.exp(ranked - ranked[:, :1])
      probs[:, top_k:] = 0
      probs /= probs.sum(-1, keepdims=True)
      keep = np.zeros_like(ranked, bool)
      keep[:, :top_k] = (np.cumsum(probs, -1) - probs)[:, :top_k] < top_p
      masked = np.full_like(logits, -np.inf)
      np.put_along_axis(masked, order, np.where(keep, ranked, -np.inf), -1)
      want = jax.random.categorical(jax.random.fold_in(key, i), jnp.asarray(masked), axis=-1)
      np.testing.assert_array_equal(out.tokens[:, i], want, err_msg=f"step {i}")

  def test_sharded_equals_unsharded(self):
    self._sharded_equals_unsharded(scheme=None, impl="xla")

  @pytest.mark.slow
  def test_sharded_quantized_pallas_equals_unsharded(self):
    self._sharded_equals_unsharded(scheme="w4a16", impl="pallas")

  @pytest.mark.slow
  def test_fewer_kv_heads_than_tensor_equals_unsharded(self):
    """2 K/V heads on tensor=4: the weights and the cache keep both on every tensor shard,
    the Pallas kernel repeats each to its query heads' shard."""
    self._sharded_equals_unsharded(scheme=None, impl="pallas", spec="data=2,tensor=4",
                                   devices=8)

  def _sharded_equals_unsharded(self, scheme, impl, spec="data=2,tensor=2", devices=4):
    cfg = _cfg(attention_impl=impl)  # pallas: both kernels, under shard_map over the mesh
    params = _params(cfg)
    if scheme:
      params = ptq.quantize_params(cfg, params, rules.default_rules(scheme, group_size=16))
    rows, prompts, lengths = _prompts()
    mesh = mesh_lib.make_mesh(spec, jax.devices()[:devices])
    placed = gen.shard_params(cfg, params, mesh)
    wq = placed["layers"]["wq"]
    self.assertEqual((wq.data if scheme else wq).sharding.spec,
                     P(None, None, "tensor") if scheme else P(None, None, "tensor", None))
    if not scheme:  # K/V heads split where tensor divides them, else whole on every shard
      kv_spec = P(None, None, "tensor" if cfg.n_kv_heads % dict(mesh.shape)["tensor"] == 0
                  else None, None)
      self.assertEqual(placed["layers"]["wk"].sharding.spec, kv_spec)
    kw = dict(max_new_tokens=NEW, return_logits=True, qmatmul_impl=impl,
              sampling=gen.Sampling(temperature=1.0, top_k=20))
    want = gen.generate(cfg, params, prompts, lengths, jax.random.key(5), **kw)
    got = gen.generate(cfg, placed, prompts, lengths, jax.random.key(5), mesh=mesh, **kw)
    self.assertEqual(got.tokens.sharding.spec[0], "data")
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_allclose(got.logits, want.logits, atol=1e-5, rtol=1e-5)

  @parameterized.parameters(
      (dict(max_len=10), "the prompt (9 tokens, the longest row's padded width) + "
       "max_new_tokens=6 = 15 does not fit max_len=10 (the KV cache's length); use max_len >= 15"),
      (dict(max_new_tokens=0), "max_new_tokens=0 must be an int >= 1"),
      (dict(sampling=dict(top_p=0.0)), "top_p=0.0 must be a number in (0, 1] (1: off)"),
      (dict(sampling=dict(top_p=1.5)), "top_p=1.5 must be a number in (0, 1] (1: off)"),
      (dict(sampling=dict(temperature=-1.0)), "temperature=-1.0 must be a number >= 0 (0: greedy)"),
      (dict(sampling=dict(top_k=-2)), "top_k=-2 must be an int >= 0 (0: off)"),
      (dict(sampling=dict(top_k=65)), "top_k=65 must be in [0, 64] (the model's vocab_size"),
      (dict(sampling=dict(temperature=1.0)), "temperature > 0 needs a key"),
      (dict(padding="middle"), "padding='middle' is not known; choose one of ('right', 'left')"),
      (dict(qmatmul_impl="cuda"), "qmatmul_impl='cuda' is not known; choose one of ('auto', "),
      (dict(eos_id=64), "eos_id=64 must be an int in [0, 63]"),
      (dict(lengths=[5, 10, 1, 7]), "lengths must be in [1, T=9] (the prompts' width)"),
      (dict(lengths=[5, 9, 1]), "lengths must be an int array [B=4]"),
      (dict(prompts=np.full((4, 9), 64)),
       "prompt tokens must be in [0, 64) (the model's vocab_size)"),
  )
  def test_bad_input_is_one_line(self, kwargs, message):
    _, prompts, lengths = _prompts()
    args = {**dict(prompts=prompts, lengths=lengths, max_new_tokens=NEW), **kwargs}
    with self.assertRaises(ValueError) as e:
      if isinstance(args.get("sampling"), dict):
        args["sampling"] = gen.Sampling(**args["sampling"])
      gen.generate(CFG, _params(CFG), **args)
    self.assertIn(message, str(e.exception))
    self.assertNotIn("\n", str(e.exception))

  def test_a_mesh_that_does_not_divide_the_batch_is_one_line(self):
    _, prompts, lengths = _prompts(lengths=(5, 9, 1))
    mesh = mesh_lib.make_mesh("data=2,tensor=2", jax.devices()[:4])
    with self.assertRaisesRegex(ValueError, r"^logical axis 'batch' \(dim 0 of shape \(3, 15, 2, 8\)\) "
                                r"has size 3, not divisible by mesh axes data=2"):
      gen.generate(CFG, _params(CFG), prompts, lengths, max_new_tokens=NEW, mesh=mesh)


if __name__ == "__main__":
  absltest.main()

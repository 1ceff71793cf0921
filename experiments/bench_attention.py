r"""Benchmarks attention impls: time, TFLOP/s of unmasked work, compiled temp memory.

  python -m experiments.bench_attention --seq_lens=1024,2048,4096,8192 --heads=4 \
      --kv_heads=4 --packed --repeats=3 --out=/tmp/bench_attention.json

Times every impl (--impls) at every T, mode (causal, --packed, --doc_lens) and pass
(--passes) in interleaved rounds, after checking each against `reference_attention`;
prints a markdown table (and on CPU the issue's targets) and writes every number to --out.
What each impl, mode and number is: `jaxsys/bench/attention.py`.
"""
from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
from absl import app, flags

from jaxsys.bench import attention

_SEQ_LENS = flags.DEFINE_list("seq_lens", ["1024", "2048", "4096", "8192", "16384"],
                              "Sequence lengths T (= S).")
_HEAD_DIM = flags.DEFINE_integer("head_dim", 128, "Head dim D.")
_BATCH = flags.DEFINE_integer("batch", 1, "Batch size B.")
_HEADS = flags.DEFINE_integer("heads", 4, "Query heads Hq.")
_KV_HEADS = flags.DEFINE_integer("kv_heads", 4, "Key/value heads Hkv (divides Hq).")
_DTYPE = flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"],
                           "Default: bfloat16 on GPU/TPU, float32 on CPU.")
_IMPLS = flags.DEFINE_list("impls", None, "Subset of xla,pallas,cudnn_or_xla_dpa,jax_pallas,"
                           "tokamax_xla_chunked,tokamax_xla; default: those that run natively "
                           "on the backend.")
_PACKED = flags.DEFINE_bool("packed", False, "Also run packed documents (segment ids).")
_DOC_LENS = flags.DEFINE_list("doc_lens", [], "Also run rows packed with documents of exactly "
                              "these lengths (time should follow sum T_i^2).")
_PASSES = flags.DEFINE_list("passes", ["fwd", "fwd_bwd"], "Passes to time.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed calls per case (after one warm-up).")
_MAX_SECONDS = flags.DEFINE_float("max_seconds_per_case", 300.0,
                                  "Time budget of one (impl, T, mode, pass); see "
                                  "jaxsys/bench/attention.py.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of inputs and document lengths.")
_OUT = flags.DEFINE_string("out", None, "Optional JSON path with every number.")


def main(argv):
  del argv
  backend = jax.default_backend()
  dtype = _DTYPE.value or ("float32" if backend == "cpu" else "bfloat16")
  impl_names = _IMPLS.value or attention.default_impls()
  try:
    attention.check_impl_names(impl_names)
  except ValueError as e:
    sys.exit(f"error: {e}")
  result = attention.run(
      [int(t) for t in _SEQ_LENS.value], _BATCH.value, _HEADS.value, _KV_HEADS.value,
      _HEAD_DIM.value, jnp.dtype(dtype), impl_names, _PACKED.value, _PASSES.value,
      _REPEATS.value, _MAX_SECONDS.value, _SEED.value, [int(n) for n in _DOC_LENS.value])
  print()
  print(attention.markdown(result))
  if backend == "cpu":
    print()
    print("\n".join(attention.cpu_target(result) + attention.tokamax_target(result)))
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  app.run(main)

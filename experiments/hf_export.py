r"""Writes a training run's model as a Hugging Face Llama checkpoint.

  python -m experiments.hf_export --workdir=/tmp/jaxsys_tiny --out=/tmp/tiny_hf
  python -m experiments.hf_export --workdir=/tmp/jaxsys_tiny --out=/tmp/tiny_w4 --quantize=w4a16

The latest (or --step) checkpoint's parameters (replica 0's for a replica run), with
--quantize round-to-nearest quantized and dequantized (what the quantized model computes
with float activations), and the run's tokenizer (byte, its cached BPE, or its hf one):
safetensors + config.json + tokenizer.json that `transformers.AutoModelForCausalLM`
loads unchanged (jaxsys/cli/hf_runs.py, hf.py).
"""
import sys

from absl import app, flags

from jaxsys import metrics as metrics_lib
from jaxsys.cli import hf_runs
from jaxsys import fields

_WORKDIR = flags.DEFINE_string("workdir", None, "Workdir of a training run (experiments.train).")
_OUT = flags.DEFINE_string("out", None, "Directory to write the Hugging Face checkpoint into.")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
_QUANTIZE = flags.DEFINE_enum("quantize", "none", ["none", "w8a8_int8", "w8a8_fp8", "w4a16"],
                              "RTN-quantize the layer matmuls first, then write them dequantized.")
_GROUP = flags.DEFINE_integer("group_size", 128, "w4a16 group size (rows of K per scale).")
_DTYPE = flags.DEFINE_enum("dtype", None, ["float32", "bfloat16", "float16"],
                           "Tensor dtype in the files (default: the model's param_dtype).")
_SHARD_MB = flags.DEFINE_integer("max_shard_mb", 0, "Split the weights into files of at most "
                                 "this many MiB (0: one model.safetensors).")
flags.mark_flags_as_required(["workdir", "out"])


def main(argv):
  del argv
  metrics_lib.quiet_library_logs()
  try:
    for flag, rule in ((_STEP, fields.integer(0)), (_GROUP, fields.integer(1)),
                       (_SHARD_MB, fields.integer(0))):
      error = flag.value is not None and rule.error(f"--{flag.name}", flag.value)
      if error:
        raise ValueError(error)
    files = hf_runs.export_run(_WORKDIR.value, _OUT.value, step=_STEP.value,
                               quantize=_QUANTIZE.value, group_size=_GROUP.value,
                               dtype=_DTYPE.value, max_shard_bytes=_SHARD_MB.value * 2**20 or None)
  except ValueError as e:
    sys.exit(f"error: {e}")
  print("\n".join(files))


if __name__ == "__main__":
  app.run(main)

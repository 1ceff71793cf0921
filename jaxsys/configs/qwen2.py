"""Qwen2.5 at its published shapes: the Llama block with q/k/v biases.

  python -m experiments.compile --config=configs/qwen2.py:size=7b --topology=v5p-128 \
      --config.mesh=fsdp=64 --config.model.remat=full

Sizes `0.5b`, `1.5b`, `3b` (tied embeddings) and `7b`, from the models' published
`config.json`: d_model, layers, heads, kv heads, d_ff, vocabulary (151,936; 152,064 for 7B),
RoPE theta 1,000,000, RMSNorm eps 1e-6. Like configs/llama3.py's, they compute in bf16 over
float32 parameters, a global batch of 1M tokens (256 x 4096), and train on the byte-level
standard library of `tiny_lm`; a checkpoint on disk starts a run with
`--config.init_from=hf:<dir>`.
"""
import ml_collections

from jaxsys.configs import llama3, tiny_lm

SIZES = {
    #       d_model layers heads kv  d_ff   vocab   tied  seq   batch
    "0.5b": (896, 24, 14, 2, 4864, 151936, True, 4096, 256),
    "1.5b": (1536, 28, 12, 2, 8960, 151936, True, 4096, 256),
    "3b": (2048, 36, 16, 2, 11008, 151936, True, 4096, 256),
    "7b": (3584, 28, 28, 4, 18944, 152064, False, 4096, 256),
}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  args = tiny_lm.parse_args(arg, "qwen2", ("size",))
  size = args.get("size", "0.5b")
  if size not in SIZES:
    raise ValueError(f"configs/qwen2.py: size={size!r} is unknown; valid: {sorted(SIZES)}")
  return llama3.preset(SIZES[size], rope_theta=1_000_000.0, norm_eps=1e-6, qkv_bias=True)

"""Llama-3-style models at their published shapes, Mistral 7B, and a GPT-2-small-sized one.

  python -m experiments.compile --config=configs/llama3.py:size=8b --topology=v5p-128 \
      --config.mesh=fsdp=16,tensor=4
  python -m experiments.train --config=configs/llama3.py:size=gpt2 --config.total_steps=3 \
      --workdir=/tmp/jaxsys_gpt2

Sizes: `1b` and `3b` (Llama 3.2, tied embeddings), `8b` and `70b` (Llama 3.1), from the
models' published `config.json`: d_model, layers, heads, kv heads, d_ff, vocabulary
128,256, RoPE theta 500,000 with the `llama3` frequency scaling (factor 32 for 3.2, 8 for
3.1), RMSNorm eps 1e-5. `mistral-7b`: Mistral 7B v0.3 (a Llama without a sliding window:
vocabulary 32,768, RoPE theta 1,000,000). `gpt2`: GPT-2 small's width, depth, heads,
tied embeddings and (padded) vocabulary in this Llama-style block, SwiGLU's d_ff chosen
for GPT-2's 124M parameters. All compute in bf16 over float32 parameters and optimizer
state; `--config.model.remat=full` recomputes the forward in the backward (`minimal`: keep
every projection and the attention's output, recompute no matmul; `dots`, `qkv`: between;
jaxsys/models/remat.py).

The data are the byte-level standard library of `tiny_lm` (the embedding keeps the
published vocabulary's rows); the large sizes are for compiling (`experiments.compile`),
the small ones also train on CPU.
"""
import ml_collections

from jaxsys.configs import tiny_lm

SIZES = {
    #       d_model layers heads kv  d_ff   vocab   tied  seq   batch
    "gpt2": (768, 12, 12, 12, 2048, 50304, True, 1024, 8),
    "1b": (2048, 16, 32, 8, 8192, 128256, True, 8192, 128),
    "3b": (3072, 28, 24, 8, 8192, 128256, True, 8192, 128),
    "8b": (4096, 32, 32, 8, 14336, 128256, False, 8192, 128),
    "70b": (8192, 80, 64, 8, 28672, 128256, False, 8192, 128),
    "mistral-7b": (4096, 32, 32, 8, 14336, 32768, False, 8192, 128),
}
# The published rope_scaling (Llama 3.2: factor 32; 3.1: factor 8); GPT-2 has none.
_LLAMA3_ROPE = ("llama3:factor={},low_freq_factor=1,high_freq_factor=4,"
                "original_max_position_embeddings=8192")
ROPE_SCALING = {"gpt2": "", "1b": _LLAMA3_ROPE.format(32), "3b": _LLAMA3_ROPE.format(32),
                "8b": _LLAMA3_ROPE.format(8), "70b": _LLAMA3_ROPE.format(8), "mistral-7b": ""}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  args = tiny_lm.parse_args(arg, "llama3", ("size",))
  size = args.get("size", "8b")
  if size not in SIZES:
    raise ValueError(f"configs/llama3.py: size={size!r} is unknown; valid: {sorted(SIZES)}")
  theta = 1_000_000.0 if size == "mistral-7b" else 500_000.0
  return preset(SIZES[size], rope_theta=theta, rope_scaling=ROPE_SCALING[size], norm_eps=1e-5)


def preset(shape: tuple, **model) -> ml_collections.ConfigDict:
  """A published model's run: `shape` a row of SIZES' columns, `model` its other fields."""
  d_model, layers, heads, kv, d_ff, vocab, tied, seq_len, batch = shape
  c = tiny_lm.get_config("size=test")
  c.model.update(dict(vocab_size=vocab, d_model=d_model, n_layers=layers, n_heads=heads,
                      n_kv_heads=kv, d_ff=d_ff, tie_embeddings=tied, dtype="bfloat16",
                      param_dtype="float32", **model))
  # About 1M tokens a step (128 x 8192, 256 x 4096), as Llama 3's pre-training began with.
  c.data.update(dict(seq_len=seq_len, batch_size=batch, max_len=4 * seq_len))
  c.optimizer.learning_rate = 3e-4
  c.mesh = "fsdp=-1"
  c.total_steps = 1000
  c.log_every, c.eval_every, c.checkpoint_every = 1, 100, 100
  return c

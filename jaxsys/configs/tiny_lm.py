"""A small decoder-only LM on the Python standard library's source, byte-level.

Run:
  python -m experiments.train --config=configs/tiny_lm.py --workdir=/tmp/jaxsys_tiny
  python -m experiments.train --config=configs/tiny_lm.py:size=small --workdir=/tmp/jaxsys_small
  python -m experiments.train --config=configs/tiny_lm.py --config.total_steps=30 --workdir=...

Sizes: `tiny` (default, about 8 minutes on a 2-core CPU), `small` (a longer CPU
or a short GPU run) and `test` (seconds; for the test suite).
"""
import ml_collections

SIZES = {
    #        d_model layers heads kv  d_ff  seq  batch steps
    "test": (64, 2, 4, 2, 128, 64, 16, 20),
    "tiny": (256, 4, 4, 2, 768, 256, 16, 300),
    "small": (512, 8, 8, 4, 1536, 512, 32, 2000),
}


def parse_args(arg: str | None, config: str, valid: tuple[str, ...]) -> dict[str, str]:
  """'size=small' or 'small' -> {'size': 'small'}; a name not in `valid` is refused."""
  out = {}
  for item in filter(None, (arg or "").split(",")):
    key, _, value = item.rpartition("=")
    out[key or "size"] = value
  unknown = set(out) - set(valid)
  if unknown:
    raise ValueError(f"configs/{config}.py: unknown argument(s) {sorted(unknown)}; valid: "
                     f"{', '.join(valid)}")
  return out


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  args = parse_args(arg, "tiny_lm", ("size",))
  size = args.get("size", "tiny")
  if size not in SIZES:
    raise ValueError(f"configs/tiny_lm.py: size={size!r} is unknown; valid: {sorted(SIZES)}")
  d_model, n_layers, n_heads, n_kv, d_ff, seq_len, batch, steps = SIZES[size]

  c = ml_collections.ConfigDict()
  c.seed = 0
  # Every field is checked before a run starts (jaxsys/train/config_check.py); 0 means
  # "never" for eval_every and "only at the end (and on SIGTERM)" for checkpoint_every.
  c.total_steps = steps
  c.log_every = max(1, steps // 30)  # >= 1
  c.eval_every = max(1, steps // 3)  # 0: never evaluate
  c.eval_steps = 8  # val batches per evaluation, >= 1
  c.checkpoint_every = max(1, steps // 3)  # 0: save only at the end
  c.keep_checkpoints = 3  # >= 1
  # on_corrupt: a checkpoint step whose files fail their checksums (or whose loader position
  # changed since the save): "error" stops naming the file and the newest earlier step that
  # verifies; "previous" resumes from that step.
  # merge_replicas: resuming a replica run (optimizer.outer) as fewer replicas or one model
  # takes the replicas' "mean" or "replica0"; the inner optimizer's moments follow.
  # snapshot_every: also snapshot the state into RAM (snapshot_dir, default a directory on
  # /dev/shm for this workdir) every N steps: a crashed process loses at most N steps (a
  # lost machine: checkpoint_every). 0: none. One process only.
  c.checkpoint = ml_collections.ConfigDict(dict(on_corrupt="error", merge_replicas="mean",
                                                snapshot_every=0, snapshot_dir=""))
  # steps: "N,M" writes a jax.profiler trace of steps N to M into <workdir>/profile (open it
  # with TensorBoard's profile plugin or ui.perfetto.dev) and a device-memory profile at the
  # end of step N; step 1 compiles, so start at 2 or later. "": no profile.
  c.profile = ml_collections.ConfigDict(dict(steps=""))
  c.mesh = "data=-1"  # e.g. "fsdp=8" or "data=2,tensor=4"; see jaxsys/mesh.py
  # Another run's workdir (or its checkpoints dir): a fresh run starts from its latest
  # parameters (inner/outer optimizer state, step and data position start fresh); a
  # run that resumes its own checkpoint ignores it. "" starts from random parameters.
  # "hf:<dir>": a Hugging Face Llama checkpoint (config.json + safetensors); its config.json
  # sets the model's shape fields (vocab_size ... tie_embeddings; dtype, param_dtype,
  # attention_impl, remat and vocab_tiles stay the run's) and its tokenizer.json becomes
  # data.tokenizer (unless that is set to another "hf:<dir>"); see jaxsys/checkpoint/hf.py.
  c.init_from = ""
  # Model fields that change the function but not the shapes (rope_theta, rope_scaling,
  # norm_eps, dtype), comma-separated, that a resume or init_from may change; others
  # differing are refused.
  c.allow_model_change = ""
  # Before any work the run's memory is estimated from its shapes (parameters, optimizer
  # state, gradients, one step's activations per device, the loaders' buffers;
  # jaxsys/train/memory_estimate.py) and a run that cannot fit this machine is refused in
  # one line; False skips that check (for a user who knows better).
  c.check_memory = True

  placeholder = ml_collections.config_dict.placeholder  # None until set, typed for overrides
  c.model = ml_collections.ConfigDict(dict(
      vocab_size=256, d_model=d_model, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv,
      head_dim=placeholder(int),  # None: d_model // n_heads
      # rope_scaling: transformers' as one string, e.g. "linear:factor=4" or Llama 3.1's
      # "llama3:factor=8,..." (transformer.parse_rope_scaling); "": plain RoPE.
      d_ff=d_ff, rope_theta=10_000.0, rope_scaling="", norm_eps=1e-6, tie_embeddings=False,
      qkv_bias=False, qk_norm=False,  # Qwen2's q/k/v biases; Qwen3's per-head q/k norms
      dtype="float32", param_dtype="float32", attention_impl="auto",
      # What each layer keeps for its backward (jaxsys/models/remat.py): none, minimal
      # (no matmul recomputed), dots, qkv or full; remat_offload: names it keeps in host
      # memory instead, e.g. "layer_input,q,k,v".
      remat="none", remat_offload="",
      # The loss's output layer in this many vocabulary tiles: no [B, T, vocab] logits
      # tensor is ever whole, one more output-layer matmul in the backward (1: untiled).
      vocab_tiles=1))

  c.data = ml_collections.ConfigDict(dict(
      # "stdlib", a directory or a glob of text files (a file a document) or JSONL files
      # (.jsonl[.gz]: a record a document, its text in text_field), or "<w>:<source>;...".
      source="stdlib", text_field="text", tokenizer="byte", vocab_size=256, seq_len=seq_len,
      batch_size=batch, num_threads=2,
      # Whole documents of up to max_len tokens instead of packed rows (for parallel.hdp);
      # a longer document is an error unless truncate_long (then counted in the log).
      variable_length=False, max_len=4 * seq_len, truncate_long=False))

  c.optimizer = ml_collections.ConfigDict(dict(
      # warmup_steps follows total_steps (5%, rounded up) unless set; it must not exceed the
      # schedule, so --config.total_steps=2 alone stays valid.
      name="adamw", learning_rate=3e-3, warmup_steps=(c.get_ref("total_steps") + 19) // 20,
      final_lr_fraction=0.1,
      b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, grad_clip=1.0, grad_accum_steps=1,
      # With accumulation over fsdp: gather the weights (in the compute dtype) once a step
      # and keep them for every microbatch, instead of gathering them in each.
      accum_gather_once=False,
      schedule_steps=0,  # 0: decay over total_steps
      schedule_offset=0))  # steps of the curve already taken (e.g. by the init_from run)
  # Outer (low-communication) optimizer over the mesh's `replica` axis: none (plain data
  # parallel), diloco, streaming_diloco, noloco or co2; e.g. --config.optimizer.outer=diloco
  # --config.mesh=replica=4,data=-1. Unset (None) fields take the algorithm's published
  # default (jaxsys/optim/diloco.py, noloco.py, co2.py).
  c.optimizer.update(dict(
      outer="none", outer_sync_every=50, outer_lr=placeholder(float),
      outer_momentum=placeholder(float), outer_nesterov=True,  # diloco
      outer_compression="none", outer_error_feedback=False,  # diloco: none|bf16|int8|fp8
      outer_gamma=placeholder(float), outer_group_size=2, outer_seed=0,  # noloco
      outer_staleness_penalty=placeholder(float), outer_momentum_clip=placeholder(float),
      # co2: a setting outside its stability bound is refused unless this is True (then a
      # warning), e.g. the authors' outer_staleness_penalty=1.0 (jaxsys/optim/co2.py)
      outer_allow_unstable=False,
      # co2: its all-reduce on each process's second half of CPU devices, overlapping the
      # next outer_sync_every steps (XLA:CPU; jaxsys/train/comm_device.py)
      outer_comm_device=False,
      # streaming_diloco: layers synced in outer_fragments fragments at staggered offsets,
      # each every outer_sync_every steps; the outer step lands outer_overlap_steps inner
      # steps after its collective starts, mixed into the local parameters as
      # (1 - outer_mixing) global + outer_mixing local (jaxsys/optim/streaming.py)
      outer_fragments=1, outer_overlap_steps=0, outer_mixing=0.0))
  # Pipeline parallelism over the mesh's `stage` axis (jaxsys/parallel/pipeline/): none,
  # gpipe, 1f1b or interleaved_1f1b, e.g. --config.mesh=stage=4,data=2
  # --config.pipeline.schedule=1f1b --config.pipeline.microbatches=8
  # --config.pipeline.vocab_parallel=true (embedding and output layer split over stage x tensor;
  # vocab_algorithm 2 syncs once per microbatch, 1 is the paper's naive baseline;
  # vocab_overlap (1f1b) runs each microbatch's S and T passes beside the next two ticks'
  # compute, their all-reduces carried across ticks, at two more microbatches in flight).
  # routing (with an outer optimizer over a replica x stage mesh): fixed sends each
  # microbatch to the next stage of its own replica; random to the next stage of a replica
  # drawn per step, microbatch and boundary, seeded by optimizer.outer_seed (NoLoCo, arXiv
  # 2506.10911; jaxsys/train/grads.py routed_pipeline).
  # gather_once (with an fsdp axis): each stage's weights all-gathered once a step and its
  # gradients reduce-scattered once, not in every tick; costs the stage's whole weights and
  # gradients on each of its devices. Always so beside tensor (or context with
  # vocab_parallel): XLA's partitioner aborts on those stages' programs otherwise.
  # Context parallelism: a `context` mesh axis > 1 splits every sequence over it and runs
  # context-parallel attention (jaxsys/parallel/context.py), e.g. --config.mesh=data=2,context=4;
  # context_layout zigzag evens the causal work, contiguous is the naive order;
  # context_algorithm ring passes K/V blocks round the ring (K/V memory 1/n of the
  # sequence's), all_gather gathers them all on every device (the Llama 3 paper's: one
  # collective each way; cheap with few K/V heads), refused at start-up when one layer's
  # gathered K/V per device would exceed context_gather_mib; ulysses (DeepSpeed-Ulysses)
  # trades the sequence split for a split of the heads by all-to-all (both head counts,
  # per tensor shard, must divide by the context size).
  # hdp: Hybrid Data Parallelism (jaxsys/parallel/hdp.py) over data, fsdp and tensor, for
  # data.variable_length=true: each document on as many devices as its length needs,
  # data.seq_len tokens per device per micro-step, ceil(data.batch_size / devices)
  # micro-steps per step, filled from whole documents (what does not fit starts the next).
  # Each device runs its own micro-batches and only the gradient all-reduce waits for all
  # (ByteScale's per-rank balance). hdp_widen_rings: a ring may take up to twice the
  # devices it needs where that ends sooner by FLOPs (better balance, more padding; links
  # are not modelled).
  c.parallel = ml_collections.ConfigDict(dict(context_layout="zigzag", context_algorithm="ring",
                                              context_gather_mib=1024, hdp=False,
                                              hdp_widen_rings=False))
  c.pipeline = ml_collections.ConfigDict(dict(
      schedule="none", microbatches=4, virtual_stages=1, vocab_parallel=False, vocab_algorithm=2,
      vocab_overlap=False, routing="fixed", gather_once=False))
  return c

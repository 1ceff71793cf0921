"""A cost model and simulator for HDP against a static context-parallel mesh.

Ways to run one global batch of variable-length sequences on N devices, each holding at
most `tokens_per_device` (tpd) tokens per micro-batch:

  hdp_per_rank: `hdp_schedule.schedule`, each device running its own micro-batches and
          only the gradient all-reduce waiting for all (`simulate_per_rank`, timed as
          jaxsys's per-rank executor runs it: `schedule_jobs`).
  hdp:    `hdp.plan`, lock-step (a sequence on a ring of just as many devices as its
          length needs).
  static: one `data = N/c_max, context = c_max` mesh, c_max sized for the dataset's longest
          sequence (a static mesh must be); sequences packed first-fit decreasing into rows
          of c_max * tpd tokens, each row on a ring of c_max, N/c_max rows per micro-step.
  bound:  total compute / N plus the ring communication the long sequences cannot avoid
          (`lower_bound`); `lockstep_bound` adds the lock step with hdp's ring sizes.

Timing model per device and micro-step (every layer alike, times n_layers):
  attention forward  A = sec_per_attention_flop * 2 d L^2 per sequence (causal; a ring of
                     c gives each member a = A / c, the zigzag layout evens it, in c
                     blocks of a / c: its own and c - 1 visiting),
  linear forward     Lin = sec_per_linear_flop * 24 d^2 * tokens,
  one ring hop       h = 2 (K and V) * share tokens * kv_dim * bytes / link bandwidth;
  a ring of c > 1 runs its local block then c - 1 hops, forward and (twice the compute and
  twice the bytes) backward, so a member spends
    overlap=True  (ring attention: the next K/V block moves while this one computes):
        3 * (Lin + a/c + (c - 1) * max(a/c, h))
    overlap=False: 3 * (Lin + a + (c - 1) * h)
  and a device holding short sequences (c = 1) spends 3 * (Lin + sum A).
Static and lock-step HDP steps are SPMD: a micro-step lasts as long as its slowest
device. Lock-step HDP is timed two ways: "ideal" (ByteScale: only a ring's members move
K/V, over their ring) and "step_ring" (jaxsys's lock-step executor: a micro-step is one
program over the view of its largest ring C, so every device's block makes C - 1 hops;
see device_times). What the per-rank timing leaves out: the final gradient all-reduce
(every strategy pays it once per batch), dispatch overhead, and compiling a program per
ring block shape.

Example:
  model = fit_cost_model().model        # ~5 s of CPU timing
  lengths = long_tail_lengths(2000, seed=0)
  result = simulate(lengths, num_devices=64, tokens_per_device=32768, model=model)
  result["static_loader"].time / result["hdp_per_rank"].time
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence

import numpy as np

from jaxsys.parallel import hdp, hdp_schedule

Plan = hdp.Plan


@dataclasses.dataclass(frozen=True)
class CostModel:
  """Seconds of one device's work; compute rates fitted, link bandwidth stated.

  sec_per_attention_flop / sec_per_linear_flop: fitted (`fit_cost_model`); FLOPs counted
    as hdp.sequence_cost does (2 d L^2 causal attention, 24 d^2 per token linear).
  link_bytes_per_s: one direction of one ring link; 100e9 is NVLink-class, 25e9 a
    200 Gb/s InfiniBand port.
  d_model, n_layers, kv_dim (width of K, and of V, per token), bytes_per_element: the
    simulated model (default: a 7B-class model, d 4096, 32 layers, MHA, bf16).
  overlap: ring hops overlap the attention compute (max per hop) or add to it.
  pad_compute: fixed-shape programs compute and send their padding (every device runs
    tpd tokens through the matmuls; a hop carries tpd tokens), as jax SPMD programs do.
  """
  sec_per_attention_flop: float
  sec_per_linear_flop: float
  link_bytes_per_s: float = 100e9
  d_model: int = 4096
  n_layers: int = 32
  kv_dim: int = 4096
  bytes_per_element: int = 2
  overlap: bool = True
  pad_compute: bool = True

  def __post_init__(self):
    for name in ("sec_per_attention_flop", "sec_per_linear_flop", "link_bytes_per_s"):
      value = getattr(self, name)
      if not value > 0:
        raise ValueError(f"CostModel.{name}={value!r}: must be > 0")
    for name in ("d_model", "n_layers", "kv_dim", "bytes_per_element"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"CostModel.{name}={value!r}: must be an int >= 1")

  def attention(self, length):
    """Forward seconds of one layer's causal attention over a whole sequence."""
    length = np.asarray(length, np.float64)
    return (self.sec_per_attention_flop * hdp.ATTENTION_FLOPS_PER_PAIR * self.d_model
            * length * length)

  def linear(self, tokens):
    """Forward seconds of one layer's matmuls (qkvo + 4x MLP) over `tokens` tokens."""
    return (self.sec_per_linear_flop * hdp.LINEAR_FLOPS_PER_TOKEN * self.d_model ** 2
            * np.asarray(tokens, np.float64))

  def hop(self, share_tokens):
    """Seconds to pass one device's K and V blocks to the next ring member."""
    return 2.0 * share_tokens * self.kv_dim * self.bytes_per_element / self.link_bytes_per_s

  def ring_member(self, attention, linear, share_tokens, ring):
    """Forward + backward seconds, all layers, of one ring member (see the module doc)."""
    return self.device(attention=attention, linear=linear, ring=ring,
                       hop_tokens=share_tokens)

  def device(self, *, attention, linear, ring=1, hop_tokens=0, program_ring=None,
             local_attention=0.0):
    """Forward + backward seconds, all layers, of one device in one micro-step.

    attention: its share of its ring's sequence(s), in `ring` equal blocks (1 local, the
    rest visiting); local_attention: sequences held whole on it; the program's ring
    (default `ring`) moves `hop_tokens` tokens of K/V program_ring - 1 times, and the
    hops beyond `ring` carry no work for this device (nothing to overlap them with).
    """
    program_ring = ring if program_ring is None else program_ring
    hops = program_ring - 1
    h = self.hop(hop_tokens) if hops else 0.0
    block = attention / ring
    if self.overlap:
      layer = (linear + local_attention + block + (ring - 1) * max(block, h)
               + (program_ring - ring) * h)
    else:
      layer = linear + local_attention + attention + hops * h
    return 3.0 * self.n_layers * layer

  def scaled(self, compute_speedup: float) -> CostModel:
    """The same model on a device `compute_speedup` times faster; links unchanged."""
    if not compute_speedup > 0:
      raise ValueError(f"compute_speedup={compute_speedup!r}: must be > 0")
    return dataclasses.replace(
        self, sec_per_attention_flop=self.sec_per_attention_flop / compute_speedup,
        sec_per_linear_flop=self.sec_per_linear_flop / compute_speedup)


@dataclasses.dataclass(frozen=True)
class Fit:
  """A fitted CostModel and how well the lines fit (R^2 of time against FLOPs)."""
  model: CostModel
  attention_r2: float
  linear_r2: float
  points: dict


def _min_time(fn, *args, repeats: int) -> float:
  """Best of `repeats` wall times after one warm-up (compile) call."""
  fn(*args).block_until_ready()
  best = math.inf
  for _ in range(repeats):
    start = time.perf_counter()
    fn(*args).block_until_ready()
    best = min(best, time.perf_counter() - start)
  return best


def _line_fit(flops, seconds):
  """Least squares seconds = a * flops + b: (a, b, R^2)."""
  x, y = np.asarray(flops, np.float64), np.asarray(seconds, np.float64)
  design = np.stack([x, np.ones_like(x)], axis=1)
  (a, b), *_ = np.linalg.lstsq(design, y, rcond=None)
  resid = y - (a * x + b)
  r2 = 1.0 - float(resid @ resid) / float(((y - y.mean()) ** 2).sum())
  return float(a), float(b), r2


def fit_cost_model(*, lengths=(1024, 2048, 3072, 4096),
                   token_counts=(2048, 4096, 8192, 16384), heads: int = 4, head_dim: int = 64,
                   repeats: int = 5,
                   **model_kwargs) -> Fit:
  """Times this machine's attention (impl="xla", causal) and a [T, d] x [d, 4d] matmul.

  The slopes of least-squares lines of seconds against FLOPs (2 d L^2 for attention,
  8 d^2 T for the matmul) become the per-FLOP rates; the intercepts (dispatch overhead)
  are dropped. Nothing is cached. `model_kwargs` go to CostModel (link, d_model, ...).
  The sizes keep every timing at milliseconds or more: smaller matmuls' slopes came out
  noisy (R^2 0.75 to 0.96) and implied more FLOP/s than the cores have.
  """
  import jax
  import jax.numpy as jnp

  from jaxsys.kernels import attention as attention_lib

  d = heads * head_dim
  attn = jax.jit(lambda q, k, v: attention_lib.attention(q, k, v, causal=True, impl="xla"))
  key = jax.random.PRNGKey(0)
  a_flops, a_secs = [], []
  for length in lengths:
    q = jax.random.normal(key, (1, length, heads, head_dim), jnp.float32)
    a_secs.append(_min_time(attn, q, q, q, repeats=repeats))
    a_flops.append(hdp.ATTENTION_FLOPS_PER_PAIR * d * length * length)
  matmul = jax.jit(lambda x, w: x @ w)
  w = jax.random.normal(key, (d, 4 * d), jnp.float32)
  m_flops, m_secs = [], []
  for tokens in token_counts:
    x = jax.random.normal(key, (tokens, d), jnp.float32)
    m_secs.append(_min_time(matmul, x, w, repeats=repeats))
    m_flops.append(2 * tokens * d * 4 * d)
  a_slope, _, a_r2 = _line_fit(a_flops, a_secs)
  m_slope, _, m_r2 = _line_fit(m_flops, m_secs)
  if a_slope <= 0 or m_slope <= 0:
    raise RuntimeError(f"fit_cost_model: non-positive slope (attention {a_slope:.3g}, linear "
                       f"{m_slope:.3g} s/FLOP); the machine was too busy to time, rerun")
  points = dict(attention=list(zip(a_flops, a_secs)), linear=list(zip(m_flops, m_secs)))
  model = CostModel(sec_per_attention_flop=a_slope, sec_per_linear_flop=m_slope, **model_kwargs)
  return Fit(model, a_r2, m_r2, points)


# ----------------------------------------------------------------------- length samples


def stdlib_lengths(max_len: int | None = 262144) -> np.ndarray:
  """Byte-tokenizer lengths of the interpreter's stdlib .py files (jaxsys.data.corpus).

  Sorted by path; documents longer than `max_len` are truncated to it, as
  data.truncate_long does (None keeps them whole).
  """
  from jaxsys.data import corpus, tokenizer

  tok = tokenizer.ByteTokenizer()
  docs = corpus.read_documents(corpus.list_documents("stdlib", "all"))
  lengths = np.array([tok.encode(doc).size for doc in docs], np.int64)
  return lengths if max_len is None else np.minimum(lengths, max_len)


# ByteScale (arXiv 2502.21231, Sec. 2, Fig. 2) describes its Byted and GitHub data as
# skewed: about 80% of samples hold <= 4K tokens while a long tail reaches the context
# limit and carries most tokens. Matched here: 80% of samples in a log-normal body
# (median 1K, clipped to [32, 4096]); 20% from a truncated Pareto on [4K, max_len] whose
# token mass falls as L^-1/2 (alpha = 0.5). At max_len 256K that puts ~64% of tokens in
# sequences > 32K (the stdlib's byte lengths: 64% too) and ~87% in sequences > 4K.
_BODY_FRACTION = 0.8
_BODY_MEDIAN = 1024
_BODY_SIGMA = 1.0
_TAIL_START = 4096
_TAIL_ALPHA = 0.5


def long_tail_lengths(n: int, seed: int, max_len: int = 262144) -> np.ndarray:
  """n lengths shaped like ByteScale's long-tailed data (see the constants above)."""
  if n < 0:
    raise ValueError(f"n={n}: must be >= 0")
  if max_len <= _TAIL_START:
    raise ValueError(f"max_len={max_len}: must be > {_TAIL_START} (the tail starts there)")
  rng = np.random.default_rng(seed)
  body = np.exp(rng.normal(math.log(_BODY_MEDIAN), _BODY_SIGMA, n))
  body = np.clip(body, 32, _TAIL_START)
  # Inverse CDF of a Pareto(alpha) truncated to [a, b].
  a, b, alpha = _TAIL_START, max_len, _TAIL_ALPHA
  u = rng.random(n)
  tail = (a ** -alpha - u * (a ** -alpha - b ** -alpha)) ** (-1.0 / alpha)
  lengths = np.where(rng.random(n) < _BODY_FRACTION, body, tail)
  return np.clip(np.round(lengths), 1, max_len).astype(np.int64)


def sample_batch(pool: np.ndarray, tokens: int, seed: int) -> np.ndarray:
  """Lengths drawn from `pool` (with replacement) while they hold <= `tokens` tokens: a
  token budget, as jaxsys.data.documents cuts its batches (the draw that would overflow
  is left out)."""
  pool = np.asarray(pool, np.int64)
  if pool.size == 0 or tokens < 1:
    raise ValueError(f"sample_batch: need a non-empty pool and tokens >= 1, got "
                     f"{pool.size} lengths and tokens={tokens}")
  rng = np.random.default_rng(seed)
  draws = rng.choice(pool, size=max(16, int(2 * tokens / pool.mean()) + 16))
  while draws.sum() < tokens:
    draws = np.concatenate([draws, rng.choice(pool, size=draws.size)])
  return draws[:max(1, int(np.searchsorted(np.cumsum(draws), tokens, side="right")))]


# ----------------------------------------------------------------------------- strategies


@dataclasses.dataclass(frozen=True)
class Result:
  """One strategy on one batch.

  time: seconds (lock-step: sum over micro-steps of the slowest device).
  per_rank_time: max over devices of its own summed time: the same micro-steps with the
    lock step dropped (for a per-rank schedule, see simulate_per_rank).
  device_time [steps, devices]; imbalance: sum of step maxima / sum of step means;
  padding: 1 - real tokens / (steps * devices * tpd).
  """
  name: str
  time: float
  steps: int
  imbalance: float
  padding: float
  per_rank_time: float
  device_time: np.ndarray


EXECUTORS = ("ideal", "step_ring", "run")


def group_time(model: CostModel, group_lengths, ring: int, tokens_per_device: int) -> float:
  """Seconds of one member of a ring of `ring` running the packed `group_lengths`."""
  real = int(np.sum(group_lengths))
  share = tokens_per_device if model.pad_compute else -(-real // ring)
  attention = float(np.sum(model.attention(np.asarray(group_lengths)))) / ring
  return model.ring_member(attention, float(model.linear(share)), share, ring)


def device_times(groups: list[list[tuple[Sequence[int], tuple[int, ...]]]], *,
                 num_devices: int, tokens_per_device: int, model: CostModel,
                 executor: str = "ideal") -> np.ndarray:
  """[steps, devices] seconds; a step is a list of (lengths packed together, device ids).

  A device holds at most one ring group (c > 1) and any number of one-device groups
  beside it. executor "ideal" (ByteScale's HDP): only ring members exchange K/V, over
  their own ring, their ring share only. "step_ring" (jaxsys's HDP executor,
  jaxsys/train/hdp_step.py): a micro-step is one program over the `data = N/C,
  context = C` view of its largest ring C, so every device's whole block takes C - 1
  hops, needed or not. "run" (jaxsys's per-rank executor, a ring's program over just its
  run of c devices): every member's whole block, fill included, takes c - 1 hops.
  With pad_compute every device runs tpd tokens through the
  matmuls and a hop carries tpd tokens.
  """
  if executor not in EXECUTORS:
    raise ValueError(f"executor={executor!r}: must be one of {EXECUTORS}")
  out = np.zeros((len(groups), num_devices))
  for m, step in enumerate(groups):
    ring = np.ones(num_devices, np.int64)
    ring_attention = np.zeros(num_devices)
    ring_tokens = np.zeros(num_devices, np.int64)
    local_attention = np.zeros(num_devices)
    local_tokens = np.zeros(num_devices, np.int64)
    for group_lengths, devs in step:
      lens = np.asarray(group_lengths, np.int64)
      c, idx = len(devs), list(devs)
      if c == 1:
        local_attention[idx] += float(np.sum(model.attention(lens)))
        local_tokens[idx] += int(lens.sum())
      else:
        ring[idx] = c
        ring_attention[idx] += float(np.sum(model.attention(lens))) / c
        ring_tokens[idx] += -(-int(lens.sum()) // c)
    program = hdp.block_size(int(ring.max(initial=1)))  # the view's context size
    for d in range(num_devices):
      tokens = int(ring_tokens[d] + local_tokens[d])
      linear = float(model.linear(tokens_per_device if model.pad_compute else tokens))
      if executor == "ideal":
        hop_tokens = tokens_per_device if model.pad_compute else int(ring_tokens[d])
        prog = int(ring[d])
      else:
        hop_tokens = tokens_per_device if model.pad_compute else tokens
        prog = program if executor == "step_ring" else int(ring[d])
      out[m, d] = model.device(attention=ring_attention[d], linear=linear, ring=int(ring[d]),
                               hop_tokens=hop_tokens, program_ring=prog,
                               local_attention=local_attention[d])
  return out


def _result(name, times, real_tokens, num_devices, tokens_per_device) -> Result:
  steps = times.shape[0]
  maxima, means = times.max(axis=1, initial=0.0), times.mean(axis=1) if steps else np.zeros(0)
  imbalance = float(maxima.sum() / means.sum()) if means.sum() else 1.0
  slots = steps * num_devices * tokens_per_device
  return Result(name, float(maxima.sum()), steps, imbalance,
                1.0 - real_tokens / slots if slots else 0.0,
                float(times.sum(axis=0).max(initial=0.0)), times)


def hdp_groups(steps: Plan, lengths) -> list:
  """An hdp.plan as device_times groups: each sequence its own group."""
  return [[([int(lengths[i])], devs) for i, devs in step] for step in steps]


def simulate_hdp(lengths, *, num_devices: int, tokens_per_device: int,
                 model: CostModel, executor: str = "ideal") -> Result:
  """HDP: hdp.plan (costs with the model's d_model) timed by the cost model."""
  lengths = np.asarray(lengths, np.int64)
  steps = hdp.plan(lengths, num_devices=num_devices, tokens_per_device=tokens_per_device,
                   d_model=model.d_model)
  times = device_times(hdp_groups(steps, lengths), num_devices=num_devices,
                       tokens_per_device=tokens_per_device, model=model, executor=executor)
  name = "hdp" if executor == "ideal" else f"hdp_{executor}"
  return _result(name, times, int(lengths.sum()), num_devices, tokens_per_device)


@dataclasses.dataclass(frozen=True)
class Job:
  """One micro-batch of a per-rank schedule: a ring on its block or a local batch.

  devices: who runs it; start / end: seconds (a ring's members start together and it
  lasts as long as its slowest); busy[k]: seconds devices[k] computes or sends;
  entries: (sequence, device ids relative to `devices`), as Ring.entries.
  """
  devices: tuple[int, ...]
  start: float
  end: float
  busy: np.ndarray
  entries: list


def schedule_jobs(sched: hdp_schedule.Schedule, lengths, *, tokens_per_device: int,
                  model: CostModel) -> list[Job]:
  """Every micro-batch of a per-rank schedule with its start and end, in run order.

  As jaxsys's per-rank executor runs it (jaxsys/train/hdp_step.py): each ring is one
  program over its run of c devices (`data = 1, context = c`; executor "run" of
  device_times, with the ring's cell as the program's tokens per device), its members
  start together when the last of them is free and the ring lasts as long as its slowest
  member (every member's whole cell, fill included, takes the c - 1 hops); then each
  device runs its local micro-batches on its own.
  """
  lengths = np.asarray(lengths, np.int64)
  finish = np.zeros(sched.num_devices)
  jobs = []
  for ring in sched.rings:
    devs = list(ring.devices)
    entries = ring.entries()
    group = [[([int(lengths[i])], rel) for i, rel in entries]]
    member = device_times(group, num_devices=len(devs), tokens_per_device=ring.cell,
                          model=model, executor="run")[0]
    start = finish[devs].max()
    finish[devs] = start + member.max()
    jobs.append(Job(ring.devices, float(start), float(finish[devs[0]]), member, entries))
  for d, batches in enumerate(sched.local):
    for batch in batches:
      lens = lengths[list(batch)]
      tokens = int(lens.sum())
      if model.pad_compute:
        tokens = hdp_schedule.local_cell(tokens, tokens_per_device)
      secs = model.device(attention=0.0, linear=float(model.linear(tokens)),
                          local_attention=float(np.sum(model.attention(lens))))
      start = finish[d]
      finish[d] += secs
      jobs.append(Job((d,), float(start), float(finish[d]), np.array([secs]),
                      [(i, (0,)) for i in batch]))
  return jobs


def schedule_times(sched: hdp_schedule.Schedule, lengths, *, tokens_per_device: int,
                   model: CostModel) -> np.ndarray:
  """[devices] seconds until each device has run its part of a per-rank schedule
  (timed as `schedule_jobs` says)."""
  finish = np.zeros(sched.num_devices)
  for job in schedule_jobs(sched, lengths, tokens_per_device=tokens_per_device, model=model):
    finish[list(job.devices)] = job.end
  return finish


@dataclasses.dataclass(frozen=True)
class ScheduleCost:
  """The cost model as hdp_schedule.schedule's time estimate (seconds, links included),
  so the schedule balances what schedule_jobs will time."""
  model: CostModel
  tokens_per_device: int

  def cell(self, tokens: int) -> float:
    if not self.model.pad_compute:
      return 0.0
    return self.model.device(attention=0.0, linear=float(self.model.linear(tokens)))

  def ring(self, lengths, devices: int, cell: int) -> float:
    group = [[([int(n) for n in lengths], tuple(range(devices)))]]
    return float(device_times(group, num_devices=devices, tokens_per_device=cell,
                              model=self.model, executor="run")[0].max())

  def short(self, length: int) -> float:
    return self.model.device(attention=0.0, linear=float(self.model.linear(length)),
                             local_attention=float(self.model.attention(length)))


def simulate_per_rank(lengths, *, num_devices: int, tokens_per_device: int,
                      model: CostModel, widen: bool = True) -> Result:
  """HDP without lock step: hdp_schedule.schedule (balancing this cost model's times)
  timed by schedule_times. steps: the most micro-batches any device runs; imbalance:
  slowest device over the mean."""
  lengths = np.asarray(lengths, np.int64)
  sched = hdp_schedule.schedule(lengths, num_devices=num_devices,
                                tokens_per_device=tokens_per_device, d_model=model.d_model,
                                widen=widen, cost=ScheduleCost(model, tokens_per_device))
  finish = schedule_times(sched, lengths, tokens_per_device=tokens_per_device, model=model)
  counts = sched.micro_batches()
  slots = sched.slots(lengths, tokens_per_device)
  return Result("hdp_per_rank", float(finish.max(initial=0.0)), int(counts.max(initial=0)),
                float(finish.max() / finish.mean()) if finish.mean() else 1.0,
                1.0 - int(lengths.sum()) / slots if slots else 0.0,
                float(finish.max(initial=0.0)), finish[None])


def static_ring(max_len: int, num_devices: int, tokens_per_device: int) -> int:
  """c_max: the ring a static mesh needs for the dataset's longest sequence."""
  c = hdp.ring_size(int(max_len), tokens_per_device)
  if c > num_devices:
    raise ValueError(f"max_len={max_len} needs a ring of {c} devices at tokens_per_device="
                     f"{tokens_per_device}, more than num_devices={num_devices}")
  return c


STATIC_ORDERS = ("loader", "sorted", "padded")


def static_plan(lengths, *, num_devices: int, tokens_per_device: int, max_len: int,
                order: str = "loader", seed: int = 0, d_model: int = hdp.DEFAULT_D_MODEL):
  """Static CP micro-steps: lists of (row's sequence indices, ring device ids).

  FFD rows of c_max * tpd tokens, N / c_max rows per lock-step micro-step, in `order`:
  "loader" (rows in a seeded random order, as a data loader hands them out), "sorted"
  (rows by cost, heaviest first, so heavy rows share micro-steps: the best grouping a
  static lock-step mesh can do) or "padded" (no packing: one sequence per row, padded
  to it, in loader order).
  """
  if order not in STATIC_ORDERS:
    raise ValueError(f"order={order!r}: must be one of {STATIC_ORDERS}")
  lengths = np.asarray(lengths, np.int64)
  c = static_ring(max_len, num_devices, tokens_per_device)
  rows = hdp.pack_rows(lengths, c * tokens_per_device)
  if order == "padded":
    rows = [[i] for i in np.random.default_rng(seed).permutation(lengths.size).tolist()]
  elif order == "loader":
    rows = [rows[k] for k in np.random.default_rng(seed).permutation(len(rows))]
  else:
    cost = [float(np.sum(hdp.sequence_cost(lengths[r], d_model=d_model))) for r in rows]
    rows = [rows[k] for k in np.argsort(cost, kind="stable")[::-1]]
  per_step = num_devices // c
  return [[(row, tuple(range(k * c, (k + 1) * c)))
           for k, row in enumerate(rows[start:start + per_step])]
          for start in range(0, len(rows), per_step)]


def simulate_static(lengths, *, num_devices: int, tokens_per_device: int, model: CostModel,
                    max_len: int, order: str = "loader", seed: int = 0) -> Result:
  """Static CP (see static_plan) timed by the cost model."""
  lengths = np.asarray(lengths, np.int64)
  steps = static_plan(lengths, num_devices=num_devices, tokens_per_device=tokens_per_device,
                      max_len=max_len, order=order, seed=seed, d_model=model.d_model)
  groups = [[(lengths[row].tolist(), devs) for row, devs in step] for step in steps]
  times = device_times(groups, num_devices=num_devices, tokens_per_device=tokens_per_device,
                       model=model)
  return _result(f"static_{order}", times, int(lengths.sum()), num_devices, tokens_per_device)


def lower_bound(lengths, *, num_devices: int, tokens_per_device: int,
                model: CostModel) -> float:
  """Seconds no plan can beat: (all compute + unavoidable exposed ring traffic) / N.

  Compute counts real tokens only. A sequence of L > tpd tokens needs at least
  c = ceil(L / tpd) devices; each then waits (c - 1) * max(0, h - A/c^2) per layer and
  direction beyond its compute (A/c^2: one member's attention per hop; 0 with overlap
  while attention hides the hop).
  """
  lengths = np.asarray(lengths, np.float64)
  attention, linear = model.attention(lengths), model.linear(lengths)
  total = float(np.sum(3.0 * model.n_layers * (attention + linear)))
  for L, a in zip(lengths, attention):
    c = math.ceil(L / tokens_per_device)
    if c > 1:
      h = model.hop(L / c)
      wait = max(0.0, h - a / (c * c)) if model.overlap else h
      total += c * 3.0 * model.n_layers * (c - 1) * wait
  return total / num_devices


def lockstep_bound(lengths, *, num_devices: int, tokens_per_device: int,
                   model: CostModel) -> float:
  """Seconds no lock-step plan with hdp's ring sizes can beat.

  Every member of a ring (c > 1) counts once per device, sorted by time, slowest first:
  a micro-step holds at most N of them, so the k-th slowest micro-step lasts at least
  member[(k - 1) * N]. Micro-steps beyond those, up to hdp.min_steps, last at least an
  idle device's padding (pad_compute) or 0.
  """
  lengths = np.asarray(lengths, np.int64)
  members = []
  for n in lengths:
    c = hdp.devices_needed(int(n), tokens_per_device)
    if c > 1:
      members += [group_time(model, [int(n)], c, tokens_per_device)] * c
  terms = np.sort(np.asarray(members))[::-1][::num_devices]
  steps = hdp.min_steps(lengths, num_devices=num_devices,
                        tokens_per_device=tokens_per_device) if lengths.size else 0
  idle = group_time(model, [], 1, tokens_per_device) if model.pad_compute else 0.0
  return float(terms.sum() + max(0, steps - terms.size) * idle)


def simulate(lengths, *, num_devices: int, tokens_per_device: int, model: CostModel,
             max_len: int | None = None, seed: int = 0) -> dict:
  """hdp_per_rank (the per-rank schedule, see simulate_per_rank), the lock-step hdp and
  hdp_step_ring (jaxsys's lock-step executor, see device_times), static_loader,
  static_sorted and static_padded Results; in seconds the lower bound ("bound") and the
  lock-step bound for hdp's ring sizes ("lockstep_bound").

  max_len sizes the static ring (the dataset's longest sequence); default: the batch's.
  """
  lengths = np.asarray(lengths, np.int64)
  max_len = int(lengths.max()) if max_len is None else max_len
  kw = dict(num_devices=num_devices, tokens_per_device=tokens_per_device, model=model)
  return dict(
      hdp=simulate_hdp(lengths, **kw),
      hdp_step_ring=simulate_hdp(lengths, executor="step_ring", **kw),
      hdp_per_rank=simulate_per_rank(lengths, **kw),
      static_loader=simulate_static(lengths, max_len=max_len, order="loader", seed=seed, **kw),
      static_sorted=simulate_static(lengths, max_len=max_len, order="sorted", **kw),
      static_padded=simulate_static(lengths, max_len=max_len, order="padded", seed=seed, **kw),
      bound=lower_bound(lengths, **kw),
      lockstep_bound=lockstep_bound(lengths, **kw))

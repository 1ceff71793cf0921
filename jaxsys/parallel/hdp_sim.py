"""A simulator for HDP against static context-parallel meshes.

Ways to run one global batch of variable-length sequences on N devices, each holding at
most `tokens_per_device` (tpd) tokens per micro-batch:

  hdp_per_rank: `hdp_schedule.schedule`, each device running its own micro-batches
          (`simulate_per_rank`, timed as jaxsys's per-rank executor runs it: `schedule_jobs`).
  hdp:    `hdp.plan`, lock-step (`simulate_hdp`).
  static: one `data = N/c_max, context = c_max` mesh, c_max sized for the dataset's longest
          sequence (a static mesh must be); sequences packed first-fit decreasing into rows
          of c_max * tpd tokens, each row on a ring of c_max (`static_rows`), run by the
          N/c_max data groups one of three ways (`simulate_static`, STATIC_SCHEDULES):
            lockstep: N/c_max rows per micro-step, in loader order, each micro-step as long
                      as its slowest row (one SPMD program, as jaxsys's static step runs);
            groups:   the rows dealt to the groups in loader order, each group running its
                      own back to back (per-group accumulation);
            lpt:      the rows, slowest first, each to the group done soonest (longest
                      processing time first).
  two_pool / balanced: a static layout of two pools (`simulate_two_pool`): rings of c_max
          for the sequences over tpd only, FFD rows dealt LPT; the rest on the other devices
          with no context parallelism, packed into token rows dealt LPT ("rows") or by cost
          (Zeppelin-style, "cost": `balance_short`); the split tuned per batch.
  bound:  all compute / N plus the ring traffic the long sequences cannot hide, then one
          all-reduce (`lower_bound`); `lockstep_bound` adds the lock step with hdp's ring
          sizes.

Example:
  model = fit_cost_model(compiled=True, params=cost.dense_params(4096, 32, 4096)).model  # ~5 s
  lengths = long_tail_lengths(2000, seed=0)
  kw = dict(num_devices=64, tokens_per_device=32768, model=model)
  static = simulate_static(lengths, max_len=262144, schedule="lpt", **kw)
  static.time / simulate_per_rank(lengths, **kw).time
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence

import numpy as np

from jaxsys.data import packing
from jaxsys.parallel import cost, hdp, hdp_schedule

Plan = hdp.Plan

# jaxsys's static step lays its rows out over `context` in the program: an all-gather of
# each batch field, 4 bytes a token.
LAYOUT_FIELDS = len(packing.FIELDS)

@dataclasses.dataclass(frozen=True)
class Fit:
  """A fitted cost.CostModel and how well the lines fit (R^2 of time against FLOPs)."""
  model: cost.CostModel
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
                   repeats: int = 5, devices: int = 1,
                   **model_kwargs) -> Fit:
  """Times this machine's attention (impl="xla", causal) and a [T, d] x [d, 4d] matmul.

  The slopes of least-squares lines of seconds against FLOPs (2 d L^2 for attention,
  8 d^2 T for the matmul) become the per-FLOP rates; the intercepts (dispatch overhead)
  are dropped. Nothing is cached. `model_kwargs` go to cost.CostModel (link, d_model, ...).
  The sizes keep every timing at milliseconds or more: smaller matmuls' slopes came out
  noisy (R^2 0.75 to 0.96) and implied more FLOP/s than the cores have.
  devices: the first `devices` jax devices each run the op at once on their own shard
  (the FLOPs above a device), so the rates are a device's while the others compute too,
  as in a step over that many devices of one process (simulated CPU devices share the
  cores).
  """
  import jax
  import jax.numpy as jnp

  from jaxsys.kernels import attention as attention_lib

  if not 1 <= devices <= len(jax.devices()):
    raise ValueError(f"fit_cost_model: devices={devices}: must be in [1, "
                     f"{len(jax.devices())}] (the jax devices of this process)")
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:devices]), ("d",))
  split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
  whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  d = heads * head_dim
  attn = jax.jit(lambda q, k, v: attention_lib.attention(q, k, v, causal=True, impl="xla"))
  key = jax.random.PRNGKey(0)
  a_flops, a_secs = [], []
  for length in lengths:
    q = jax.device_put(jax.random.normal(key, (devices, length, heads, head_dim), jnp.float32),
                       split)
    a_secs.append(_min_time(attn, q, q, q, repeats=repeats))
    a_flops.append(cost.ATTENTION_FLOPS_PER_PAIR * d * length * length)
  matmul = jax.jit(lambda x, w: x @ w)
  w = jax.device_put(jax.random.normal(key, (d, 4 * d), jnp.float32), whole)
  m_flops, m_secs = [], []
  for tokens in token_counts:
    x = jax.device_put(jax.random.normal(key, (devices * tokens, d), jnp.float32), split)
    m_secs.append(_min_time(matmul, x, w, repeats=repeats))
    m_flops.append(2 * tokens * d * 4 * d)
  a_slope, _, a_r2 = _line_fit(a_flops, a_secs)
  m_slope, _, m_r2 = _line_fit(m_flops, m_secs)
  if a_slope <= 0 or m_slope <= 0:
    raise RuntimeError(f"fit_cost_model: non-positive slope (attention {a_slope:.3g}, linear "
                       f"{m_slope:.3g} s/FLOP); the machine was too busy to time, rerun")
  points = dict(attention=list(zip(a_flops, a_secs)), linear=list(zip(m_flops, m_secs)))
  model = cost.CostModel(sec_per_attention_flop=a_slope, sec_per_linear_flop=m_slope,
                         **model_kwargs)
  return Fit(model, a_r2, m_r2, points)


# ------------------------------------------------------------- fits to measured steps

# What a term's basis is computed with in place of 0 (the FLOP rates must be > 0).
_NEGLIGIBLE = 1e-300


@dataclasses.dataclass(frozen=True)
class MeasuredStep:
  """A measured training step of a static context-parallel mesh: `lengths` (each
  sequence a row of ring * tokens_per_device tokens, or packed into such rows) on rings
  of `ring` devices (one data group unless num_devices says more), its compute only (the
  collectives in memory, or a link the model takes as unlimited); seconds a step."""
  lengths: tuple[int, ...]
  seconds: float
  tokens_per_device: int
  ring: int = 1
  num_devices: int | None = None
  name: str = ""

  def __post_init__(self):
    if not self.seconds > 0:
      raise ValueError(f"MeasuredStep{' ' + self.name if self.name else ''}.seconds="
                       f"{self.seconds!r}: must be > 0")


def step_compute(model: cost.CostModel, step: MeasuredStep) -> float:
  """Seconds `model` gives `step` with an unlimited link: `simulate_static` (lock-step) of
  its lengths, compute and the fixed per-step term."""
  model = dataclasses.replace(model, link_bytes_per_s=1e300, tensor_link_bytes_per_s=None)
  return simulate_static(list(step.lengths), num_devices=step.num_devices or step.ring,
                         tokens_per_device=step.tokens_per_device,
                         max_len=step.ring * step.tokens_per_device, model=model).time


@dataclasses.dataclass(frozen=True)
class StepFit:
  """`fit_step_costs`' model, the terms it fitted, and each step's relative error
  (predicted / measured - 1)."""
  model: cost.CostModel
  terms: tuple[str, ...]
  errors: tuple[float, ...]


def fit_step_costs(steps: Sequence[MeasuredStep], model: cost.CostModel,
                   terms: Sequence[str] = ("sec_per_attention_flop", "sec_per_element",
                                           "sec_per_step")) -> StepFit:
  """`model` with `terms` (of cost.STEP_TERMS) fitted to measured whole steps; its other
  fields kept.

  Each step's predicted time (`step_compute`) is linear in the terms, so the fit is a
  least-squares solve, non-negative, of relative errors. The steps must separate the terms:
  at least as many as the terms, and mixes that vary what each term multiplies (attention
  FLOPs against tokens: rows of different lengths; tokens a step against the fixed term:
  different token counts). The matmul rate and sec_per_element both multiply tokens, so
  one model's steps cannot fit both: keep the matmul rate measured (`fit_cost_model`)
  and fit the rest.

  Example:
    steps = [MeasuredStep((4096,) * 2, 1.03, 2048, ring=2), ...]
    calibrated = fit_step_costs(steps, fit_cost_model(devices=2).model).model
  """
  from scipy import optimize  # pylint: disable=import-outside-toplevel

  terms = tuple(terms)
  unknown = sorted(set(terms) - set(cost.STEP_TERMS))
  if unknown or not terms or len(set(terms)) != len(terms):
    raise ValueError(f"fit_step_costs: terms={terms!r}: must be distinct names from "
                     f"{cost.STEP_TERMS}")
  if len(steps) < len(terms):
    raise ValueError(f"fit_step_costs: {len(steps)} measured steps cannot fit {len(terms)} "
                     f"terms {terms}; measure at least {len(terms)}")
  zero = {t: (_NEGLIGIBLE if t.endswith("_flop") else 0.0) for t in terms}
  rest = dataclasses.replace(model, **zero)
  base = np.array([step_compute(rest, s) for s in steps])
  basis = np.array([[step_compute(dataclasses.replace(rest, **{t: 1.0}), s) for t in terms]
                    for s in steps]) - base[:, None]
  measured = np.array([s.seconds for s in steps])
  scale = basis.max(axis=0)
  if np.any(scale <= 0) or np.linalg.matrix_rank(basis / scale, tol=1e-9) < len(terms):
    raise ValueError(f"fit_step_costs: the steps do not separate the terms {terms} (one is "
                     f"absent from every step, or two grow together over them); vary rows' "
                     f"lengths and tokens a step")
  rates, _ = optimize.nnls(basis / scale / measured[:, None], 1.0 - base / measured)
  rates = rates / scale
  zeroed = [t for t, r in zip(terms, rates) if t.endswith("_flop") and not r > 0]
  if zeroed:
    raise RuntimeError(f"fit_step_costs: {zeroed} fitted to 0 (the measured steps grow "
                       f"less with it than the rest of the model predicts); remeasure on a "
                       f"quiet machine")
  fitted = dataclasses.replace(model, **{t: float(r) for t, r in zip(terms, rates)})
  errors = tuple(float(step_compute(fitted, s) / s.seconds - 1) for s in steps)
  return StepFit(fitted, terms, errors)


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

  time: seconds, gradient all-reduces included (lock-step: the sum over micro-steps of
    the slowest device; otherwise the last device to finish).
  steps: micro-batches (lock-step: micro-steps; otherwise the most any device runs).
  imbalance: lock-step: sum of step maxima / sum of step means; otherwise the slowest
    device's (or data group's) time over the mean.
  padding: 1 - real tokens / token slots run.
  device_time [steps, devices]: seconds of each micro-step (per-rank: [1, devices], each
    device's finish before the final all-reduces).
  sent: bytes by kind ("kv", "keys", "dkv", "all-reduce": gradients, "all-gather": the
    static layout's and the parameters' over fsdp, "tensor": a tensor group's activation
    all-reduces), each the most any device sends.
  layout: what a layout chose, where it chooses (two-pool: {"rings": rings of c_max}).
  """
  name: str
  time: float
  steps: int
  imbalance: float
  padding: float
  device_time: np.ndarray
  sent: dict
  layout: dict = dataclasses.field(default_factory=dict)


EXECUTORS = ("ideal", "step_ring", "run")
SENT_KINDS = ("kv", "keys", "dkv", "all-reduce", "all-gather", "tensor")


def _most_sent(per_device: dict[str, np.ndarray]) -> dict[str, float]:
  """{kind: the most any device sends} of per-device byte counts."""
  return {kind: float(np.max(per_device.get(kind, 0.0))) for kind in SENT_KINDS}


def group_time(model: cost.CostModel, group_lengths, ring: int, tokens_per_device: int) -> float:
  """Seconds of one member of a ring of `ring` running the packed `group_lengths`."""
  real = int(np.sum(group_lengths))
  share = tokens_per_device if model.pad_compute else -(-real // ring)
  attention = float(np.sum(model.attention(np.asarray(group_lengths)))) / ring
  return model.ring_member(attention, float(model.linear(share)), share, ring)


def _programs(step, *, num_devices: int, tokens_per_device: int, model: cost.CostModel,
              executor: str) -> list[tuple[dict, int]]:
  """Per device, cost.CostModel.device's arguments for one micro-step of device_times, and the
  tokens its matmuls run."""
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
  view = hdp.block_size(int(ring.max(initial=1)))  # the view's context size
  out = []
  for d in range(num_devices):
    tokens = int(ring_tokens[d] + local_tokens[d])
    if executor == "ideal":
      hop_tokens = tokens_per_device if model.pad_compute else int(ring_tokens[d])
      program = int(ring[d])
    else:
      hop_tokens = tokens_per_device if model.pad_compute else tokens
      program = view if executor == "step_ring" else int(ring[d])
    matmul_tokens = tokens_per_device if model.pad_compute else tokens
    out.append((dict(attention=ring_attention[d], linear=float(model.linear(matmul_tokens)),
                     ring=int(ring[d]), hop_tokens=hop_tokens, program_ring=program,
                     local_attention=local_attention[d]), matmul_tokens))
  return out


def device_times(groups: list[list[tuple[Sequence[int], tuple[int, ...]]]], *,
                 num_devices: int, tokens_per_device: int, model: cost.CostModel,
                 executor: str = "ideal") -> np.ndarray:
  """[steps, devices] seconds; a step is a list of (lengths packed together, device ids).

  A device holds at most one ring group (c > 1) and any number of one-device groups
  beside it. executor "ideal" (ByteScale's HDP): only ring members exchange K/V, over
  their own ring, their ring share only. "step_ring" (jaxsys's lock-step HDP executor,
  since removed): a micro-step is one program over the `data = N/C,
  context = C` view of its largest ring C, so every device's whole block takes C - 1
  hops, needed or not. "run" (jaxsys's per-rank executor, a ring's program over just its
  run of c devices): every member's whole block, fill included, takes c - 1 hops.
  With pad_compute every device runs tpd tokens through the matmuls and a hop carries
  tpd tokens. No all-reduce is counted here.
  """
  if executor not in EXECUTORS:
    raise ValueError(f"executor={executor!r}: must be one of {EXECUTORS}")
  kw = dict(num_devices=num_devices, tokens_per_device=tokens_per_device, model=model,
            executor=executor)
  out = np.zeros((len(groups), num_devices))
  for m, step in enumerate(groups):
    out[m] = [model.device(**args) for args, _ in _programs(step, **kw)]
  return out


def _device_sent(groups, *, num_devices: int, tokens_per_device: int, model: cost.CostModel,
                 executor: str) -> dict[str, np.ndarray]:
  """{kind: [devices] bytes} the ring hops of device_times' micro-steps send."""
  kw = dict(num_devices=num_devices, tokens_per_device=tokens_per_device, model=model,
            executor=executor)
  out = {kind: np.zeros(num_devices) for kind in ("kv", "keys", "dkv", "tensor")}
  for step in groups:
    for d, (args, tokens) in enumerate(_programs(step, **kw)):
      for kind, sent in model.sent(args["hop_tokens"], args["program_ring"]).items():
        out[kind][d] += sent
      out["tensor"][d] += model.tensor_bytes(tokens)
  return out


def _padding(real_tokens: int, slots: int) -> float:
  return 1.0 - real_tokens / slots if slots else 0.0


def _lockstep_result(name, times, sent, real_tokens, num_devices, tokens_per_device,
                     allreduce: float) -> Result:
  """A lock-step Result: each micro-step as long as its slowest device, then `allreduce`
  seconds of gradient all-reduces."""
  steps = times.shape[0]
  maxima, means = times.max(axis=1, initial=0.0), times.mean(axis=1) if steps else np.zeros(0)
  imbalance = float(maxima.sum() / means.sum()) if means.sum() else 1.0
  return Result(name, float(maxima.sum()) + allreduce, steps, imbalance,
                _padding(real_tokens, steps * num_devices * tokens_per_device), times,
                _most_sent(sent))


def hdp_groups(steps: Plan, lengths) -> list:
  """An hdp.plan as device_times groups: each sequence its own group."""
  return [[([int(lengths[i])], devs) for i, devs in step] for step in steps]


def simulate_hdp(lengths, *, num_devices: int, tokens_per_device: int,
                 model: cost.CostModel, executor: str = "ideal") -> Result:
  """Lock-step HDP: hdp.plan (costs with the model's d_model) timed by the cost model; one
  gradient all-reduce over the pool per micro-step ("step_ring": jaxsys's removed lock-step
  executor ran each micro-step as a program that ended with one) or at the end ("ideal")."""
  lengths = np.asarray(lengths, np.int64)
  steps = hdp.plan(lengths, num_devices=num_devices, tokens_per_device=tokens_per_device,
                   d_model=model.d_model)
  kw = dict(num_devices=num_devices, tokens_per_device=tokens_per_device, model=model,
            executor=executor)
  groups = hdp_groups(steps, lengths)
  times = device_times(groups, **kw)
  reductions = len(steps) if executor == "step_ring" else 1
  sent = _device_sent(groups, **kw)
  sent["all-reduce"] = np.full(num_devices, reductions * model.allreduce_bytes(num_devices))
  sent["all-gather"] = np.full(num_devices, model.gather_bytes())
  name = "hdp" if executor == "ideal" else f"hdp_{executor}"
  return _lockstep_result(name, times, sent, int(lengths.sum()), num_devices, tokens_per_device,
                          reductions * model.allreduce(num_devices) + model.gather())


@dataclasses.dataclass(frozen=True)
class Job:
  """One micro-batch of a per-rank schedule: a ring on its block or a local batch.

  devices: who runs it; start / end: seconds (a ring's members start together and it
  lasts as long as its slowest, then its gradient all-reduce); busy[k]: seconds
  devices[k] computes or sends; entries: (sequence, device ids relative to `devices`), as
  Ring.entries; sent: bytes each of `devices` sends, by kind.
  """
  devices: tuple[int, ...]
  start: float
  end: float
  busy: np.ndarray
  entries: list
  sent: dict


# How a per-rank step all-reduces its gradients: as HDPStep compiles ("executor":
# each ring program over its devices, then one over the pool, its per-device sums added
# first), or only once at the end, every sum kept per device until then ("once", as the
# static baselines do).
ALLREDUCES = ("executor", "once")


def _check_allreduce(value: str, name: str = "allreduce") -> None:
  if value not in ALLREDUCES:
    raise ValueError(f"{name}={value!r}: must be one of {ALLREDUCES}")


def _ring_job(devices: tuple[int, ...], cell: int, entries, lengths, start: float, *,
              model: cost.CostModel, allreduce: str) -> Job:
  """A ring's Job from `start` (entries: as Ring.entries, indexing `lengths`): one program
  over its c devices (device_times' "run" executor, the cell as the program's tokens per
  device), then, with the executor's all-reduces, one over those devices."""
  c = len(devices)
  group = [[([int(lengths[i])], rel) for i, rel in entries]]
  member = device_times(group, num_devices=c, tokens_per_device=cell, model=model,
                        executor="run")[0]
  reduce = allreduce != "once"
  sent = {**model.sent(cell, c), "all-reduce": model.allreduce_bytes(c) if reduce else 0.0,
          "tensor": model.tensor_bytes(cell)}
  busy = member + (model.allreduce(c) if reduce else 0.0)
  return Job(tuple(devices), start, start + float(busy.max()), busy, entries, sent)


def schedule_jobs(sched: hdp_schedule.Schedule, lengths, *, tokens_per_device: int,
                  model: cost.CostModel, allreduce: str = "executor") -> list[Job]:
  """Every micro-batch of a per-rank schedule with its start and end, in run order.

  As jaxsys's per-rank executor runs it (jaxsys/train/hdp_step.py): each ring is one
  program over its run of c devices (`data = 1, context = c`; `_ring_job`), its members
  start together when the last of them is free, and it lasts as long as its slowest
  member (every member's whole cell, fill included, takes the hops), then all-reduces
  its gradients over its devices (but with allreduce="once", see ALLREDUCES); then each
  device runs its local micro-batches on its own.
  """
  _check_allreduce(allreduce)
  lengths = np.asarray(lengths, np.int64)
  finish = np.zeros(sched.num_devices)
  jobs = []
  for ring in sched.rings:
    devs = list(ring.devices)
    job = _ring_job(ring.devices, ring.cell, ring.entries(), lengths,
                    float(finish[devs].max()), model=model, allreduce=allreduce)
    finish[devs] = job.end
    jobs.append(job)
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
                      [(i, (0,)) for i in batch], {"tensor": model.tensor_bytes(tokens)}))
  return jobs


def schedule_times(sched: hdp_schedule.Schedule, lengths, *, tokens_per_device: int,
                   model: cost.CostModel, allreduce: str = "executor") -> np.ndarray:
  """[devices] seconds until each device has run its part of a per-rank schedule
  (timed as `schedule_jobs` says; the final all-reduces not included)."""
  finish = np.zeros(sched.num_devices)
  for job in schedule_jobs(sched, lengths, tokens_per_device=tokens_per_device, model=model,
                           allreduce=allreduce):
    finish[list(job.devices)] = job.end
  return finish


@dataclasses.dataclass(frozen=True)
class ScheduleCost:
  """The cost model as hdp_schedule.schedule's time estimate (seconds, links and a ring's
  own all-reduce included unless allreduce="once"), so the schedule balances what
  schedule_jobs will time."""
  model: cost.CostModel
  tokens_per_device: int
  allreduce: str = "executor"

  def __post_init__(self):
    _check_allreduce(self.allreduce)

  def cell(self, tokens: int) -> float:
    if not self.model.pad_compute:
      return 0.0
    return self.model.device(attention=0.0, linear=float(self.model.linear(tokens)))

  def ring(self, lengths, devices: int, cell: int) -> float:
    whole = [(i, tuple(range(devices))) for i in range(len(lengths))]
    return _ring_job(tuple(range(devices)), cell, whole, lengths, 0.0, model=self.model,
                     allreduce=self.allreduce).end

  def short(self, length: int) -> float:
    return self.model.device(attention=0.0, linear=float(self.model.linear(length)),
                             local_attention=float(self.model.attention(length)))


def simulate_per_rank(lengths, *, num_devices: int, tokens_per_device: int,
                      model: cost.CostModel, widen: bool = True, allreduce: str = "executor",
                      estimate: str | None = None) -> Result:
  """HDP without lock step: hdp_schedule.schedule (balancing this cost model's times,
  ScheduleCost) timed by schedule_jobs, then the all-reduces over the pool: as
  HDPStep compiles them (allreduce="executor") or as an executor that does not
  exist yet would (see ALLREDUCES). estimate: the all-reduces the schedule's estimate
  counts (default: `allreduce`'s; "once": none of a ring's own). steps: the most
  micro-batches any device runs; imbalance: slowest device over the mean."""
  _check_allreduce(allreduce)
  if estimate is not None:
    _check_allreduce(estimate, "estimate")
  lengths = np.asarray(lengths, np.int64)
  balanced = ScheduleCost(model, tokens_per_device, estimate or allreduce)
  sched = hdp_schedule.schedule(lengths, num_devices=num_devices,
                                tokens_per_device=tokens_per_device, d_model=model.d_model,
                                widen=widen, cost=balanced)
  jobs = schedule_jobs(sched, lengths, tokens_per_device=tokens_per_device, model=model,
                       allreduce=allreduce)
  finish = np.zeros(num_devices)
  sent = {kind: np.zeros(num_devices) for kind in SENT_KINDS}
  for job in jobs:
    finish[list(job.devices)] = job.end
    for kind, nbytes in job.sent.items():
      sent[kind][list(job.devices)] += nbytes
  sent["all-reduce"] += model.allreduce_bytes(num_devices)
  sent["all-gather"] += model.gather_bytes()
  slots = sched.slots(lengths, tokens_per_device)
  name = "hdp_per_rank" if allreduce == "executor" else f"hdp_per_rank_{allreduce}"
  return Result(name, float(finish.max(initial=0.0)) + model.pool_sync(num_devices),
                int(sched.micro_batches().max(initial=0)),
                float(finish.max() / finish.mean()) if finish.mean() else 1.0,
                _padding(int(lengths.sum()), slots), finish[None], _most_sent(sent))


def static_ring(max_len: int, num_devices: int, tokens_per_device: int) -> int:
  """c_max: the ring a static mesh needs for the dataset's longest sequence."""
  c = hdp.ring_size(int(max_len), tokens_per_device)
  if c > num_devices:
    raise ValueError(f"max_len={max_len} needs a ring of {c} devices at tokens_per_device="
                     f"{tokens_per_device}, more than num_devices={num_devices}")
  return c


STATIC_ORDERS = ("loader", "sorted", "padded")
STATIC_SCHEDULES = ("lockstep", "groups", "lpt")


def static_rows(lengths, *, num_devices: int, tokens_per_device: int, max_len: int,
                order: str = "loader", seed: int = 0, d_model: int = cost.DEFAULT_D_MODEL
                ) -> tuple[list[list[int]], int]:
  """(rows of sequence indices, c_max): FFD rows of c_max * tpd tokens in `order`:
  "loader" (a seeded random order, as a data loader hands them out), "sorted" (by cost,
  heaviest first, so heavy rows share lock-step micro-steps) or "padded" (no packing: one
  sequence per row, padded to it, in loader order)."""
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
    work = [float(np.sum(cost.sequence_cost(lengths[r], d_model=d_model))) for r in rows]
    rows = [rows[k] for k in np.argsort(work, kind="stable")[::-1]]
  return rows, c


def static_plan(lengths, *, num_devices: int, tokens_per_device: int, max_len: int,
                order: str = "loader", seed: int = 0, d_model: int = cost.DEFAULT_D_MODEL):
  """Lock-step static CP micro-steps: lists of (row's sequence indices, ring device ids),
  N / c_max of `static_rows`' rows per micro-step, in their order."""
  rows, c = static_rows(lengths, num_devices=num_devices, tokens_per_device=tokens_per_device,
                        max_len=max_len, order=order, seed=seed, d_model=d_model)
  per_step = num_devices // c
  return [[(row, tuple(range(k * c, (k + 1) * c)))
           for k, row in enumerate(rows[start:start + per_step])]
          for start in range(0, len(rows), per_step)]


def layout_gather_bytes(model: cost.CostModel, tokens_per_device: int, ring: int) -> float:
  """Bytes each device all-gathers to lay one static micro-step's rows out over `context`
  (compiled only): (ring - 1) / ring of every field's c * tpd tokens, 4 bytes each."""
  return float(LAYOUT_FIELDS * 4 * (ring - 1) * tokens_per_device) if model.compiled else 0.0


def _static_row(model: cost.CostModel, row_lengths, ring: int, tokens_per_device: int):
  """(seconds, {kind: bytes}) of one ring member running a static row: a ring member's
  time (group_time) and hops, and the row's layout all-gather."""
  share = tokens_per_device if model.pad_compute else -(-int(np.sum(row_lengths)) // ring)
  gather = layout_gather_bytes(model, share, ring)
  seconds = group_time(model, row_lengths, ring, tokens_per_device)
  return seconds + gather / model.link_bytes_per_s, {**model.sent(share, ring),
                                                       "all-gather": gather,
                                                       "tensor": model.tensor_bytes(share)}


def _deal(row_times: np.ndarray, groups: int, schedule: str) -> list[list[int]]:
  """Row indices per data group: lock step and per-group accumulation deal them in order
  (row k to group k mod groups, as a lock-step micro-step takes `groups` rows); LPT gives
  each row, slowest first, to the group done soonest."""
  if schedule != "lpt":
    return [list(range(g, row_times.size, groups)) for g in range(groups)]
  load, dealt = np.zeros(groups), [[] for _ in range(groups)]
  for k in np.argsort(-row_times, kind="stable"):
    g = int(np.argmin(load))
    dealt[g].append(int(k))
    load[g] += row_times[k]
  return dealt


def simulate_static(lengths, *, num_devices: int, tokens_per_device: int, model: cost.CostModel,
                    max_len: int, order: str = "loader", schedule: str = "lockstep",
                    seed: int = 0) -> Result:
  """Static CP: `static_rows` run by the N / c_max data groups as `schedule` says (see the
  module docstring; a lock-step group with no row left runs an empty one), then one
  gradient all-reduce over the pool."""
  if schedule not in STATIC_SCHEDULES:
    raise ValueError(f"schedule={schedule!r}: must be one of {STATIC_SCHEDULES}")
  lengths = np.asarray(lengths, np.int64)
  rows, c = static_rows(lengths, num_devices=num_devices, tokens_per_device=tokens_per_device,
                        max_len=max_len, order=order, seed=seed, d_model=model.d_model)
  row_times, row_sent = zip(*[_static_row(model, lengths[row], c, tokens_per_device)
                              for row in rows]) if rows else ((), ())
  row_times = np.array(row_times)
  groups = num_devices // c
  dealt = _deal(row_times, groups, schedule)
  steps = max(len(ks) for ks in dealt)
  times = np.zeros((steps, num_devices))
  sent = {kind: np.zeros(num_devices) for kind in SENT_KINDS}
  _, empty = _static_row(model, np.zeros(0, np.int64), c, tokens_per_device)
  for g, ks in enumerate(dealt):
    members = slice(g * c, (g + 1) * c)
    times[:len(ks), members] = row_times[ks][:, None]
    idle = steps - len(ks) if schedule == "lockstep" else 0
    for one in [row_sent[k] for k in ks] + [empty] * idle:
      for kind, nbytes in one.items():
        sent[kind][members] += nbytes
  sent["all-reduce"] += model.allreduce_bytes(num_devices)
  sent["all-gather"] += model.gather_bytes()
  reduce = model.pool_sync(num_devices)
  real = int(lengths.sum())
  if schedule == "lockstep":
    return _lockstep_result(f"static_{order}", times, sent, real, num_devices,
                            tokens_per_device, reduce)
  group_total = times.sum(axis=0)[::c]
  return Result(f"static_{schedule}", float(group_total.max()) + reduce, steps,
                float(group_total.max() / group_total.mean()),
                _padding(real, len(rows) * c * tokens_per_device), times, _most_sent(sent))


# ------------------------------------------------------------- two-pool static layouts

# How a two-pool layout spreads its short sequences over its data-parallel devices.
POOL_BALANCES = ("rows", "cost")


def _local_batch_time(model: cost.CostModel, batch_lengths, tokens_per_device: int) -> float:
  """Seconds of one device running a local micro-batch of whole sequences (no ring)."""
  lens = np.asarray(batch_lengths, np.int64)
  tokens = tokens_per_device if model.pad_compute else int(lens.sum())
  return model.device(attention=0.0, linear=float(model.linear(tokens)),
                      local_attention=float(np.sum(model.attention(lens))))


def _alone_times(model: cost.CostModel, lengths,
                 tokens_per_device: int) -> tuple[np.ndarray, float]:
  """(each sequence's local micro-batch alone, seconds; an empty one's): a local
  micro-batch's time is linear in its sequences (cost.CostModel.device with no ring: three
  times, all layers, its matmuls and attention), so one holding several takes `empty`
  plus each one's `alone - empty`."""
  lens = np.asarray(lengths, np.int64)
  tokens = np.full(lens.shape, tokens_per_device) if model.pad_compute else lens
  alone = 3.0 * model.n_layers * (model.linear(tokens) + model.attention(lens))
  return alone, _local_batch_time(model, [], tokens_per_device)


def balance_short(lengths, *, devices: int, tokens_per_device: int, model: cost.CostModel,
                  balance: str = "cost") -> tuple[np.ndarray, list[list[list[int]]]]:
  """(seconds [devices], micro-batches of sequence indices per device): `lengths`, each
  <= tpd, run whole on one device each, in micro-batches of at most tpd tokens.

  balance "rows": first-fit-decreasing rows of tpd tokens, the slowest first to the
  device done soonest (token packing, then LPT). "cost" (Zeppelin's balanced packing,
  arXiv 2509.21841): each sequence, costliest first, to the device whose time it raises
  least: into that device's open micro-batch where it fits (its attention added; its
  matmuls too without pad_compute), else a new micro-batch.
  """
  if balance not in POOL_BALANCES:
    raise ValueError(f"balance={balance!r}: must be one of {POOL_BALANCES}")
  lengths = np.asarray(lengths, np.int64)
  if lengths.size and lengths.max() > tokens_per_device:
    raise ValueError(f"balance_short: a sequence of {int(lengths.max())} tokens does not fit "
                     f"one device (tokens_per_device={tokens_per_device})")
  if lengths.size and devices < 1:
    raise ValueError(f"balance_short: {lengths.size} sequences and no device")
  finish = np.zeros(devices)
  batches: list[list[list[int]]] = [[] for _ in range(devices)]
  alone, empty = _alone_times(model, lengths, tokens_per_device)
  if balance == "rows":
    rows = hdp.pack_rows(lengths, tokens_per_device)
    times = np.array([empty + float(np.sum(alone[r] - empty)) for r in rows])
    for k in np.argsort(-times, kind="stable"):
      d = int(np.argmin(finish))
      batches[d].append(rows[k])
      finish[d] += times[k]
    return finish, batches
  open_tokens = np.full(devices, tokens_per_device + 1, np.int64)  # none open yet
  for i in np.argsort(-alone, kind="stable"):
    n = int(lengths[i])
    fits = open_tokens + n <= tokens_per_device
    after = finish + np.where(fits, alone[i] - empty, alone[i])
    d = int(np.argmin(after))
    if fits[d]:
      batches[d][-1].append(int(i))
      open_tokens[d] += n
    else:
      batches[d].append([int(i)])
      open_tokens[d] = n
    finish[d] = after[d]
  return finish, batches


def simulate_two_pool(lengths, *, num_devices: int, tokens_per_device: int, model: cost.CostModel,
                      max_len: int, balance: str = "rows", long_threshold: int | None = None,
                      rings: int | None = None, seed: int = 0) -> Result:
  """A static layout of two pools: sequences over `long_threshold` tokens (default tpd)
  packed first-fit decreasing into rows of c_max * tpd tokens (c_max: `static_ring`, for
  max_len) on `rings` rings of c_max devices, the rows dealt slowest first to the ring
  done soonest; the rest on the other N - rings * c_max devices, one device each, with no
  context parallelism (`balance_short`); then one gradient all-reduce over the pool.

  rings: None searches the counts from 1 (0 without long sequences) to N / c_max for the
  fastest, the split a fixed layout would be tuned to, here per batch (at N / c_max the
  short sequences share the rings' rows, as `simulate_static` packs them): the count
  where the rings' finish meets the short pool's (bisection, each side monotone up to
  LPT's rounding), its neighbours within 2, and N / c_max. Name "two_pool" (balance
  "rows") or "balanced" ("cost", Zeppelin-style). steps: the most micro-batches a device
  runs; imbalance: slowest device over the mean; layout: {"rings", "ring"}.
  """
  del seed  # the layout does not depend on the loader's order
  if balance not in POOL_BALANCES:
    raise ValueError(f"balance={balance!r}: must be one of {POOL_BALANCES}")
  lengths = np.asarray(lengths, np.int64)
  c = static_ring(max_len, num_devices, tokens_per_device)
  threshold = tokens_per_device if long_threshold is None else int(long_threshold)
  if not 0 < threshold <= tokens_per_device:
    raise ValueError(f"long_threshold={threshold}: must be in (0, tokens_per_device="
                     f"{tokens_per_device}] (a short sequence runs on one device)")
  long = np.flatnonzero(lengths > threshold)
  short = np.flatnonzero(lengths <= threshold)
  most, least = num_devices // c, 1 if long.size else 0
  if rings is not None and not least <= rings <= most:
    raise ValueError(f"rings={rings}: must be in [{least}, {most}] (N / c_max = "
                     f"{num_devices} / {c}; at least one ring for long sequences)")
  name = "two_pool" if balance == "rows" else "balanced"
  packed = {}

  def rows_of(pooled):
    key = pooled.size
    if key not in packed:
      rows = [pooled[r] for r in hdp.pack_rows(lengths[pooled], c * tokens_per_device)]
      packed[key] = rows, [_static_row(model, lengths[r], c, tokens_per_device) for r in rows]
    return packed[key]

  cache = {}

  def layout(k):
    if k not in cache:
      rows, timed = rows_of(long if k < most else np.arange(lengths.size))
      row_times = np.array([t for t, _ in timed])
      dealt = _deal(row_times, k, "lpt") if k else []
      shorts = short if k < most else short[:0]
      finish, batches = balance_short(lengths[shorts], devices=num_devices - k * c,
                                      tokens_per_device=tokens_per_device, model=model,
                                      balance=balance)
      ring_finish = np.array([row_times[ks].sum() for ks in dealt])
      cache[k] = (rows, timed, dealt, shorts, finish, batches, ring_finish)
    return cache[k]

  if rings is not None:
    candidates = {rings}
  else:
    lo, hi = least, most  # the rings finish last at lo; find the first k where they don't
    while hi - lo > 1:
      mid = (lo + hi) // 2
      *_, finish, _, ring_finish = layout(mid)
      if ring_finish.max(initial=0.0) > finish.max(initial=0.0):
        lo = mid
      else:
        hi = mid
    candidates = {k for k in range(lo - 2, hi + 3) if least <= k <= most} | {most}
  best = None
  for k in sorted(candidates):
    rows, timed, dealt, shorts, finish, batches, ring_finish = layout(k)
    per_device = np.concatenate([np.repeat(ring_finish, c), finish])
    time_s = float(per_device.max(initial=0.0)) + model.pool_sync(num_devices)
    if best is not None and time_s >= best.time:
      continue
    sent = {kind: np.zeros(num_devices) for kind in SENT_KINDS}
    for g, ks in enumerate(dealt):
      for kind in SENT_KINDS:
        sent[kind][g * c:(g + 1) * c] += sum(timed[j][1].get(kind, 0.0) for j in ks)
    for d, mbs in enumerate(batches):
      sent["tensor"][k * c + d] += sum(model.tensor_bytes(
          tokens_per_device if model.pad_compute else int(lengths[shorts][mb].sum()))
          for mb in mbs)
    sent["all-reduce"] += model.allreduce_bytes(num_devices)
    sent["all-gather"] += model.gather_bytes()
    steps = max([len(ks) for ks in dealt] + [len(b) for b in batches] + [0])
    slots = (len(rows) * c + sum(len(b) for b in batches)) * tokens_per_device
    best = Result(name, time_s, steps,
                  float(per_device.max() / per_device.mean()) if per_device.mean() else 1.0,
                  _padding(int(lengths.sum()), slots), per_device[None], _most_sent(sent),
                  {"rings": k, "ring": c})
  return best

def _exposed_hops(model: cost.CostModel, length: int, tokens_per_device: int) -> float:
  """Seconds a sequence's ring (on the devices it needs, hops of real tokens only) spends
  on hops its compute does not hide, all members together."""
  c = hdp.devices_needed(int(length), tokens_per_device)
  if c == 1:
    return 0.0
  share = float(model.attention(length)) / c
  member = lambda tokens: model.device(attention=share, linear=0.0, ring=c, hop_tokens=tokens)
  return c * (member(length / c) - member(0))


def lower_bound(lengths, *, num_devices: int, tokens_per_device: int,
                model: cost.CostModel) -> float:
  """Seconds no plan can beat: (all compute + unavoidable exposed ring traffic) / N, then
  one gradient all-reduce over the pool.

  Compute counts real tokens only. A sequence of L > tpd tokens needs at least
  c = ceil(L / tpd) devices; its hops, carrying L / c tokens each, add what they cannot
  hide (`_exposed_hops`).
  """
  lengths = np.asarray(lengths, np.int64)
  attention, linear = model.attention(lengths), model.linear(lengths)
  total = float(np.sum(3.0 * model.n_layers * (attention + linear)))
  total += sum(_exposed_hops(model, int(n), tokens_per_device) for n in lengths)
  return total / num_devices + model.pool_sync(num_devices)


def lockstep_bound(lengths, *, num_devices: int, tokens_per_device: int,
                   model: cost.CostModel) -> float:
  """Seconds no lock-step plan with hdp's ring sizes can beat.

  Every member of a ring (c > 1) counts once per device, sorted by time, slowest first:
  a micro-step holds at most N of them, so the k-th slowest micro-step lasts at least
  member[(k - 1) * N]. Micro-steps beyond those, up to hdp.min_steps, last at least an
  idle device's padding (pad_compute) or 0. Then one gradient all-reduce over the pool.
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
  return (float(terms.sum() + max(0, steps - terms.size) * idle)
          + model.pool_sync(num_devices))


def simulate(lengths, *, num_devices: int, tokens_per_device: int, model: cost.CostModel,
             max_len: int | None = None, seed: int = 0) -> dict:
  """Every strategy's Result by name: hdp_per_rank (see simulate_per_rank), the lock-step
  hdp and hdp_step_ring (see simulate_hdp), static_loader, static_groups and static_lpt
  (see simulate_static), static_sorted and static_padded (lock-step); in seconds the lower
  bound ("bound") and the lock-step bound for hdp's ring sizes ("lockstep_bound").

  max_len sizes the static ring (the dataset's longest sequence); default: the batch's.
  """
  lengths = np.asarray(lengths, np.int64)
  max_len = int(lengths.max()) if max_len is None else max_len
  kw = dict(num_devices=num_devices, tokens_per_device=tokens_per_device, model=model)
  static = dict(max_len=max_len, seed=seed, **kw)
  out = dict(hdp=simulate_hdp(lengths, **kw),
             hdp_step_ring=simulate_hdp(lengths, executor="step_ring", **kw),
             hdp_per_rank=simulate_per_rank(lengths, **kw))
  for schedule in STATIC_SCHEDULES:
    result = simulate_static(lengths, schedule=schedule, **static)
    out[result.name] = result
  for order in ("sorted", "padded"):
    out[f"static_{order}"] = simulate_static(lengths, order=order, **static)
  return dict(out, bound=lower_bound(lengths, **kw), lockstep_bound=lockstep_bound(lengths, **kw))

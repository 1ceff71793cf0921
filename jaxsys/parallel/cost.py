"""The one cost model of a step's work: a layer's FLOPs and a device's seconds.

The planners balance forward FLOPs of one layer (`sequence_cost`; `ForwardEstimate` over
`flop_model`, hdp_schedule's default); the simulator (`hdp_sim`) and the calibration
(`jaxsys.bench.hdp_calibrate`) time whole steps from the same terms with fitted rates and
stated links (`CostModel`, through `hdp_sim.ScheduleCost` when a schedule balances them).
A pipeline's schedule is timed from measured stage times instead (`schedules.Costs`): it
models no FLOPs, so it shares none of these terms.

Forward FLOPs of one layer, d = d_model: causal attention computes half of QK^T and of PV,
2 d FLOPs per token pair; the matmuls (q, k, v, o: 4 d^2, MLP 4x: 8 d^2 weights) 2 * 12 d^2
FLOPs per token. Attention overtakes the matmuls at L = 12 d.

Timing model, per device and layer (every layer alike, times n_layers; backward = twice the
forward's compute):
  attention forward  A = sec_per_attention_flop * 2 d L^2 per sequence (causal); a ring of c
                     gives each member a = A / c (the zigzag layout evens it), in c blocks
                     of b = a / c: its own and c - 1 visiting;
  linear forward     Lin = sec_per_linear_flop * (20 d^2 + 4 d kv_dim) * tokens;
  K/V hop            h = tokens * (2 kv_dim * bytes_per_element [+ 8: int32 segment ids
                     and positions, compiled]) / link;
  dK/dV hop          g = tokens * 2 kv_dim * 4 / link (the f32 accumulators; compiled).
A ring member (overlap=True: the next K/V block moves while this one computes; False: add):
  forward   Lin + b + (c - 1) max(b, h)
  backward, compiled=True (jaxsys's ring attention, `context._ring_bwd`): the K/V blocks go
            round again with their dK/dV accumulators, which can leave only after the step
            that computes them (ring-flash-attention's deferred send), so those hops are
            added, not overlapped; after the last step they go home:
              2 Lin + 2b + (c - 1) (max(2b, h) + g) + g
            (at c = 2 XLA reuses the forward's one K/V hop: h = 0 there);
  backward, compiled=False (an idealised ring): twice the forward, hops included.
A device holding short sequences (c = 1) spends 3 (Lin + sum A). Hops carry whole
fixed-shape blocks (pad_compute) or real tokens only.

Gradient all-reduces (params > 0): one over c devices sends 2 (c - 1) / c * 4 (params + 2)
bytes from each (f32 gradients, the loss sum and token count), taking that / link (the
bandwidth term; latency left out), added after the program that issues it:
  per-rank HDP  one over each ring program's c devices, then one over the pool per sum
                `HDPStep._reduce` adds (the rings', and one per local micro-batch
                size: XLA compiles one each); hdp_sim.ALLREDUCES names two executors that would
                do fewer;
  static        one over the pool at the end. (jaxsys's compiled static step all-reduces
                every micro-batch over `context` and `data`; the baselines are spared that.)
                Compiled, each static micro-step also all-gathers its batch's 5 fields over
                `context` to lay its rows out zigzag (4 bytes a token each);
  lock-step HDP one over the pool per micro-step (jaxsys's lock-step executor, removed
                after it lost to per-rank HDP), or at the end ("ideal").
A sharded model (CostModel.tensor, .fsdp): the N devices above are then slots, each a
tensor group; a device computes 1/tensor of its slot's attention and matmuls, sends
1/tensor of its K/V and dK/dV, and all-reduces activations over its group in every program
(`tensor_bytes`, added, on tensor_link_bytes_per_s); gradient all-reduces carry a device's
tensor shard (`shard_params`: norms whole). With fsdp (ZeRO) a step first gathers the
parameters over fsdp (`gather_bytes`); HDPStep then all-reduces the gradients over
the pool whole, as without fsdp (compiled: no reduce-scatter), and updates the shards.
tests/train/test_hdp_sim_bytes.py ties these byte counts to the executors' compiled
programs (data-only and data=2,fsdp=2,tensor=2). Link figures: `link_bytes_per_s` is one
direction of one device's link, for hops and all-reduces alike; experiments/bench_hdp.py
states the two it simulates.

Example:
  model = flop_model(1024)
  float(model.sequence(4096)) == sequence_cost(4096, d_model=1024)  # True
"""

from __future__ import annotations

import dataclasses
import operator

import numpy as np

DEFAULT_D_MODEL = 1024
ATTENTION_FLOPS_PER_PAIR = 2  # times d_model
LINEAR_FLOPS_PER_TOKEN = 24  # times d_model ** 2
# Beside K and V, each compiled hop carries every token's int32 segment id and position
# (the ring's causal keys).
KEY_BYTES_PER_TOKEN = 8
# jaxsys's ring backward accumulates dK and dV in f32, whatever the model's dtype.
ACCUMULATOR_BYTES = 4
# Gradients are all-reduced in f32.
GRAD_BYTES_PER_PARAM = 4
# Parameters are kept, and gathered over fsdp, in f32.
PARAM_BYTES = 4
# A tensor group's all-reduces of [tokens, d] activations, as XLA compiles the model's
# Megatron split: per layer two forward (attention and MLP outputs) and five backward (the
# input gradients of q, k, v, and of the MLP's two input matmuls, each all-reduced apart);
# beside the layers, the embedding lookup (vocabulary split) and the logits' input gradient.
TENSOR_ALLREDUCES_PER_LAYER = 7
TENSOR_ALLREDUCES_OUTSIDE = 2
# The vocabulary-split loss all-reduces three f32 values a token (max, sum, target logit).
LOSS_BYTES_PER_TOKEN = 12
# The simulated model's vocabulary (for its parameter count): Llama 2's.
VOCAB_SIZE = 32000
# The CostModel fields that set compute (each time is linear in them): what
# `fit_step_costs` may fit, and what `CostModel.scaled` divides.
STEP_TERMS = ("sec_per_attention_flop", "sec_per_linear_flop", "sec_per_element",
              "sec_per_step")

def dense_params(d_model: int, n_layers: int, kv_dim: int, vocab_size: int = VOCAB_SIZE) -> int:
  """Parameters of the dense model the cost model times: per layer q and o (d x d), k and
  v (d x kv_dim), an 8 d^2 MLP and two norms; untied embedding and head, a final norm.
  d 4096, 32 layers: 6.70B with kv_dim 4096 (MHA), 5.90B with 1024 (GQA)."""
  layer = 10 * d_model ** 2 + 2 * d_model * kv_dim + 2 * d_model
  return n_layers * layer + 2 * vocab_size * d_model + d_model


@dataclasses.dataclass(frozen=True)
class CostModel:
  """Seconds of one device's work; compute rates fitted, link bandwidth stated.

  sec_per_attention_flop / sec_per_linear_flop: fitted (`hdp_sim.fit_cost_model`); attention
    FLOPs counted as `sequence_cost` does (2 d L^2 causal), matmul FLOPs 2 (10 d^2 + 2 d kv_dim)
    a token (q, k, v, o and an 8 d^2 MLP: hdp's 24 d^2 when kv_dim = d).
  link_bytes_per_s: one direction of one device's link, for ring hops and all-reduces.
  d_model, n_layers, kv_dim (width of K, and of V, per token), bytes_per_element: the
    simulated model (default: a 7B-class model, d 4096, 32 layers, MHA, bf16).
  overlap: ring hops overlap the attention compute (max per hop) or add to it.
  pad_compute: fixed-shape programs compute and send their padding (every device runs
    tpd tokens through the matmuls; a hop carries tpd tokens), as jax SPMD programs do.
  compiled: hops as jaxsys's ring attention compiles them (see the module docstring);
    False: an idealised ring whose backward is twice its forward.
  params: parameters whose f32 gradients the executors all-reduce; 0 leaves the
    all-reduces out.
  tensor: devices of a slot's tensor group (heads, K/V heads, MLP and vocabulary split
    over them; norms whole on each): each computes 1/tensor of the slot's matmuls and
    attention, sends 1/tensor of its K/V, all-reduces activations over the group (not
    overlapped, on tensor_link_bytes_per_s; default link_bytes_per_s) and holds
    `shard_params` parameters. Every other figure is per device of a slot.
  fsdp: slots the parameters are sharded over (ZeRO): gathered once a step
    (`gather_bytes`), before the step's first program.
  hop_exchange: a ring hop's seconds over its bytes / link: 1 where every member sends
    and receives at once (each on its own link); 2 where the exchange runs one direction
    after the other, as XLA:CPU's collective-permute over gloo did across two processes
    (experiments/hdp_calibrate.py: the link busy for twice the hops' bytes / rate).
  vocab_size, sec_per_element, sec_per_step: the compute beside attention and the layers'
    matmuls, fitted to measured whole steps (`fit_step_costs`); 0 by default, which
    leaves them out (every table that does not set them):
    vocab_size: the output head's matmul, 2 d vocab_size FLOPs a token at the linear rate;
    sec_per_element: the layers' other work (norms, activations, residual adds, rotary,
      softmax bookkeeping, the embedding and loss beside the head), seconds per token and
      d_model element per layer; like the matmuls, counted once forward and twice backward,
      and not split over a tensor group;
    sec_per_step: seconds a step spends whatever its tokens (the optimizer update,
      dispatch, the host's work), added once a step with the pool's collectives
      (`pool_sync`).
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
  compiled: bool = False
  params: int = 0
  tensor: int = 1
  fsdp: int = 1
  tensor_link_bytes_per_s: float | None = None
  hop_exchange: float = 1.0
  vocab_size: int = 0
  sec_per_element: float = 0.0
  sec_per_step: float = 0.0

  def __post_init__(self):
    for name in ("sec_per_attention_flop", "sec_per_linear_flop", "link_bytes_per_s",
                 "tensor_link_bytes_per_s", "hop_exchange"):
      value = getattr(self, name)
      if value is not None and not value > 0:
        raise ValueError(f"CostModel.{name}={value!r}: must be > 0")
    for name in ("d_model", "n_layers", "kv_dim", "bytes_per_element", "tensor", "fsdp"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"CostModel.{name}={value!r}: must be an int >= 1")
    for name in ("params", "vocab_size"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 0:
        raise ValueError(f"CostModel.{name}={value!r}: must be an int >= 0")
    for name in ("sec_per_element", "sec_per_step"):
      value = getattr(self, name)
      if not value >= 0:
        raise ValueError(f"CostModel.{name}={value!r}: must be >= 0")
    if self.kv_dim % self.tensor:
      raise ValueError(f"CostModel.tensor={self.tensor}: must divide kv_dim={self.kv_dim} "
                       f"(K/V heads split over the tensor group)")

  def attention(self, length):
    """Forward seconds of one layer's causal attention over a whole sequence, on one
    device of a tensor group (its 1/tensor of the heads)."""
    length = np.asarray(length, np.float64)
    return (self.sec_per_attention_flop * ATTENTION_FLOPS_PER_PAIR * self.d_model
            * length * length) / self.tensor

  def linear(self, tokens):
    """Forward seconds of one layer's matmuls (q, k, v, o and the MLP; a layer's share of
    the head's) and other per-token work (sec_per_element) over `tokens` tokens on one
    device of a tensor group, and a third of a layer's share of the group's all-reduces
    (every caller counts `linear` three times a layer: forward, backward)."""
    # hdp's 24 d^2 counts k and v as d x d; GQA's are d x kv_dim.
    flops = (LINEAR_FLOPS_PER_TOKEN * self.d_model ** 2
             - 4 * self.d_model * (self.d_model - self.kv_dim)
             + 2 * self.d_model * self.vocab_size / self.n_layers)
    tokens = np.asarray(tokens, np.float64)
    matmuls = self.sec_per_linear_flop * flops * tokens / self.tensor
    other = self.sec_per_element * self.d_model * tokens
    return matmuls + other + self.tensor_allreduce(tokens) / (3 * self.n_layers)

  def sequence(self, length):
    """Forward seconds of one layer over a whole sequence held on one device (of a
    tensor group): its attention and matmuls."""
    return self.attention(length) + self.linear(length)

  def tensor_bytes(self, tokens) -> float:
    """Bytes each device of a tensor group sends in a program's activation all-reduces
    (see TENSOR_ALLREDUCES_PER_LAYER) over `tokens` tokens."""
    width = ((TENSOR_ALLREDUCES_PER_LAYER * self.n_layers + TENSOR_ALLREDUCES_OUTSIDE)
             * self.d_model * self.bytes_per_element + LOSS_BYTES_PER_TOKEN)
    return 2.0 * (self.tensor - 1) / self.tensor * width * np.asarray(tokens, np.float64)

  def tensor_allreduce(self, tokens):
    """Seconds of a program's tensor all-reduces over `tokens` tokens (0 without tensor)."""
    return self.tensor_bytes(tokens) / (self.tensor_link_bytes_per_s or self.link_bytes_per_s)

  def kv_bytes(self, tokens) -> float:
    """Bytes of one hop's K and V blocks of `tokens` tokens (a device's K/V heads)."""
    return 2.0 * tokens * (self.kv_dim // self.tensor) * self.bytes_per_element

  def key_bytes(self, tokens) -> float:
    """Bytes of one hop's segment ids and positions (compiled only)."""
    return float(tokens * KEY_BYTES_PER_TOKEN) if self.compiled else 0.0

  def dkv_bytes(self, tokens) -> float:
    """Bytes of one backward hop's dK and dV (f32 accumulators, compiled)."""
    width = ACCUMULATOR_BYTES if self.compiled else self.bytes_per_element
    return 2.0 * tokens * (self.kv_dim // self.tensor) * width

  def hop(self, tokens) -> float:
    """Seconds to pass one device's K/V block (with its keys) to the next ring member."""
    return (self.hop_exchange * (self.kv_bytes(tokens) + self.key_bytes(tokens))
            / self.link_bytes_per_s)

  def hops(self, ring: int) -> tuple[int, int, int]:
    """(forward K/V hops, backward K/V hops, backward dK/dV hops) per layer of a program
    whose ring has `ring` devices."""
    if ring == 1:
      return 0, 0, 0
    if not self.compiled:
      return ring - 1, ring - 1, ring - 1
    # XLA reuses the forward's single K/V hop at c = 2; dK/dV take one more hop home.
    return ring - 1, (ring - 1 if ring > 2 else 0), ring

  def sent(self, tokens, ring: int) -> dict[str, float]:
    """Bytes each device of a ring program of `ring` devices sends, all layers, its hops
    carrying `tokens` tokens: K/V ("kv"), their segment ids and positions ("keys") and
    the backward's dK/dV ("dkv")."""
    forward, backward, dkv = self.hops(ring)
    return {"kv": self.n_layers * (forward + backward) * self.kv_bytes(tokens),
            "keys": self.n_layers * (forward + backward) * self.key_bytes(tokens),
            "dkv": self.n_layers * dkv * self.dkv_bytes(tokens)}

  def shard_params(self) -> int:
    """Parameters one device of a tensor group holds (gathered over fsdp): all but the
    norms split over the group, the norms ((2 n_layers + 1) d: two a layer, one final) whole."""
    if self.tensor == 1:
      return self.params
    norms = (2 * self.n_layers + 1) * self.d_model
    return (self.params - norms) // self.tensor + norms

  def grad_bytes(self) -> int:
    """Bytes one gradient all-reduce carries: a device's f32 gradients, loss sum and token
    count."""
    return GRAD_BYTES_PER_PARAM * (self.shard_params() + 2) if self.params else 0

  def gather_bytes(self) -> float:
    """Bytes each device sends to gather its parameters over fsdp: its 1/fsdp share of
    them to each of the fsdp - 1 others."""
    return (self.fsdp - 1) / self.fsdp * PARAM_BYTES * self.shard_params()

  def gather(self) -> float:
    """Seconds of the parameters' gather over fsdp (0 without fsdp)."""
    return self.gather_bytes() / self.link_bytes_per_s

  def pool_sync(self, slots: int) -> float:
    """Seconds a step spends beside its micro-batches: the pool's own collectives (one
    gradient all-reduce over the `slots` slots, HDPStep's, with fsdp too:
    all-reduced whole, then each slot keeps its shard; the parameters' gather over fsdp)
    and the fixed sec_per_step."""
    return self.allreduce(slots) + self.gather() + self.sec_per_step

  def allreduce_bytes(self, devices: int) -> float:
    """Bytes each of `devices` sends in a ring all-reduce of the gradients."""
    return 2.0 * (devices - 1) / devices * self.grad_bytes()

  def allreduce(self, devices: int) -> float:
    """Seconds of a gradient all-reduce over `devices` (its bandwidth term)."""
    return self.allreduce_bytes(devices) / self.link_bytes_per_s

  def ring_member(self, attention, linear, share_tokens, ring):
    """Forward + backward seconds, all layers, of one ring member (see the module doc)."""
    return self.device(attention=attention, linear=linear, ring=ring,
                       hop_tokens=share_tokens)

  def device(self, *, attention, linear, ring=1, hop_tokens=0, program_ring=None,
             local_attention=0.0):
    """Forward + backward seconds, all layers, of one device in one micro-step.

    attention: its share of its ring's sequence(s), in `ring` equal blocks (1 local, the
    rest visiting); local_attention: sequences held whole on it; the program's ring
    (default `ring`) moves `hop_tokens` tokens of K/V per hop, and the hops beyond `ring`
    carry no work for this device (nothing to overlap them with).
    """
    program_ring = ring if program_ring is None else program_ring
    _, backward_hops, dkv_hops = self.hops(program_ring)
    block = attention / ring
    compute = linear + local_attention + block
    h = self.hop(hop_tokens)
    g = self.hop_exchange * self.dkv_bytes(hop_tokens) / self.link_bytes_per_s
    join = max if self.overlap else operator.add
    visiting, bare = ring - 1, program_ring - ring
    forward = compute + visiting * join(block, h) + bare * h
    h_back = h if backward_hops else 0.0
    if self.compiled:  # dK/dV leave after the step that computes them: added
      backward = (2 * compute + visiting * join(2 * block, h_back) + bare * h_back
                  + dkv_hops * g)
    else:  # dK/dV travel with K/V, overlapped as they are
      backward = 2 * compute + visiting * join(2 * block, h + g) + bare * (h + g)
    return self.n_layers * (forward + backward)

  def scaled(self, compute_speedup: float) -> CostModel:
    """The same model on a device `compute_speedup` times faster (every compute term,
    sec_per_step too); links unchanged."""
    if not compute_speedup > 0:
      raise ValueError(f"compute_speedup={compute_speedup!r}: must be > 0")
    return dataclasses.replace(
        self, **{name: getattr(self, name) / compute_speedup for name in STEP_TERMS})


def sequence_cost(length, *, d_model: int = DEFAULT_D_MODEL):
  """Forward FLOPs of one layer on a sequence: 2 d L^2 (causal attention) + 24 d^2 L.

  Works on ints and numpy arrays. A ring of c devices gives each device cost / c (the
  zigzag layout evens the causal work); ring communication is not counted. The terms of
  `flop_model(d_model).sequence(length)`, without building a model in the planners' loops.
  """
  length = np.asarray(length, np.float64) if not isinstance(length, int) else float(length)
  return ATTENTION_FLOPS_PER_PAIR * d_model * length * length + (
      LINEAR_FLOPS_PER_TOKEN * d_model * d_model * length)


def flop_model(d_model: int = DEFAULT_D_MODEL) -> CostModel:
  """One FLOP a second and free links: the model's times are FLOPs of one layer (K/V as
  wide as the model), real tokens only."""
  return CostModel(sec_per_attention_flop=1.0, sec_per_linear_flop=1.0,
                   link_bytes_per_s=float("inf"), d_model=d_model, n_layers=1,
                   kv_dim=d_model, pad_compute=False)


@dataclasses.dataclass(frozen=True)
class ForwardEstimate:
  """A per-rank schedule's time estimate (hdp_schedule.schedule's `cost`): one layer's
  forward. A ring member runs its whole cell through the matmuls (fixed shapes: padding
  too) and its share of the ring's attention; ring traffic is free."""
  model: CostModel

  def cell(self, tokens: int) -> float:
    """The matmuls of a cell of `tokens` slots: what they cost, filled or not."""
    return float(self.model.linear(tokens))

  def ring(self, lengths, devices: int, cell: int) -> float:
    """A member's time in a ring of `devices` with cells of `cell` slots holding
    `lengths` (split over all of it)."""
    return self.cell(cell) + float(np.sum(self.model.attention(lengths))) / devices

  def short(self, length: int) -> float:
    """A whole short sequence's time on one device."""
    return float(self.model.sequence(int(length)))

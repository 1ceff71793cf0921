"""Pipeline parallelism: one SPMD executor that runs any schedule over the `stage` mesh axis.

The layout is a view of the model's stacked layers: `[layers, ...]` reshaped to
`[virtual, stage, layers/chunk, ...]`, so global chunk g = virtual * stages + stage
holds layers g*chunk .. (g+1)*chunk - 1 and lives on stage g % stages (`to_stages`,
`from_stages`; no data moves for `virtual=1`). A schedule (`schedules.py`) is data: for
every tick and stage, forward, backward or idle, with the buffer slots each action reads
and writes; the executor runs it as `schedule.executed`, the table's ticks or the same
order fused into ticks of a backward-type action and a forward (`schedules.Ticks`).
`pipeline_loss_and_grads` walks the ticks in one `lax.scan` inside a `jax.shard_map` over
`stage` (data/fsdp/tensor stay automatic within each stage):

  arrivals -> (VP: T pass) -> embed phase -> compute (one switch over the tick's action
  combinations: idle, forward, backward, or backward then forward; a backward's chunk
  gradients then added to their sum by a two-way conditional of its own) -> head phase
  (VP: S pass) -> embed-gradient phase -> ppermute activations to stage+1, gradients to
  stage-1

A forward keeps its chunk's `jax.vjp` residuals in a slot of a buffer of
`Ticks.res_slots` entries (1F1B: `stages`, GPipe: `microbatches`): only residuals that
depend on the microbatch (`dependence.py`); the weight-only ones (the weights, reshaped
weights) the backward recomputes from the live weights. Zero-bubble schedules (ZB-H1,
ZBV) split the backward into an input-gradient pass B and a weight-gradient pass W: the
chunk's backward jaxpr unzipped by partial evaluation (`chunk.Chunk._split`), B handing W the
cotangents it needs in a stash slot; a schedule whose chunks do not sit where the layout
keeps them (ZBV's V) gets them by one ppermute per virtual row a step.

The head (final norm, output layer, cross-entropy) and the input embedding run in phases
all stages join, on the ticks the schedule says, so vocabulary parallelism (`vocab.py`:
both split over `stage`, or over `stage` x `tensor` where the layout has a tensor size)
runs inside the schedule rather than after it. Training with VP, the head is the paper's
S and T passes on the ticks the schedule gives them (`Ticks.vocab_s_microbatch`,
`vocab_t_microbatch`): the S pass (broadcast, logits, statistics, their all-reduce) at the
end of the tick of the last chunk's forward, the T pass (loss, dh and its all-reduce, dw)
at the start of the next tick, so the statistics' all-reduce is carried in the loop state
from one tick to the next instead of feeding the same tick's T pass, and the head stage's
backward still runs on the T pass's tick. With the schedule's `vocab_overlap` (1F1B) each
pass runs beside the lanes of a tick of its own, the S pass the tick after the head's and
the T pass the one after, both all-reduces' results carried to the next tick: the dh one
becomes the head stage's gradient arrival there (through the final norm's backward).
Without VP the first and last stage own the (replicated) vocabulary layers and the other
stages skip those phases. Evaluation (`pipeline_loss`) runs the schedule's forwards only.

Loss and gradients are those of the summed token loss; the caller divides once by the
token count, so the step equals the unpipelined one.

`replica_loss_and_grads` runs R such pipelines at once, one per replica of a `replica` x
`stage` mesh (parameters [R, ...], the shard_map manual over both axes). With fixed
routing they are independent (what `grads.over_replicas` of a pipeline runs); with
`shifts` (`routing.py`, NoLoCo's random routing) each chunk boundary moves a
microbatch's activation to another replica's next stage, and its
gradient back along the same path: the executor's transport (`transport.py`: `Ring` or
`Routed`) is the one place that knows. Every replica then holds the whole batch's small
integer arrays, so the chunk, head and embedding that meet a microbatch read its
positions, targets and mask from the replica it started on; its loss is counted there.
"""
from jaxsys.parallel.pipeline import chunk, executor, head, layout, transport
from jaxsys.parallel.pipeline.executor import (pipeline_loss, pipeline_loss_and_grads,
                                               replica_loss_and_grads)
from jaxsys.parallel.pipeline.layout import (AXIS, DATA_AXIS, FSDP_AXIS, SCHEDULES, TENSOR_AXIS,
                                             VOCAB_PARAMS, Layout, check_layout, from_stages,
                                             split_microbatches, to_stages)
from jaxsys.parallel.schedules import (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, IDLE,
                                       KINDS, Schedule, make_schedule)

__all__ = ["make_schedule", "Schedule", "Layout", "to_stages", "from_stages", "check_layout",
           "pipeline_loss_and_grads", "pipeline_loss", "replica_loss_and_grads",
           "split_microbatches"]

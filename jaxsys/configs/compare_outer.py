"""Data parallel vs DiLoCo vs NoLoCo vs CO2 on a small byte-level LM, at equal steps and tokens.

Run (8 simulated devices; on a 2-core CPU about 3 minutes of pretraining, then about
5 minutes per row, 85 minutes for the 15 rows):
  XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m experiments.compare_outer \
      --config=configs/compare_outer.py --workdir=/tmp/jaxsys_outer_warm [--runs=dp,diloco_k4_h50]
`configs/compare_outer.py:streaming`: data parallel, DiLoCo and Streaming DiLoCo (2 and 4
fragments; 4 with the paper's overlap and mixing) on a 4-layer model of the same size.
`configs/compare_outer.py:routing`: DiLoCo and NoLoCo over replicas that are each a 2-stage
pipeline (k = 2 and 4), NoLoCo with and without random routing between the replicas.
`configs/compare_outer.py:long_h`: DiLoCo at H = 100, 250 and 500 and NoLoCo at H = 100
(k = 4) against data parallel on the test-sized model, 500 + 1500 steps: with
`--seeds=0,1,2,3,4` the paired 95% intervals of each gap.

Protocol (DiLoCo, arXiv 2311.08105 Sec. 3): one data-parallel run of `pretrain_steps`
steps (in <workdir>/pretrain, data seed `seed + 1` so the rows do not replay its
batches), then every row starts from its parameters (`init_from`) with fresh inner
and outer optimizer states and trains `total_steps` more inner steps on the same
global batch of `data.batch_size` rows: k replicas take B/k rows each, data parallel
splits the batch over 8 workers. `--config.pretrain_steps=0` gives the from-scratch
comparison. `runs` names the rows of the table; `run_specs` holds each run's config
overrides (nested like the config).
"""
import importlib.util
import pathlib

import ml_collections


def _tiny_lm():
  spec = importlib.util.spec_from_file_location(
      "tiny_lm", pathlib.Path(__file__).with_name("tiny_lm.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _outer(name, k, h, **kw):
  return dict(mesh=f"replica={k},data={8 // k}",
              outer=dict(name=name, sync_every=h, **kw))


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  if arg not in (None, "", "streaming", "routing", "long_h"):
    raise ValueError(f"configs/compare_outer.py: argument {arg!r} is unknown; valid: none, "
                     "'streaming' (the Streaming DiLoCo rows, on a 4-layer model), 'routing' "
                     "(DiLoCo and NoLoCo over 2-stage pipelined replicas, NoLoCo with and "
                     "without random routing) or 'long_h' (DiLoCo at H = 100, 250 and 500 and "
                     "NoLoCo at H = 100, k = 4, on the test-sized model: the 5-seed study)")
  c = _tiny_lm().get_config("size=test")
  # Between the `test` and `tiny` sizes: big enough that the methods separate, small enough
  # that a row takes about 5 minutes on 2 quiet CPU cores.
  c.model.update(dict(d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=384))
  c.data.update(dict(seq_len=128, batch_size=32, num_threads=2))
  # DiLoCo warm-starts after about a quarter of its run (24k of 88k steps); here 1000
  # of 2600, long enough that H=50 makes 32 outer steps.
  c.pretrain_steps = 1000  # data-parallel warm start shared by every row; 0: from scratch
  c.total_steps = 1600  # after the warm start
  # True: the pretrain and each row share one learning-rate curve over both (the rows skip
  # its first pretrain_steps), as a run that switches to the outer optimizer mid-training
  # would; False: each row warms up and decays again (that re-warm cost DiLoCo 1.5 points
  # more than data parallel).
  c.continue_schedule = True
  c.log_every = 100
  c.eval_every = 100
  c.eval_steps = 4  # the curves; the table scores the final parameters on final_eval_batches
  # 0: the whole val split (124 batches here). Its first 4 batches alone put DiLoCo 0.2% behind
  # data parallel where the whole split says 0.9%.
  c.final_eval_batches = 0
  c.checkpoint_every = 400  # a crashed comparison resumes its run from here
  c.keep_checkpoints = 1
  c.optimizer.update(dict(learning_rate=3e-3, warmup_steps=20))
  c.mesh = "data=-1"  # data parallel: 8 workers; the table compares bytes at the same k

  runs = {"dp": dict()}
  runs["diloco_k4_h50"] = _outer("diloco", 4, 50)
  runs["diloco_k4_h50_int8"] = _outer("diloco", 4, 50, compression="int8")
  runs["noloco_k4_h50"] = _outer("noloco", 4, 50)
  # NoLoCo with a full step toward the group mean (outer lr = gamma = 1; the authors' code
  # uses 0.7): the better of the two in a 400-step sweep.
  runs["noloco_k4_h50_lr1"] = _outer("noloco", 4, 50, lr=1.0, gamma=1.0)
  # More outer momentum, toward DiLoCo's 0.9 (whose long-run outer step is 7x a pseudo-gradient
  # where NoLoCo's defaults give 1.4x); it also damps the replicas' disagreement more slowly.
  runs["noloco_k4_h50_m09"] = _outer("noloco", 4, 50, momentum=0.9)
  runs["noloco_k4_h50_lr1_m08"] = _outer("noloco", 4, 50, lr=1.0, gamma=1.0,
                                         momentum=0.8)
  # No momentum: each replica's slow weights become its group's mean (gossip local SGD).
  runs["noloco_k4_h50_lr1_m0"] = _outer("noloco", 4, 50, lr=1.0, gamma=1.0,
                                        momentum=0.0)
  runs["noloco_k8_h50"] = _outer("noloco", 8, 50)  # four pairs: gossip has further to spread
  # CO2's code defaults (lambda = 1) are outside its stability bound alpha/lambda < 1 - beta
  # (jaxsys/optim/co2.py) and diverge; lambda = 3, the library's default, is inside it.
  runs["co2_k4_h50"] = _outer("co2", 4, 50, staleness_penalty=3.0)
  for k in (4, 8):
    for h in (10, 50, 100):
      runs.setdefault(f"diloco_k{k}_h{h}", _outer("diloco", k, h))
  if arg == "streaming":
    # Streaming DiLoCo syncs fragments of layers (fragments must divide n_layers): 4 layers
    # of d=96, about the 2-layer model's parameters (491k against 459k) and cost.
    c.model.update(dict(d_model=96, n_layers=4, d_ff=288))
    runs = {"dp": dict(), "diloco_k4_h50": _outer("diloco", 4, 50)}
    for f in (2, 4):  # each fragment every 50 steps: DiLoCo's total bytes, 1/f at a time
      runs[f"streaming_k4_h50_f{f}"] = _outer("streaming_diloco", 4, 50, fragments=f)
    # The paper's overlap and mixing: each result lands 5 steps after its all-reduce starts,
    # half global, half local.
    runs["streaming_k4_h50_f4_t5_a05"] = _outer("streaming_diloco", 4, 50, fragments=4,
                                                overlap_steps=5, mixing=0.5)
  if arg == "routing":
    # Each replica a 2-stage 1F1B pipeline (one layer a stage); NoLoCo with its activations
    # routed at random between the replicas' stages (arXiv 2506.10911) and without.
    runs = {"dp": dict()}
    for k in (2, 4):
      mesh = f"replica={k},stage=2" + (f",data={8 // (2 * k)}" if k < 4 else "")
      piped = lambda name, **kw: dict(_outer(name, k, 50, **kw), mesh=mesh,
                                      pipeline=dict(schedule="1f1b", microbatches=4))
      runs[f"diloco_k{k}_h50_pp"] = piped("diloco")
      runs[f"noloco_k{k}_h50_pp"] = piped("noloco")
      runs[f"noloco_k{k}_h50_pp_routed"] = dict(piped("noloco"), pipeline=dict(
          schedule="1f1b", microbatches=4, routing="random"))
  if arg == "long_h":
    # Long syncs need many steps: the test-sized model (64 wide), so five seeds of five rows
    # fit in well under an hour on 2 cores; 500 warm-start steps, then 1500 (H=500: 3 syncs).
    c.model.update(dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128))
    c.pretrain_steps, c.total_steps = 500, 1500
    c.checkpoint_every = 500
    runs = {"dp": dict(), **{f"diloco_k4_h{h}": _outer("diloco", 4, h) for h in (100, 250, 500)},
            "noloco_k4_h100": _outer("noloco", 4, 100)}
  c.runs = ",".join(runs)
  c.run_specs = ml_collections.ConfigDict(runs)
  return c

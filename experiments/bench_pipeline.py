r"""Pipeline and vocabulary parallelism on simulated devices: bubbles, FLOPs, memory, balance.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 taskset -c 1 \
      python -m experiments.bench_pipeline --out=/tmp/bench_pipeline.json \
      --chart=docs/pipeline_schedules.png

(The script sets 8 simulated CPU devices itself when XLA_FLAGS does not name a count.)
It prints a markdown table per part (--parts) and writes every number to --out; what each
part measures: `jaxsys/bench/pipeline.py`.
"""
from __future__ import annotations

from jaxsys import xla_flags

xla_flags.default_cpu_devices(8)

from absl import app, flags

from jaxsys.bench.pipeline import log, run, tables

_STAGES = flags.DEFINE_list("stages", ["2", "4", "8"], "Stages p (mesh stage=p, data=8/p).")
_MICROBATCHES = flags.DEFINE_list("microbatches", ["4", "8", "16", "32"], "Microbatches m.")
_SCHEDULES = flags.DEFINE_list("schedules", ["gpipe", "1f1b", "interleaved_1f1b"],
                               "Schedules of tables 1 and 2 (any of SCHEDULES).")
_SKIP = flags.DEFINE_list("skip", [], "p:m pairs to leave out of the schedule grid, e.g. 8:32.")
_D_MODEL = flags.DEFINE_integer("d_model", 64, "Schedule/memory model width.")
_N_LAYERS = flags.DEFINE_integer("n_layers", 16, "Schedule/memory model layers (a multiple of 2p).")
_SEQ = flags.DEFINE_integer("seq", 32, "Schedule grid sequence length.")
_MEM_STAGES = flags.DEFINE_integer("mem_stages", 4, "Memory table: stages p (data=8/p).")
_MEM_MICROBATCHES = flags.DEFINE_list("mem_microbatches", ["4", "8", "16"], "Memory table: m.")
_MEM_SEQ = flags.DEFINE_integer("mem_seq", 256, "Memory table: sequence length.")
_MEM_ROWS = flags.DEFINE_integer("mem_rows", 1, "Memory table: rows per device per microbatch.")
_VOCABS = flags.DEFINE_list("vocabs", ["32768", "65536", "131072", "262144"], "Vocabulary sizes.")
_V_D_MODEL = flags.DEFINE_integer("vocab_d_model", 1024, "Vocabulary table: model width.")
_V_LAYERS = flags.DEFINE_integer("vocab_layers", 4, "Vocabulary table: layers (one per stage).")
_V_D_FF = flags.DEFINE_integer("vocab_d_ff", 4096, "Vocabulary table: MLP width.")
_V_HEADS = flags.DEFINE_integer("vocab_heads", 16, "Vocabulary table: heads (= kv heads).")
_V_SEQ = flags.DEFINE_integer("vocab_seq", 1024, "Vocabulary table: tokens per microbatch.")
_V_STAGES = flags.DEFINE_integer("vocab_stages", 4, "Vocabulary table: stages p (data=8/p).")
_PARTS = flags.DEFINE_list("parts", ["schedules", "memory", "vocab"],
                           "Which tables to make: schedules, memory, vocab, cpu.")
_CPU_REPEATS = flags.DEFINE_integer("cpu_repeats", 5, "Step CPU table: timed steps (median).")
_CPU_EXTRA = flags.DEFINE_list("cpu_extra", [], "Step CPU table: more schedules (eager_1f1b, "
                                "zb_h1, zbv).")
_CPU_BOTH = flags.DEFINE_bool("cpu_both_shapes", False,
                              "Step CPU table: each schedule in fused and table ticks.")
_OUT = flags.DEFINE_string("out", "/tmp/bench_pipeline.json", "JSON file with every number.")
_CHART = flags.DEFINE_string("chart", "", "If set, a PNG of the p=4, m=8 schedules' tick charts.")


def main(argv):
  del argv
  ints = lambda xs: [int(x) for x in xs]
  skip = tuple(tuple(int(y) for y in s.split(":")) for s in _SKIP.value)
  result = run(
      _PARTS.value, stages_list=ints(_STAGES.value), microbatches_list=ints(_MICROBATCHES.value),
      skip=skip, names=_SCHEDULES.value, mem_names=_SCHEDULES.value, d_model=_D_MODEL.value,
      n_layers=_N_LAYERS.value, seq=_SEQ.value,
      mem_stages=_MEM_STAGES.value, mem_microbatches=ints(_MEM_MICROBATCHES.value),
      mem_seq=_MEM_SEQ.value, mem_rows=_MEM_ROWS.value, vocabs=ints(_VOCABS.value),
      vocab_kw=dict(d_model=_V_D_MODEL.value, n_layers=_V_LAYERS.value, d_ff=_V_D_FF.value,
                    heads=_V_HEADS.value, stages=_V_STAGES.value, tokens=_V_SEQ.value),
      cpu_kw=dict(repeats=_CPU_REPEATS.value, extra=tuple(_CPU_EXTRA.value),
                  both_shapes=_CPU_BOTH.value),
      out_path=_OUT.value, chart_path=_CHART.value or None)
  print(tables(result))
  log(f"wrote {_OUT.value} ({result['seconds']:.0f}s)")


if __name__ == "__main__":
  app.run(main)

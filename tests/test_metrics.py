"""Metric writer (JSON lines + real TensorBoard event files), progress, the MFU peak."""
import glob
import io
import math
import struct
from unittest import mock

import jax
import pytest

from tensorboardX.proto import event_pb2

from jaxsys import metrics


def read_tensorboard_scalars(logdir: str) -> dict[str, list[tuple[int, float]]]:
  """Parses TFRecord-framed Event protos: [len u64][crc u32][data][crc u32] per record."""
  out: dict[str, list[tuple[int, float]]] = {}
  for path in glob.glob(f"{logdir}/events.out.tfevents.*"):
    data = open(path, "rb").read()
    f = io.BytesIO(data)
    while header := f.read(12):
      (length,) = struct.unpack("<Q", header[:8])
      event = event_pb2.Event.FromString(f.read(length))
      f.read(4)
      for v in event.summary.value:
        out.setdefault(v.tag, []).append((event.step, v.simple_value))
  return out


def test_writer_jsonl_and_tensorboard(tmp_path):
  w = metrics.MetricWriter(str(tmp_path))
  w.write(1, {"loss": 2.5, "tokens_per_s": 100})
  w.write(2, {"loss": float("nan")})
  w.write(2, {"val_bpb": 1.25})
  w.close()
  rows = metrics.read_metrics(str(tmp_path))
  assert rows[0] == {"step": 1, "loss": 2.5, "tokens_per_s": 100}
  assert rows[1] == {"step": 2, "loss": "nan"}  # JSON has no NaN: kept as a string
  assert rows[2] == {"step": 2, "val_bpb": 1.25}
  scalars = read_tensorboard_scalars(w.tb_dir)
  assert scalars["loss"][0] == (1, 2.5)
  assert scalars["val_bpb"] == [(2, 1.25)]


def test_writer_appends_on_resume(tmp_path):
  for step in (1, 2):
    w = metrics.MetricWriter(str(tmp_path), tensorboard=False)
    w.write(step, {"loss": 1.0})
    w.close()
  assert [r["step"] for r in metrics.read_metrics(str(tmp_path))] == [1, 2]


def test_progress_logs_without_terminal(caplog):
  p = metrics.Progress(total=10, tty=False, log_every_s=0.0)
  with caplog.at_level("INFO"):
    p.update(5, loss=1.5, tokens_per_s=12345.0)
  p.close()
  assert "step 5/10" in caplog.text and "loss=1.500" in caplog.text and "12,345" in caplog.text


def test_matmul_peak_is_positive():
  flops = metrics.measure_matmul_flops(n=256, repeats=2)
  assert math.isfinite(flops) and flops > 1e8


def _on(backend: str, kind: str):
  """Patches jax to look like `jax.device_count()` devices of `kind` on `backend`."""
  device = mock.Mock(device_kind=kind)
  return mock.patch.multiple(jax, default_backend=mock.Mock(return_value=backend),
                             devices=mock.Mock(return_value=[device]))


@pytest.mark.parametrize("kind, per_chip", [("NVIDIA H100 80GB HBM3", 989e12),
                                            ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H200", 989e12),
                                            ("TPU v5 lite", 197e12), ("TPU v5", 459e12),
                                            ("TPU v6 lite", 918e12)])
def test_accelerator_peak_is_the_datasheet_times_devices(kind, per_chip):
  with _on("gpu" if "NVIDIA" in kind else "tpu", kind), \
      mock.patch.object(metrics, "measure_matmul_flops", side_effect=AssertionError("measured")):
    peak = metrics.peak_flops("float32")
  assert peak.flops == per_chip * jax.device_count()
  assert kind in peak.source and "datasheet" in peak.source


def test_cpu_and_unlisted_chips_measure():
  assert metrics.datasheet_peak() is None  # the tests' CPU
  metrics.measured_matmul_peak.cache_clear()  # a run in this process may have measured
  with _on("gpu", "NVIDIA B9000"), mock.patch.object(metrics, "measure_matmul_flops",
                                                     return_value=2e12) as measure:
    peak = metrics.peak_flops("bfloat16")
  assert peak.flops == 2e12 * jax.device_count() and "'NVIDIA B9000'" in peak.source
  assert {c.args for c in measure.call_args_list} == {("bfloat16", 1024), ("bfloat16", 2048)}
  with mock.patch.object(metrics, "measure_matmul_flops", return_value=1e11) as measure:
    assert metrics.peak_flops() == (1e11, "measured float32 matmul peak of the host")
    assert metrics.peak_flops() == (1e11, "measured float32 matmul peak of the host")
  # Once a process (the second call cached), in sizes a CPU reaches its peak at.
  assert {c.args for c in measure.call_args_list} == {("float32", 512), ("float32", 1024)}
  assert measure.call_count == 2
  metrics.measured_matmul_peak.cache_clear()


def test_a_resumed_writer_moves_replayed_rows_aside(tmp_path):
  w = metrics.MetricWriter(str(tmp_path), tensorboard=False)
  for step in (1, 2, 3, 4):
    w.write(step, {"loss": float(step)})
  w.close()
  with open(tmp_path / "metrics.jsonl", "a", encoding="utf-8") as f:
    f.write('{"step": 5, "lo')  # a row a crash cut short
  w = metrics.MetricWriter(str(tmp_path), tensorboard=False, resume_step=2)
  w.write(3, {"loss": 30.0})
  w.close()
  assert [(r["step"], r["loss"]) for r in metrics.read_metrics(str(tmp_path))] == [
      (1, 1.0), (2, 2.0), (3, 30.0)]
  moved = (tmp_path / "metrics.replayed.jsonl").read_text().splitlines()
  assert moved[:2] == ['{"step": 3, "loss": 3.0}', '{"step": 4, "loss": 4.0}']
  assert moved[2] == '{"step": 5, "lo'

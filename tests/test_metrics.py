"""Metric writer (JSON lines + real TensorBoard event files), progress, matmul peak."""
import glob
import io
import math
import struct

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

"""Measurement libraries behind the benchmarks in experiments/ and the notebooks."""
import sys
import time


def log(msg: str) -> None:
  """A benchmark's progress line on stderr, timestamped (stdout keeps its tables)."""
  print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

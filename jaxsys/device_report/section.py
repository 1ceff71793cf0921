"""One part's results: a table of rows, notes, and whether it passed, failed or was skipped."""
from __future__ import annotations

import dataclasses
from typing import Any

from jaxsys.device_report.datasheet import Datasheet
from jaxsys.device_report.sizes import Sizes

STATUSES = ("ok", "failed", "skipped", "incomplete")


@dataclasses.dataclass
class Section:
  key: str
  title: str
  columns: tuple[str, ...] = ()  # the row keys the markdown table shows, in order
  rows: list[dict[str, Any]] = dataclasses.field(default_factory=list)
  notes: list[str] = dataclasses.field(default_factory=list)
  status: str = "ok"
  error: str = ""
  seconds: float = 0.0

  def add(self, **row) -> dict[str, Any]:
    self.rows.append(row)
    return row

  def note(self, text: str) -> None:
    self.notes.append(text)

  def fail(self, why: str) -> None:
    self.status = "failed"
    self.note(why)

  def stop_early(self, why: str) -> None:
    """The budget ran out before every case: the rows so far stand."""
    if self.status == "ok":
      self.status = "incomplete"
    self.note(why)


@dataclasses.dataclass
class Context:
  """What the parts share: sizes, the chip's datasheet, and what earlier parts measured."""
  sizes: Sizes
  backend: str
  device_kind: str
  sheet: Datasheet | None
  matmul_flops: float | None = None  # measured bf16 matmul FLOP/s (the `matmul` part)


def error_line(e: BaseException) -> str:
  return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"

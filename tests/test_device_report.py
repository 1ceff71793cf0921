"""The device report's pieces on CPU: its budget, its correctness checks (which must catch a
wrong kernel), a part that raises, the targets read back from rows, and the scripts that
prepare a GPU machine without a registry."""
import dataclasses
import json
import os
import pathlib
import shutil
import subprocess

import jax.numpy as jnp
import pytest

from jaxsys.device_report import budget, checks, preflight, report, sizes
from jaxsys.device_report.section import Context, Section

ROOT = pathlib.Path(__file__).resolve().parents[1]
CASE = sizes.AttentionCase(1, 64, 4, 2, 32, docs=2)


def _ctx(s=sizes.SMOKE):
  return Context(s, "cpu", "cpu", None)


class _Clock:
  def __init__(self):
    self.now = 0.0

  def __call__(self):
    return self.now


def test_budget_shares_end_no_later_than_the_whole():
  clock = _Clock()
  whole = budget.Budget(100, clock)
  part = whole.share(30)
  clock.now = 20
  assert (whole.left(), part.left()) == (80, 10)
  assert part.allows(10) and not part.allows(11)
  clock.now = 95
  assert whole.share(30).left() == 5  # a share never outlasts the whole
  clock.now = 101
  assert whole.expired() and whole.left() == 0


def test_attention_check_passes_the_kernels_and_catches_a_wrong_one(monkeypatch):
  for impl in checks.ATTENTION_IMPLS:
    errors = checks.attention_errors(impl, CASE)
    assert all(errors[n] <= checks.ATTENTION_TOL[n] for n in errors), (impl, errors)
  real = checks.attention_lib.attention

  def off_by_3_percent(q, k, v, **kw):  # a kernel whose output scale is slightly wrong
    out = real(q, k, v, **kw)
    return out * 1.03 if kw["impl"] == "pallas" else out

  monkeypatch.setattr(checks.attention_lib, "attention", off_by_3_percent)
  section = Section("checks", "checks")
  checks.run(_ctx(dataclasses.replace(sizes.SMOKE, check_attention=(CASE,),
                                      check_qmatmul_ms=(1,))), section, budget.Budget(600))
  failed = [r for r in section.rows if not r["passed"]]
  assert section.status == "failed"
  assert [r["kernel"] for r in failed] == ["attention impl=pallas"], section.rows
  assert 0.025 < failed[0]["error"] < 0.035 and failed[0]["worst"] == "out"
  assert any("attention impl=pallas" in n and "above the tolerance" in n for n in section.notes)


def test_qmatmul_check_catches_a_wrong_kernel(monkeypatch):
  assert checks.qmatmul_error("w4a16", 4, 256) <= checks.QMATMUL_TOL["w4a16"]
  real = checks.qm.qmatmul
  monkeypatch.setattr(checks.qm, "qmatmul", lambda x, qw, impl: real(x, qw, impl=impl)[..., ::-1])
  assert checks.qmatmul_error("w4a16", 4, 256) > 0.5  # columns in the wrong order


def _part(key, fn):
  return report.Part(key, key.title(), fn)


def test_a_part_that_raises_fails_the_report_and_the_rest_still_run():
  ran = []

  def boom(ctx, section, b):
    raise RuntimeError("Triton compilation failed\nsecond line")

  def fine(ctx, section, b):
    ran.append(section.key)
    section.columns = ("x",)
    section.add(x=1.5)

  out = report.run_report(sizes.SMOKE, (_part("matmul", boom), _part("attention", fine)),
                          log=lambda line: None)
  matmul, attention = out["sections"]
  assert matmul["status"] == "failed"
  assert matmul["error"] == "RuntimeError: Triton compilation failed"
  assert attention["status"] == "ok" and ran == ["attention"]
  assert out["ok"] is False
  text = report.markdown(out)
  assert "Status: **failed** (RuntimeError: Triton compilation failed)" in text
  json.dumps(out)


def test_a_part_the_budget_left_cannot_start_is_skipped_with_a_note():
  s = dataclasses.replace(sizes.SMOKE, min_s={"attention": 50})
  out = report.run_report(s, (_part("matmul", lambda *a: None),
                              _part("attention", lambda *a: pytest.fail("ran"))),
                          budget_s=20, log=lambda line: None)
  assert [x["status"] for x in out["sections"]] == ["ok", "skipped"]
  assert "the part needs at least 50 s" in out["sections"][1]["notes"][0]
  assert out["ok"] is True


def _section(key, rows):
  return Section(key, key, rows=rows)


def test_targets_read_the_rows():
  sections = [
      _section("attention", [
          {"T": 2048, "impl": "jaxsys pallas", "TFLOP/s": 100.0},  # below 4k: not counted
          {"T": 2048, "impl": "cudnn", "TFLOP/s": 400.0},
          {"T": 4096, "impl": "jaxsys pallas", "TFLOP/s": 360.0},
          {"T": 4096, "impl": "cudnn", "TFLOP/s": 400.0},
          {"T": 8192, "impl": "jaxsys pallas", "TFLOP/s": 300.0},
          {"T": 8192, "impl": "cudnn", "TFLOP/s": 400.0}]),
      _section("train", [{"preset": "gpt2", "MFU %": 55.0}, {"preset": "1b", "MFU %": 38.0},
                         {"preset": "1b", "MFU %": 41.0}]),
      _section("qmatmul", [{"M": 1, "matmul": "w4a16", "x bf16 dot": 2.4},
                           {"M": 16, "matmul": "w4a16", "x bf16 dot": 3.0}])]
  got = {t["part"]: (t["measured"], t["met"]) for t in report.targets(sections)}
  assert got == {"attention": (0.75, False), "train": (41.0, True), "qmatmul": (2.4, False)}
  assert all(t["met"] is None for t in report.targets([]))


def test_preflight_names_the_missing_distribution():
  assert preflight.missing({"json": "stdlib", "no_such_module_xyz.sub": "no-such-dist"}) == [
      "no-such-dist"]
  assert preflight.missing() == []  # this machine has every dependency


def _device_run(tmp_path, packages: str | None, wheels=()):
  """tools/device_run.sh in a copy of the tools with a .device_wheels of its own."""
  shutil.copytree(ROOT / "tools", tmp_path / "tools")
  folder = tmp_path / ".device_wheels"
  folder.mkdir()
  if packages is not None:
    (folder / "packages.txt").write_text(packages)
  for name in wheels:
    (folder / name).write_text("")
  return subprocess.run(["bash", str(tmp_path / "tools" / "device_run.sh"), str(tmp_path / "out")],
                        capture_output=True, text=True, timeout=60, check=False)


def test_device_run_names_a_missing_wheel_in_one_line(tmp_path):
  r = _device_run(tmp_path, "ml-collections==1.1.0\ngrain==0.2.18\n",
                  ["ml_collections-1.1.0-py3-none-any.whl"])
  assert r.returncode == 1
  assert r.stderr.strip().splitlines() == [
      "error: no wheel for grain==0.2.18 in .device_wheels: run tools/device_prepare.sh again "
      "and carry .device_wheels"]


def test_device_run_without_prepared_wheels_is_one_line(tmp_path):
  r = _device_run(tmp_path, None)
  assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1
  assert "packages.txt is missing: run tools/device_prepare.sh" in r.stderr

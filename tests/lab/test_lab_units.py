"""The lab's pieces that need no namespace: rates, input checks, step windows, the model."""
import numpy as np
import pytest

from jaxsys.lab import link, physics, run, wire


@pytest.mark.parametrize("text,bps", [("100mbit", 1e8), ("1gbit", 1e9), ("2.5Mbit", 2.5e6),
                                      ("64kbit", 64e3), ("none", None), (" NONE ", None)])
def test_rates(text, bps):
  assert link.parse_rate(text) == bps


@pytest.mark.parametrize("text", ["100mbps", "100", "fast", "-5mbit", "0mbit", ""])
def test_bad_rates_name_the_flag_and_the_units(text):
  with pytest.raises(link.LabError, match=r"--bandwidth=.*kbit, mbit, gbit.*'none'"):
    link.parse_rate(text)


def _cfg(**kw):
  kw.setdefault("processes", 2)
  kw.setdefault("bandwidth", "none")
  kw.setdefault("runner_args", ("--config=tiny_lm:size=test", "--workdir=/tmp/x"))
  return run.LabConfig(**kw)


@pytest.mark.parametrize("kw,message", [
    (dict(processes=1), r"--processes=1: .*at least 2"),
    (dict(bandwidth="10mbs"), r"--bandwidth='10mbs' is not a rate"),
    (dict(runner_args=("--config=tiny_lm",)), r"no --workdir"),
    (dict(topology="ring"), r"--topology='ring': use one of shared, switched"),
    (dict(runner_args=("--config.mesh=data=3", "--workdir=/tmp/x")),
     r"--config.mesh=data=3 needs 3 devices, but --processes=2 x --devices_per_process=1 give 2"),
    (dict(processes=3, runner_args=("--config.mesh=data=-1,tensor=2", "--workdir=/tmp/x")),
     r"needs 2 devices or a multiple, but --processes=3"),
])
def test_bad_input_is_one_line_naming_it(kw, message):
  with pytest.raises(link.LabError, match=message) as e:
    run.check(_cfg(**kw))
  assert "\n" not in str(e.value)


def test_meshes_over_the_processes_devices_pass():
  for mesh, p, d in [("data=2", 2, 1), ("replica=2,data=2", 2, 2), ("data=-1", 3, 1)]:
    run.check(_cfg(processes=p, devices_per_process=d,
                   runner_args=(f"--config.mesh={mesh}", "--workdir=/tmp/x")))


def test_without_root_a_shaped_link_is_refused_and_unshaped_is_offered(monkeypatch):
  monkeypatch.setattr(link, "missing_privileges", lambda: ["root (this process runs as uid 7)"])
  with pytest.raises(link.LabError, match=r"needs root .*; --bandwidth=none runs unshaped"):
    run.check(_cfg(bandwidth="20mbit"))
  run.check(_cfg(bandwidth="none"))  # unshaped needs no privileges
  with pytest.raises(link.LabError, match=r"--topology=switched .* needs root"):
    run.check(_cfg(topology="switched"))


def test_a_window_interpolates_bytes_and_counts_busy_time():
  # 10 ms samples: idle, then 1 Mbit/s for 100 ms (1250 bytes a sample), then idle.
  t = np.arange(0, 0.301, 0.01)
  sent = np.cumsum(np.where((t > 0.1) & (t <= 0.2), 1250.0, 0.0))
  samples = np.stack([t, sent, sent / 1250], axis=1)
  w = wire.window(samples, 0.05, 0.25, rate_bps=1e6)
  np.testing.assert_allclose(w["bytes"], 12500, rtol=1e-6)
  np.testing.assert_allclose(w["busy_s"], 0.1, atol=1e-6)
  half = wire.window(samples, 0.15, 0.25, rate_bps=1e6)  # half the burst
  np.testing.assert_allclose(half["bytes"], 6250, atol=1)
  np.testing.assert_allclose(half["busy_s"], 0.05, atol=1e-6)
  # A trickle under a tenth of the rate is not the link being busy.
  assert wire.window(samples, 0.05, 0.25, rate_bps=1e8)["busy_s"] == 0


def test_utilisation_bins():
  t = np.arange(0, 1.0001, 0.005)
  sent = 1e6 / 8 * t  # exactly 1 Mbit/s
  util = wire.utilisation(np.stack([t, sent, sent], axis=1), 2e6, bin_s=0.1)
  assert len(util) == 10
  np.testing.assert_allclose([u["bps"] for u in util], 1e6, rtol=1e-6)
  np.testing.assert_allclose([u["share"] for u in util], 0.5, rtol=1e-6)


def test_the_shared_link_model():
  # 1 MB of payload in full segments: 1e6 / 1448 packets of 66 header bytes more.
  assert physics.wire_bytes(1e6) == pytest.approx(1e6 * 1514 / 1448)
  # At 8 Mbit/s that is ~1.046 s beyond the compute; a slower unshaped loopback wins.
  assert physics.step_time(0.5, 1e6, 8e6) == pytest.approx(0.5 + 1514 / 1448)
  assert physics.step_time(0.5, 1e6, 8e6, capacity_bps=4e6) == pytest.approx(
      0.5 + 2 * 1514 / 1448)
  assert physics.step_time(0.5, 1e6, None, capacity_bps=8e6) == pytest.approx(
      0.5 + 1514 / 1448)
  assert physics.capacity(1e6, 1.5, 0.5) == pytest.approx(8e6)
  # A link a process: the busiest uplink carries one process's share.
  assert physics.link_payload(1e6, 4, "switched") == 2.5e5
  assert physics.link_payload(1e6, 4, "shared") == 1e6

"""hdp_layout.pack_step: every token once, in its cell, with its position and segment."""
import numpy as np
import pytest

from jaxsys.parallel import hdp, hdp_layout


def _docs(lengths, seed=0):
  rng = np.random.default_rng(seed)
  return [rng.integers(1, 256, size=n + 1).astype(np.int32) for n in lengths]


@pytest.mark.parametrize("lengths", [[100, 61, 40, 17, 30, 9, 5, 15, 12, 3, 8, 16, 2],
                                     [128, 20, 20, 3], [16] * 9])
def test_every_pair_once_with_its_position(lengths):
  n, tpd = 8, 16
  docs = _docs(lengths)
  seen = {i: [] for i in range(len(lengths))}
  for step in hdp.plan(lengths, num_devices=n, tokens_per_device=tpd):
    c, f = hdp_layout.pack_step(step, docs, num_devices=n, tokens_per_device=tpd)
    assert c == hdp_layout.view_size(step) and f["inputs"].shape == (n // c, c * tpd)
    cells = {k: v.reshape(n, tpd) for k, v in f.items()}
    real = cells["loss_mask"] > 0
    # Padding has segments of its own (never shared) and no loss.
    pad_seg = cells["segment_ids"][~real]
    assert (pad_seg >= hdp_layout.PAD_SEGMENT).all() and len(set(pad_seg)) == pad_seg.size
    # Collect (sequence, position) pairs through the segment -> sequence map of this step.
    ordered = sorted(step, key=lambda e: (len(e[1]) == 1, e[1][0], e[0]))
    for seg, (i, devs) in enumerate(ordered, start=1):
      for d in devs:
        sel = cells["segment_ids"][d] == seg
        pos = cells["positions"][d][sel]
        assert (np.diff(pos) > 0).all()  # zigzag chunks i, 2r-1-i: increasing keys
        np.testing.assert_array_equal(cells["inputs"][d][sel], docs[i][pos])
        np.testing.assert_array_equal(cells["targets"][d][sel], docs[i][pos + 1])
        seen[i] += pos.tolist()
  for i, n_pairs in enumerate(lengths):
    assert sorted(seen[i]) == list(range(n_pairs)), f"sequence {i}"


def test_zigzag_shares_are_even():
  shares = hdp_layout.ring_shares(103, 4)
  assert sorted(np.concatenate(shares).tolist()) == list(range(103))
  assert max(map(len, shares)) - min(map(len, shares)) <= 1
  assert max(map(len, shares)) <= -(-103 // 4)


def test_overfull_cell_refused():
  with pytest.raises(ValueError, match="more than tokens_per_device=4"):
    hdp_layout.pack_step([(0, (0,)), (1, (0,))], _docs([3, 3]), num_devices=2,
                         tokens_per_device=4)


def test_view_must_hold_each_ring_in_one_row():
  docs = _docs([10])
  with pytest.raises(ValueError, match=r"view=2 splits the ring on devices \(1, 2, 3\)"
                                       r".*at least 4"):
    hdp_layout.pack_step([(0, (1, 2, 3))], docs, num_devices=4, tokens_per_device=4, view=2)
  with pytest.raises(ValueError, match="view=3 does not divide num_devices=4"):
    hdp_layout.pack_step([(0, (0, 1, 2))], docs, num_devices=4, tokens_per_device=4, view=3)
  # A run of 3 devices is one row of a 3-device view: the per-rank executor's ring.
  c, fields = hdp_layout.pack_step([(0, (0, 1, 2))], docs, num_devices=3, tokens_per_device=4,
                                   view=3)
  assert c == 3 and fields["inputs"].shape == (1, 12)

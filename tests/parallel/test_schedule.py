"""Pipeline schedule tables (pure Python): hand-written expected tables, bubble = formula,
dependencies respected, stash bounds, and the one-line errors."""

import pytest

from jaxtrain.parallel import schedule as S


def rows(table):
  return [row.split()[2:] for row in table.timeline().splitlines()]


def test_gpipe_p2_m3_matches_hand_written_table():
  assert rows(S.build("gpipe", 2, 3)) == [
      "F0 F1 F2 .  .  B0 B1 B2".split(),
      ".  F0 F1 F2 B0 B1 B2 .".split(),
  ]


def test_1f1b_p3_m4_matches_hand_written_table():
  # Device s: p-1-s warm-up forwards, then F/B alternately, then the remaining backwards;
  # the last stage starts a microbatch's backward right after its forward (loss known).
  assert rows(S.build("1f1b", 3, 4)) == [
      "F0 F1 F2 .  .  B0 F3 B1 .  B2 .  B3".split(),
      ".  F0 F1 .  B0 F2 B1 F3 B2 .  B3 .".split(),
      ".  .  F0 B0 F1 B1 F2 B2 F3 B3 .  .".split(),
  ]


def test_interleaved_p2_m2_v2_matches_hand_written_table():
  # Chunks a/b: device 0 holds global chunks 0 and 2, device 1 chunks 1 and 3.
  assert rows(S.build("interleaved", 2, 2, 2)) == [
      "F0a F1a F0b F1b .   B0b .   B1b B0a B1a".split(),
      ".   F0a F1a F0b B0b F1b B1b B0a B1a .".split(),
  ]


def test_looped_bfs_p2_m2_v2_matches_hand_written_table():
  # Breadth-first: every microbatch through chunk a, then through chunk b.
  assert rows(S.build("looped-bfs", 2, 2, 2)) == [
      "F0a F1a F0b F1b .   .   B0b B1b B0a B1a".split(),
      ".   F0a F1a F0b F1b B0b B1b B0a B1a .".split(),
  ]


CASES = [(name, p, m, v) for p in (2, 3, 4) for m in (p, 2 * p, 4 * p)
         for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3), ("looped-bfs", 2))]


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_table_is_valid_and_its_bubble_is_the_formula(name, p, m, v):
  t = S.build(name, p, m, v)
  done = {}
  for tick, row in enumerate(t.grid):
    for s, op in enumerate(row):
      if op is not None:
        key = (op.kind, op.mb, op.chunk * p + s)
        assert key not in done, f"{key} runs twice"
        done[key] = tick
  chunks = p * v
  assert set(done) == {(k, i, c) for k in (S.F, S.B) for i in range(m) for c in range(chunks)}
  for (kind, i, c), tick in done.items():  # inputs were sent at the end of an earlier tick
    if kind == S.F and c > 0:
      assert done[(S.F, i, c - 1)] < tick
    if kind == S.B:
      assert done[(S.F, i, c)] < tick
      assert c == chunks - 1 or done[(S.B, i, c + 1)] < tick
  assert t.ticks == 2 * (v * m + p - 1)
  assert t.bubble() == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)
  assert t.bubble() == pytest.approx(t.bubble_formula(), abs=1e-12)


@pytest.mark.parametrize("p,m", [(2, 8), (4, 8), (4, 16)])
def test_1f1b_stashes_at_most_p_inputs_gpipe_all_m(p, m):
  assert max(S.build("1f1b", p, m).in_flight()) == p
  assert max(S.build("gpipe", p, m).in_flight()) == m
  # Interleaving divides the bubble by ~v for ~v x the (1/v-sized) chunk inputs in flight.
  inter = S.build("interleaved", p, m, 2)
  assert inter.bubble() < S.build("1f1b", p, m).bubble()
  assert max(inter.in_flight()) < 2 * m


def test_slots_never_overlap():
  t = S.build("interleaved", 4, 8, 2)
  for intervals in t.stash_intervals() + t.grad_intervals():
    slot_of, n = S.assign_slots(intervals)
    assert n == S._max_overlap(intervals)
    for a in intervals:
      for b in intervals:
        if a != b and slot_of[a[2:]] == slot_of[b[2:]]:
          assert a[1] < b[0] or b[1] < a[0]


@pytest.mark.parametrize("name,p,m,v,msg", [
    ("1f1b", 4, 2, 1, "train.microbatches=2 must be >= the pipeline stages (4)"),
    ("gpipe", 2, 4, 2, "pipeline.virtual_stages=2 needs pipeline.schedule=interleaved"),
    ("interleaved", 2, 4, 1, "needs pipeline.virtual_stages >= 2"),
    ("interleaved", 4, 6, 2, "train.microbatches=6 must be a multiple of 4"),
])
def test_bad_combinations_are_named(name, p, m, v, msg):
  assert msg in S.check(name, p, m, v)
  with pytest.raises(ValueError, match="pipeline|microbatches"):
    S.build(name, p, m, v)

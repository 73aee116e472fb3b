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


def test_zb_h1_p3_m4_matches_hand_written_table():
  # 1F1B's order of F and B; device s runs the W of microbatch i after the B of i + s, the last s Ws at
  # the end, where 1F1B's cool-down bubbles were.
  assert rows(S.build("zb-h1", 3, 4)) == [
      "F0 F1 F2 .  .  B0 W0 F3 B1 W1 B2 W2 B3 W3".split(),
      ".  F0 F1 .  B0 F2 B1 W0 F3 B2 W1 B3 W2 W3".split(),
      ".  .  F0 B0 F1 B1 F2 B2 W0 F3 B3 W1 W2 W3".split(),
  ]


def test_zbv_p2_m2_matches_hand_written_table():
  # The V: device 0 holds chunks 0 (a) and 3 (b), device 1 chunks 1 (a) and 2 (b); 1 -> 2 stays on device 1.
  assert rows(S.build("zbv", 2, 2, 2)) == [
      "F0a F1a .   F0b B0b F1b B1b B0a W0b B1a W1b W0a W1a".split(),
      ".   F0a F0b F1a F1b B0b B0a B1b B1a W0b W0a W1b W1a".split(),
  ]


def test_dualpipev_p2_m4_matches_hand_written_table():
  # The V as zbv's; X = a whole backward (B and W at once), F+X: one microbatch's forward paired in one tick with
  # another's backward. Device 0: 2 forwards of a; F a, F b; B b, W b, F b (split); the steady pairs F a + X b,
  # F b + X a; X b, F b + X a; X b, B a; W a, B a; W a. Device 1 (the turn) runs its first steady step unpaired.
  assert rows(S.build("dualpipev", 2, 4, 2)) == [
      "F0a F1a F2a F0b B0b W0b F1b F3a+X1b F2b+X0a X2b     F3b+X1a X3b B2a W2a B3a W3a".split(),
      ".   F0a F0b F1a F1b F2a X0b F2b+X0a F3a+X1b F3b+X1a X2b     X2a B3b B3a W3b W3a".split(),
  ]


CASES = [(name, p, m, v) for p in (2, 3, 4) for m in (p, 2 * p, 4 * p)
         for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3), ("looped-bfs", 2),
                         ("zb-h1", 1), ("zbv", 2))]


def assert_valid(t):
  """Every F, B (and W) of every microbatch and chunk once (a BW is a B and a W), each after its inputs arrived; a
  device-tick holds one op, or a pair of a forward and another microbatch's backward op."""
  done = {}
  for tick, row in enumerate(t.grid):
    for s, cell in enumerate(row):
      ops = S.ops_of(cell)
      if len(ops) == 2:
        assert ops[0].kind == S.F and ops[1].kind != S.F and ops[0].mb != ops[1].mb, (tick, s, cell)
      for op in ops:
        for kind in op.kinds():
          key = (kind, op.mb, t.chunk_of(s, op.chunk))  # a V, else op.chunk * p + s
          assert key not in done, f"{key} runs twice"
          done[key] = tick
  chunks, kinds = t.chunks, (S.F, S.B, S.W) if t.name in S.SPLIT else (S.F, S.B)
  assert set(done) == {(k, i, c) for k in kinds for i in range(t.m) for c in range(chunks)}
  for (kind, i, c), tick in done.items():  # inputs were sent at the end of an earlier tick
    if kind == S.F and c > 0:
      assert done[(S.F, i, c - 1)] < tick
    if kind == S.B:
      assert done[(S.F, i, c)] < tick
      assert c == chunks - 1 or done[(S.B, i, c + 1)] < tick
    if kind == S.W:
      assert done[(S.B, i, c)] <= tick  # the same tick: a whole backward
  return kinds


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_table_is_valid_and_its_bubble_is_the_formula(name, p, m, v):
  t = S.build(name, p, m, v)
  kinds = assert_valid(t)
  # one op per device-tick; (p-1) idle ticks per device: 2 (F, B) or 3 (F, B, W) ops per microbatch-chunk
  assert t.ticks == len(kinds) * v * m + (p - 1) * (1 if name in S.SPLIT else 2)
  per_tick = 3 if name in S.SPLIT else 1  # microbatch-chunk work per device-tick of idle: F+B+W, or F (B alike)
  assert t.bubble() == pytest.approx((p - 1) / (per_tick * v * m + p - 1), abs=1e-12)
  assert t.bubble() == pytest.approx(t.bubble_formula(), abs=1e-12)


@pytest.mark.parametrize("p,m", [(p, m) for p in (2, 3, 4, 5, 8) for m in (2 * p, 3 * p + 1, 4 * p)])
def test_dualpipev_is_valid_and_its_bubble_is_the_formula(p, m):
  """DualPipeV: with unit F, B, W (X = 2, a pair F + X = 3) a device idles 5p-8 units of its 6m in lock-step ticks;
  the steady state is pairs only; peak memory p + 1/2 stages of passes (2p+1 half-stage chunks), as DeepSeek's
  DualPipeV, and p W slots."""
  t = S.build("dualpipev", p, m, 2)
  assert_valid(t)
  assert t.span() == 6 * m + 5 * p - 8 and t.ticks == 2 * m + 5 * p - 2
  assert t.bubble() == pytest.approx((5 * p - 8) / (6 * m + 5 * p - 8), abs=1e-12)
  assert t.bubble() == pytest.approx(t.bubble_formula(), abs=1e-12)
  pairs = sum(isinstance(cell, S.Pair) for row in t.grid for cell in row)
  # device r pairs 2(m-2p+r+1) (one fewer on the turn device r = p-1) + (p-1-r) steady-state ticks
  assert pairs == sum(2 * (m - 2 * p + r + 1) - (r == p - 1) + (p - 1 - r) for r in range(p))
  assert max(t.passes_in_flight()) == p + 0.5
  assert max(t.in_flight()) == 2 * p + 2  # chunk inputs: device 0's chunk a reads the tokens
  assert max(S._max_overlap(iv) for iv in t.w_intervals()) == p


@pytest.mark.parametrize("p,m", [(2, 8), (4, 8), (4, 16)])
def test_1f1b_stashes_at_most_p_inputs_gpipe_all_m(p, m):
  assert max(S.build("1f1b", p, m).in_flight()) == p
  assert max(S.build("gpipe", p, m).in_flight()) == m
  # Interleaving divides the bubble by ~v for ~v x the (1/v-sized) chunk inputs in flight.
  inter = S.build("interleaved", p, m, 2)
  assert inter.bubble() < S.build("1f1b", p, m).bubble()
  assert max(inter.in_flight()) < 2 * m


@pytest.mark.parametrize("p,m", [(2, 4), (3, 6), (4, 8), (4, 16), (8, 16)])
def test_zero_bubble_keeps_1f1bs_peak_and_cuts_its_bubble(p, m):
  one, h1, v = S.build("1f1b", p, m), S.build("zb-h1", p, m), S.build("zbv", p, m, 2)
  # ZB-H1 stashes as many chunk inputs at its peak as 1F1B; the passes waiting for their backward
  # (their activations, for a backward that keeps them) peak at 1F1B's p stages on both schedules.
  assert max(h1.in_flight()) == max(one.in_flight()) == p
  assert max(h1.passes_in_flight()) == max(one.passes_in_flight()) == p
  assert max(v.passes_in_flight()) <= p
  # Idle time per device for the same work, F = B = W = 1 unit per stage and microbatch (3m units; 1F1B's
  # backward is B + W; zbv's ops are on half stages): ZB-H1's is a third of 1F1B's, ZBV's half of ZB-H1's.
  idle = lambda t: t.bubble() / (1 - t.bubble()) * 3 * m  # noqa: E731
  assert (idle(one), idle(h1), idle(v)) == pytest.approx((3 * (p - 1), p - 1, (p - 1) / 2))
  assert h1.bubble() == pytest.approx((p - 1) / (3 * m + p - 1))
  assert v.bubble() == pytest.approx((p - 1) / (6 * m + p - 1))


def test_lock_step_bubble_with_measured_costs():
  # A tick lasts as long as its slowest op: with W twice F, a zb-h1 tick holding a W costs 2.
  t = S.build("zb-h1", 2, 2)
  assert rows(t) == ["F0 F1 .  B0 W0 B1 W1".split(), ".  F0 B0 F1 B1 W0 W1".split()]
  span = [1, 1, 1, 1, 2, 2, 2]  # F0; F1/F0; B0; B0/F1; W0/B1; B1/W0; W1/W1
  busy = 2 * (2 * 1 + 2 * 1 + 2 * 2)  # per device 2 F, 2 B, 2 W
  assert t.bubble({S.F: 1, S.B: 1, S.W: 2}) == pytest.approx(1 - busy / (2 * sum(span)))


def test_slots_never_overlap():
  t = S.build("interleaved", 4, 8, 2)
  for intervals in t.stash_intervals() + t.grad_intervals():
    slot_of, n = S.assign_slots(intervals)
    assert n == S._max_overlap(intervals)
    for a in intervals:
      for b in intervals:
        if a != b and slot_of[a[2:]] == slot_of[b[2:]]:
          assert a[1] < b[0] or b[1] < a[0]


@pytest.mark.parametrize("name,p,m,v", [("zb-h1", 4, 8, 1), ("zb-h1", 3, 7, 1), ("zbv", 4, 8, 2), ("zbv", 2, 5, 2),
                                        ("dualpipev", 4, 8, 2), ("dualpipev", 3, 7, 2)])
def test_w_slots_hold_each_pass_from_its_b_to_its_w(name, p, m, v):
  """Replays the program's table: every B of a chunk past the first leaves its projections' inputs and output
  gradients in a free W slot of its device, and that chunk's W reads them there; nothing else takes the slot between."""
  from jaxtrain.parallel import program
  t = S.build(name, p, m, v)
  prog, _, _, n = program.program_table(t)
  held = [dict() for _ in range(p)]  # device -> {slot: (mb, global chunk)}
  passes = 0
  for tick, s, op in t.ops():  # (a pair's backward op is the one with a W slot)
    if t.chunk_of(s, op.chunk) == 0:
      continue
    key, slot = (op.mb, t.chunk_of(s, op.chunk)), int(prog[tick, s, program.WSLOT])
    if op.kind == S.B:
      assert slot < n and slot not in held[s], (tick, s, op)
      held[s][slot] = key
    elif op.kind == S.W:
      assert held[s].pop(slot) == key, (tick, s, op)
      passes += 1
  assert not any(held)
  done = t.done()  # dualpipev's whole backwards (B and W at one tick) keep nothing; every other pass is split
  assert passes == sum(k == S.B and c > 0 and done[(S.W, i, c)] > tick for (k, i, c), tick in done.items())
  # dualpipev: device r splits 2(p-1-r) + (r+1) passes (its warm-up's and cool-down's), device 0's p of chunk 0
  # whole (its W gives the input gradient): 3p(p-1)/2 in all
  assert passes == (m * (p * v - 1) if name != "dualpipev" else 3 * p * (p - 1) // 2)
  # the stash no longer waits for W: each chunk input is freed at its B, so zb-h1 stashes no more than 1F1B
  if name == "zb-h1":
    assert max(t.in_flight()) <= max(S.build("1f1b", p, m).in_flight())


@pytest.mark.parametrize("name,p,m,v,msg", [
    ("1f1b", 4, 2, 1, "train.microbatches=2 must be >= the pipeline stages (4)"),
    ("gpipe", 2, 4, 2, "pipeline.virtual_stages=2 needs pipeline.schedule=interleaved"),
    ("interleaved", 2, 4, 1, "needs pipeline.virtual_stages >= 2"),
    ("interleaved", 4, 6, 2, "train.microbatches=6 must be a multiple of 4"),
    ("zbv", 2, 4, 1, "pipeline.virtual_stages must be 2 (got 1)"),
    ("zb-h1", 2, 4, 2, "pipeline.virtual_stages=2 needs pipeline.schedule=interleaved"),
    ("dualpipev", 4, 6, 2, "train.microbatches=6 must be >= 8"),
    ("dualpipev", 2, 4, 3, "pipeline.virtual_stages must be 2 (got 3)"),
])
def test_bad_combinations_are_named(name, p, m, v, msg):
  assert msg in S.check(name, p, m, v)
  with pytest.raises(ValueError, match="pipeline|microbatches"):
    S.build(name, p, m, v)

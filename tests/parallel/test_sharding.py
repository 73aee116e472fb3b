"""The divisibility rule shared by the trainer and inspect."""

import pytest

from jaxtrain.core import config
from jaxtrain.parallel import sharding
from jaxtrain.run import step
from jaxtrain.core.errors import UserError
from tests.helpers import mesh_of


def test_kv_heads_fewer_than_tensor_are_replicated_with_a_note():
  setup = step.Setup(config.load("tiny"), mesh_of("tp=8"))  # 4 KV heads, 8 query heads
  wk = setup.state_shardings["params"]["layers"][0]["attn"]["wk"]
  wq = setup.state_shardings["params"]["layers"][0]["attn"]["wq"]
  assert tuple(wk.spec) == (None, None, None) and tuple(wq.spec)[:2] == (None, "tensor")
  assert "layers/0/attn/wk: kv_heads=4 is smaller than tensor=8; replicated over tensor" in setup.notes[0]


@pytest.mark.parametrize("sets, spec, words", [
    ([], "tp=3", ["tensor=3 can neither split nor evenly replicate vocab=512 (embed and 1 more)",
                  "heads=8 (layers/0/attn/wo and 3 more)", "tensor sizes that work for every parameter: 1, 2, 4, 8, 16, 32, 64"]),
    (["model.n_kv_heads=2", "model.n_heads=6"], "tp=4",  # 6 heads: 2 works, 4 neither divides nor is divided
     ["heads=6 (layers/0/attn/wo and 3 more)", "tensor sizes that work for every parameter: 1, 2\n"]),
])
def test_a_dimension_neither_divisible_nor_smaller_is_an_error(sets, spec, words):
  with pytest.raises(UserError) as e:
    step.Setup(config.load("tiny", sets), mesh_of(spec))
  for w in words:
    assert w in str(e.value) + "\n", str(e.value)


def test_the_rule_for_one_dimension():
  mesh = mesh_of("fsdp=2,tp=4")
  notes = []
  assert tuple(sharding.spec_for(("embed", "kv_heads"), (128, 2), mesh, notes)) == ("fsdp", None)
  assert notes and "kv_heads=2 is smaller than tensor=4" in notes[0]
  assert tuple(sharding.spec_for(("embed", "heads"), (128, 8), mesh)) == ("fsdp", "tensor")
  with pytest.raises(UserError, match="embed=3 cannot be split over fsdp=2"):
    sharding.spec_for(("embed",), (3,), mesh)


def test_a_typo_in_a_logical_axis_is_an_error():
  mesh = mesh_of("dp=2")
  with pytest.raises(KeyError, match="'bacth'"):
    sharding.spec_for(("bacth", "length"), (4, 8), mesh)


def test_expert_splits_dense_weights_only_where_it_divides():
  mesh = mesh_of("fsdp=2,ep=4")
  assert tuple(sharding.spec_for(("embed", "mlp"), (96, 8), mesh)) == (("fsdp", "expert"), None)
  # 6 = fsdp 2 x 3 rows: expert=4 cannot split 3, so the weight stays on fsdp alone instead of failing start-up
  assert tuple(sharding.spec_for(("embed", "mlp"), (6, 8), mesh)) == ("fsdp", None)
  with pytest.raises(UserError, match="cannot be split over fsdp=4"):
    sharding.spec_for(("embed",), (6,), mesh_of("fsdp=4"))

"""Chat data (`prepare --chat-field`): token ids and assistant masks equal transformers' apply_chat_template with
return_assistant_tokens_mask for a tokenizer and template built here; the trainer's loss mask follows them."""

import json

import numpy as np
import pytest

from jaxtrain.core import config
from jaxtrain.core.errors import UserError
from jaxtrain.data import __main__ as data_command
from jaxtrain.data import pipeline, shards
from jaxtrain.data.prepare import prepare
from tests.corpora import write_jsonl

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# A small ChatML template (as Qwen's, with a BOS from tokenizer_config.json), with the assistant turn and its end-of-turn token in a generation block.
CHATML = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{ '\\n' }}"
    "{% elif message['role'] in ['system', 'user'] %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% else %}{{ raise_exception('unknown role ' + message['role']) }}"
    "{% endif %}{% endfor %}"
)
CHAT = [
    {"role": "system", "content": "You are a terse helper."},
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "content": "Four."},
    {"role": "user", "content": "And three plus three?"},
    {"role": "assistant", "content": "Six, of course."},
]


@pytest.fixture(scope="module")
def tokdir(tmp_path_factory):
  """A byte-level BPE trained here with ChatML specials; tokenizer.json + tokenizer_config.json (the template)."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  d = tmp_path_factory.mktemp("chat-tok")
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  corpus = [m["content"] for m in CHAT] * 20 + ["system user assistant helper plus what and of course"] * 20
  tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  tok.save(str(d / "tokenizer.json"))
  (d / "tokenizer_config.json").write_text(json.dumps({
      "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
      "chat_template": CHATML}))
  return d


def _stored(directory):
  """Each document's tokens and mask, read straight from the shard files."""
  manifest = json.loads((directory / "manifest.json").read_text())
  out = []
  for shard in manifest["shards"]:
    tokens, mask = (np.load(directory / shard["files"][k]["name"]) for k in ("tokens", "mask"))
    for start, length, _ in np.load(directory / shard["files"]["index"]["name"]):
      out.append((tokens[start:start + length].tolist(), mask[start:start + length].tolist()))
  return manifest, out


def test_multi_turn_ids_and_mask_equal_transformers(tokdir, tmp_path):
  transformers = pytest.importorskip("transformers")
  ref_tok = transformers.PreTrainedTokenizerFast.from_pretrained(str(tokdir))
  src = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}, {"messages": CHAT[:3]}])
  manifest = prepare([src], str(tokdir / "tokenizer.json"), str(tmp_path / "c"), chat_field="messages",
                     progress=False)
  _, stored = _stored(tmp_path / "c")
  assert manifest["kind"] == "chat" and len(stored) == 2
  assert stored[0][0][0] == ref_tok.convert_tokens_to_ids("<|endoftext|>")  # the template's bos_token, as configured
  for chat, (ids, mask) in zip([CHAT, CHAT[:3]], stored):
    ref = ref_tok.apply_chat_template(chat, tokenize=True, return_assistant_tokens_mask=True, return_dict=True)
    assert ids == list(ref["input_ids"])
    assert mask == list(ref["assistant_masks"])
  ids, mask = stored[0]
  im_end = ref_tok.convert_tokens_to_ids("<|im_end|>")
  trained = [i for i, m in zip(ids, mask) if m]
  assert trained.count(im_end) == 2  # both assistant turns, each with its end-of-turn token
  assert ref_tok.decode(trained) == "Four.<|im_end|>Six, of course.<|im_end|>"
  assert manifest["trainable_tokens"] == sum(mask) + sum(stored[1][1])


def test_the_loader_trains_on_assistant_tokens_only(tokdir, tmp_path):
  src = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}])
  prepare([src], str(tokdir / "tokenizer.json"), str(tmp_path / "c"), chat_field="messages", progress=False)
  _, [(ids, mask)] = _stored(tmp_path / "c")
  cfg = config.load("tiny", [f"data.source={tmp_path / 'c'}", f"data.tokenizer={tokdir / 'tokenizer.json'}",
                             f"train.seq_len={len(ids) - 1}", "train.batch_size=1"])
  batch = next(pipeline.batches(cfg))
  assert batch["inputs"][0].tolist() == ids[:-1] and batch["targets"][0].tolist() == ids[1:]
  assert batch["loss_mask"][0].tolist() == mask[1:]  # the loss counts target t exactly where t is assistant
  ts, _ = shards.open_prepared(tmp_path / "c")
  assert ts.mask(0).tolist() == mask


def test_a_record_the_template_cannot_render_is_a_counted_bad_record(tokdir, tmp_path, capsys):
  recs = [{"messages": CHAT}, {"messages": [{"role": "tool", "content": "x"}, *CHAT[1:3]]},
          {"messages": "not a list"}, {"messages": [CHAT[0], CHAT[1]]}]
  src = write_jsonl(tmp_path / "chat.jsonl", recs)
  manifest = prepare([src], str(tokdir / "tokenizer.json"), str(tmp_path / "ok"), chat_field="messages",
                     max_bad_records=3, progress=False)
  assert manifest["documents"] == 1 and manifest["skipped"]["bad_records"] == 3
  first, second, third = manifest["skipped"]["examples"]
  assert first.endswith("chat.jsonl:2: the chat template cannot render it (TemplateError: unknown role tool)")
  assert "chat.jsonl:3: field 'messages' is str, not a list of turns" in second
  assert "chat.jsonl:4:" in third and "no assistant turn" in third
  assert "skipped 3 bad record(s)" in capsys.readouterr().out
  with pytest.raises(UserError, match=r"chat.jsonl:2: .*unknown role tool\) \(more than --max-bad-records=0"):
    prepare([src], str(tokdir / "tokenizer.json"), str(tmp_path / "strict"), chat_field="messages", progress=False)


def _run(argv, capsys):
  with pytest.raises(SystemExit) as e:
    data_command.main(argv)
  err = capsys.readouterr().err.strip()
  return e.value.code, err


def test_chat_field_with_prompt_field_is_a_one_line_user_error(tokdir, tmp_path, capsys):
  src = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}])
  code, err = _run(["prepare", "--input", src, "--tokenizer", str(tokdir / "tokenizer.json"), "--output",
                    str(tmp_path / "o"), "--chat-field", "messages", "--prompt-field", "p", "--completion-field",
                    "c"], capsys)
  assert code == 2 and len(err.splitlines()) == 1 and "--chat-field" in err and "--prompt-field" in err


def test_no_chat_template_names_where_it_looked(tokdir, tmp_path, capsys):
  bare = tmp_path / "bare"
  bare.mkdir()
  (bare / "tokenizer.json").write_bytes((tokdir / "tokenizer.json").read_bytes())
  src = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}])
  code, err = _run(["prepare", "--input", src, "--tokenizer", str(bare / "tokenizer.json"), "--output",
                    str(tmp_path / "o"), "--chat-field", "messages"], capsys)
  assert code == 2 and len(err.splitlines()) == 1
  assert str(bare / "chat_template.jinja") in err and str(bare / "tokenizer_config.json") in err
  assert "--chat-template" in err


def test_a_template_file_beside_or_given_is_used_and_one_without_markers_is_refused(tokdir, tmp_path):
  d = tmp_path / "tok"
  d.mkdir()
  (d / "tokenizer.json").write_bytes((tokdir / "tokenizer.json").read_bytes())
  (d / "chat_template.jinja").write_text(CHATML)
  src = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}])
  m = prepare([src], str(d / "tokenizer.json"), str(tmp_path / "a"), chat_field="messages", progress=False)
  assert m["chat_template"] == str(d / "chat_template.jinja") and m["trainable_tokens"] > 0
  plain = tmp_path / "plain.jinja"
  plain.write_text(CHATML.replace("{% generation %}", "").replace("{% endgeneration %}", ""))
  with pytest.raises(UserError, match=r"plain.jinja lacks \{% generation %\} markers"):
    prepare([src], str(d / "tokenizer.json"), str(tmp_path / "b"), chat_field="messages", chat_template=str(plain),
            progress=False)


def test_an_assistant_turn_that_renders_no_content_is_a_counted_bad_record(tokdir, tmp_path):
  """Inside {% generation %}, an empty content or a misspelt field leaves only the end-of-turn token (and
  whitespace) to train: such a record is bad, named, counted and bounded by --max-bad-records."""
  transformers = pytest.importorskip("transformers")
  ref_tok = transformers.PreTrainedTokenizerFast.from_pretrained(str(tokdir))
  empty = [CHAT[1], {"role": "assistant", "content": ""}]
  blank_later = [*CHAT[1:3], CHAT[3], {"role": "assistant", "content": " \n"}]
  src = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}, {"messages": empty}, {"messages": blank_later}])
  m = prepare([src], str(tokdir / "tokenizer.json"), str(tmp_path / "a"), chat_field="messages", max_bad_records=2,
              progress=False)
  assert m["documents"] == 1 and m["skipped"]["bad_records"] == 2
  first, second = m["skipped"]["examples"]
  assert "chat.jsonl:2: assistant turn 1 renders '<|im_end|>'" in first and "no content" in first
  assert "chat.jsonl:3: assistant turn 2 renders ' \\n<|im_end|>'" in second
  # what transformers would train on for the empty turn: its end-of-turn token alone
  ref = ref_tok.apply_chat_template(empty, tokenize=True, return_assistant_tokens_mask=True, return_dict=True)
  trained = [i for i, k in zip(ref["input_ids"], ref["assistant_masks"]) if k]
  assert ref_tok.convert_ids_to_tokens(trained) == ["<|im_end|>"]
  misspelt = tmp_path / "misspelt.jinja"
  misspelt.write_text(CHATML.replace("message['content'] + '<|im_end|>'", "message.contnet ~ '<|im_end|>'"))
  with pytest.raises(UserError, match=r"chat.jsonl:1: assistant turn 1 renders '<\|im_end\|>'.*more than "
                                      r"--max-bad-records=0"):
    prepare([src], str(tokdir / "tokenizer.json"), str(tmp_path / "b"), chat_field="messages",
            chat_template=str(misspelt), progress=False)

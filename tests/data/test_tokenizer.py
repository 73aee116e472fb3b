"""A tokenizer folder as Hugging Face saves it (`--tokenizer DIR`, `data.tokenizer=DIR`), read as
`transformers.AutoTokenizer.from_pretrained(DIR)` reads it: tokenizer.json, tokenizer_config.json's special tokens
(strings or AddedToken dicts), the chat template. Tokenizers are built and saved here; nothing is downloaded."""

import json

import numpy as np
import pytest

from jaxtrain.core import config
from jaxtrain.core.errors import UserError
from jaxtrain.data import __main__ as data_command
from jaxtrain.data import pipeline, shards, tokenizer as tokenizer_lib
from tests.corpora import write_jsonl

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")
transformers = pytest.importorskip("transformers")

# "<|endoftext|>" and "<s>" are names jaxtrain guesses as EOS and BOS; the folder names others (or none).
SPECIALS = ["<|endoftext|>", "<s>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}{% generation %}"
            "{{ m.content }}<|im_end|>{% endgeneration %}{% else %}{{ m.content }}<|im_end|>{% endif %}\n{% endfor %}")
CHAT = [{"role": "user", "content": "How are you?"}, {"role": "assistant", "content": "Well, thank you."}]


def _bpe():
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(["how are you well thank you user assistant"] * 20, trainers.BpeTrainer(
      vocab_size=320, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  return tok


def _added(content):
  return {"__type": "AddedToken", "content": content, "lstrip": False, "normalized": False, "rstrip": False,
          "single_word": False, "special": True}


@pytest.fixture(scope="module", params=["save_pretrained", "added-token-dicts"])
def folder(request, tmp_path_factory):
  """save_pretrained's own folder (EOS <|im_end|>, no BOS, PAD <|endoftext|>, chat_template.jinja); or one written
  as older transformers did (AddedToken dicts, BOS <|im_start|>, the template inside tokenizer_config.json)."""
  d = tmp_path_factory.mktemp(request.param)
  if request.param == "save_pretrained":
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=_bpe(), eos_token="<|im_end|>",
                                                pad_token="<|endoftext|>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(str(d))
  else:
    _bpe().save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": _added("<|im_end|>"),
        "bos_token": _added("<|im_start|>"), "pad_token": _added("<|endoftext|>"), "chat_template": TEMPLATE}))
  return d


def test_the_folder_and_its_tokenizer_json_read_as_auto_tokenizer(folder):
  ref = transformers.AutoTokenizer.from_pretrained(str(folder))
  for spec in (folder, folder / "tokenizer.json"):
    tok = tokenizer_lib.load(str(spec))
    assert (tok.eos_id, tok.bos_id, tok.pad_id) == (ref.eos_token_id, ref.bos_token_id, ref.pad_token_id), spec
    assert tok.encode_batch(["How are you?"])[0].tolist() == ref.encode("How are you?", add_special_tokens=False)
    assert tokenizer_lib.digest_of(str(spec)) == tok.digest


def _run(argv, capsys):
  try:
    code = data_command.main(argv)
  except SystemExit as e:
    code = e.code
  return code, capsys.readouterr()


def test_prepare_and_train_take_the_folder(folder, tmp_path, capsys):
  """Chat data: the ids and mask of transformers' apply_chat_template with the folder's template; text data:
  framed with the folder's BOS (if any) and EOS; data.tokenizer=DIR opens what --tokenizer DIR prepared."""
  ref = transformers.AutoTokenizer.from_pretrained(str(folder))
  chats = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}])
  code, out = _run(["prepare", "--input", chats, "--tokenizer", str(folder), "--output", str(tmp_path / "c"),
                    "--chat-field", "messages", "--workers", "1", "--no-progress"], capsys)
  assert code == 0, out.err
  manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
  shard = manifest["shards"][0]["files"]
  ids, mask = (np.load(tmp_path / "c" / shard[k]["name"]).tolist() for k in ("tokens", "mask"))
  want = ref.apply_chat_template(CHAT, tokenize=True, return_assistant_tokens_mask=True, return_dict=True)
  assert ids == list(want["input_ids"]) and mask == list(want["assistant_masks"])
  texts = write_jsonl(tmp_path / "t.jsonl", [{"text": "thank you"}])
  code, out = _run(["prepare", "--input", texts, "--tokenizer", str(folder), "--output", str(tmp_path / "t"),
                    "--workers", "1", "--no-progress"], capsys)
  assert code == 0, out.err
  body = ref.encode("thank you", add_special_tokens=False)
  framed = ([] if ref.bos_token_id is None else [ref.bos_token_id]) + body + [ref.eos_token_id]
  ts, _ = shards.open_prepared(tmp_path / "t")
  assert ts.doc(0)[0].tolist() == framed
  cfg = config.load("tiny", [f"data.source={tmp_path / 't'}", f"data.tokenizer={folder}", "train.batch_size=1",
                             f"train.seq_len={len(framed) - 1}"])
  assert next(pipeline.batches(cfg))["inputs"][0].tolist() == framed[:-1]


def test_a_folder_without_a_tokenizer_json_is_one_line(tmp_path, capsys):
  (tmp_path / "slow").mkdir()
  (tmp_path / "slow" / "tokenizer_config.json").write_text("{}")
  src = write_jsonl(tmp_path / "t.jsonl", [{"text": "x"}])
  code, out = _run(["prepare", "--input", src, "--tokenizer", str(tmp_path / "slow"), "--output",
                    str(tmp_path / "o")], capsys)
  assert code == 2 and len(out.err.strip().splitlines()) == 1 and "without a tokenizer.json" in out.err
  with pytest.raises(UserError, match="data.tokenizer=.*slow.* without a tokenizer.json"):
    tokenizer_lib.digest_of(str(tmp_path / "slow"))

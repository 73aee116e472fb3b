"""Chat records ({role, content} turns) rendered with the tokenizer's own chat template exactly as `transformers`
renders it (same sandboxed jinja2 environment, globals and context); the trained tokens are those overlapping the
spans the template marks with {% generation %}...{% endgeneration %}, the rule of `apply_chat_template(...,
return_assistant_tokens_mask=True)`. A template without generation markers is refused (see docs/data.md)."""

from __future__ import annotations

import json
import re
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime
from pathlib import Path

import numpy as np

from jaxtrain.core.errors import UserError
from jaxtrain.data.tokenizer import CONFIG_FILE, json_file

TEMPLATE_FILE = "chat_template.jinja"
GENERATION = re.compile(r"\{\%-?\s*generation\s*-?\%\}")
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # as transformers aliases them


class RenderError(Exception):
  """A record the template cannot render (counted as a bad record)."""


def _from_config(config: Path):
  """tokenizer_config.json's chat_template: a string, or the 'default' of a list of named templates."""
  try:
    value = json.loads(config.read_text(encoding="utf-8-sig")).get("chat_template")
  except (OSError, ValueError, AttributeError) as e:
    raise UserError(f"{config}: not a readable tokenizer_config.json ({e})") from None
  if isinstance(value, list):
    value = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}.get("default")
  return value if isinstance(value, str) else None


def find_template(tokenizer: str, template_file: str | None) -> tuple[str, str]:
  """(template text, where it was found): --chat-template, else in the tokenizer's folder as transformers saves it.
  Read as text: a UTF-8 byte-order mark is no part of the template."""
  if tokenizer == "byte":
    raise UserError("--chat-field needs a tokenizer.json (the byte tokenizer has no chat template nor special tokens)")
  if template_file is not None:
    try:
      text, where = Path(template_file).read_text(encoding="utf-8-sig"), template_file
    except (OSError, UnicodeDecodeError) as e:
      why = getattr(e, "strerror", None) or e
      raise UserError(f"--chat-template {template_file}: cannot be read ({why})") from None
  else:
    d = json_file(tokenizer).parent
    text, where = None, str(d / TEMPLATE_FILE)
    if (d / TEMPLATE_FILE).is_file():
      text = (d / TEMPLATE_FILE).read_text(encoding="utf-8-sig")
    elif (d / CONFIG_FILE).is_file():
      text, where = _from_config(d / CONFIG_FILE), f"{d / CONFIG_FILE} (chat_template)"
    if text is None:
      raise UserError(f"no chat template beside {tokenizer}: looked for {d / TEMPLATE_FILE} and 'chat_template' in "
                      f"{d / CONFIG_FILE}; give one with --chat-template FILE")
  if not GENERATION.search(text):
    raise UserError(f"chat template {where} lacks {{% generation %}} markers, so the assistant tokens to train on are "
                    "unknown; mark each assistant turn (with its end-of-turn token) "
                    "{% generation %}...{% endgeneration %} and pass it with --chat-template FILE")
  return text, where


def context(tok) -> dict[str, str]:
  """The special tokens a template sees: tokenizer_config.json's named ones (as transformers passes them), else
  the BOS and EOS jaxtrain uses."""
  if tok.named is not None:
    return {k: v for k, v in tok.named.items() if v is not None}
  names = {"bos_token": tok.bos_id, "eos_token": tok.eos_id}
  return {k: tok.token(i) for k, i in names.items() if i is not None}


def _compile(template: str):
  """transformers' environment (utils/chat_template_utils.py): sandboxed, trim/lstrip blocks, loopcontrols, the
  generation tag recording character spans, raise_exception, tojson, strftime_now, dict and namespace."""
  import jinja2
  import jinja2.ext
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  class Generation(jinja2.ext.Extension):
    tags = {"generation"}

    def __init__(self, environment):
      super().__init__(environment)
      environment.extend(tracking=ContextVar("jaxtrain_generation", default=None), track=self.track)

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
      return jinja2.nodes.CallBlock(self.call_method("_span"), [], [], body).set_lineno(lineno)

    def _span(self, caller):
      rv = caller()
      if (state := self.environment.tracking.get()) is not None:
        blocks, spans = state
        start = len("".join(blocks))
        spans.append((start, start + len(rv)))
      return rv

    @contextmanager
    def track(self, blocks, spans):
      token = self.environment.tracking.set((blocks, spans))
      try:
        yield
      finally:
        self.environment.tracking.reset(token)

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

  class Namespace(jinja2.utils.Namespace):  # no underscore attributes, as in transformers
    def __init__(*args, **kwargs):
      self, args = args[0], args[1:]
      attrs = dict(*args, **kwargs)
      if any(isinstance(n, str) and n.startswith("_") for n in attrs):
        raise jinja2.exceptions.SecurityError("chat templates cannot store underscore-prefixed attributes")
      jinja2.utils.Namespace.__init__(self, attrs)

  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=[Generation, jinja2.ext.loopcontrols])
  env.filters["tojson"] = tojson
  env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f),
                     dict=dict, namespace=Namespace)
  return env.from_string(template)


def _messages(turns: list) -> list[dict]:
  """transformers' normalization: each turn a dict, None values dropped, reasoning aliased."""
  out = []
  for n, turn in enumerate(turns):
    if not isinstance(turn, dict):
      raise RenderError(f"turn {n} is {type(turn).__name__}, not an object with role and content")
    turn = {k: v for k, v in turn.items() if v is not None}
    reasoning = next((turn[k] for k in REASONING_FIELDS if turn.get(k) is not None), None)
    out.append({"thinking": reasoning, **turn, "reasoning_content": reasoning} if reasoning is not None else turn)
  return out


class Renderer:
  """A compiled template with its context; render(turns) -> (text, generation spans in characters). `specials`: the
  texts of the tokenizer's special tokens, which alone in a span train nothing but an end of turn."""

  def __init__(self, template: str, where: str, ctx: dict[str, str], specials=()):
    try:
      import jinja2
    except ImportError:
      raise UserError("chat templates need the 'jinja2' package: pip install 'jaxtrain[data]'") from None
    try:
      self.template = _compile(template)
    except jinja2.TemplateError as e:
      raise UserError(f"chat template {where} does not compile: {e}") from None
    self.ctx, self.specials = ctx, sorted(specials, key=len, reverse=True)

  def render(self, turns: list) -> tuple[str, list[tuple[int, int]]]:
    messages, blocks, spans = _messages(turns), [], []
    try:
      with self.template.environment.track(blocks, spans):
        for block in self.template.generate(messages=messages, tools=None, documents=None,
                                            add_generation_prompt=False, **self.ctx):
          blocks.append(block)
    except Exception as e:  # noqa: BLE001 (raise_exception, a missing field, a type error inside the template)
      raise RenderError(f"the chat template cannot render it ({type(e).__name__}: {e})") from None
    if not spans:
      raise RenderError("the chat template marks nothing to train on (no assistant turn)")
    text = "".join(blocks)
    for n, (start, end) in enumerate(spans):
      if not self._content(text[start:end]):
        raise RenderError(f"assistant turn {n + 1} renders {text[start:end]!r} inside {{% generation %}}: no content "
                          "to train on but whitespace and special tokens (an empty content, or a field the template "
                          "misspells)")
    return text, spans

  def _content(self, span: str) -> str:
    for special in self.specials:
      span = span.replace(special, "")
    return span.strip()


def assistant_mask(offsets, spans) -> np.ndarray:
  """1 for each token overlapping a span: transformers' single pass over ordered offsets and spans."""
  mask, k = np.zeros(len(offsets), np.uint8), 0
  for i, (start, end) in enumerate(offsets):
    while k < len(spans) and start >= spans[k][1]:
      k += 1
    if k == len(spans):
      break
    if end > spans[k][0]:
      mask[i] = 1
  return mask

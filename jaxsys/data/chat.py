"""Chat templates of Hugging Face tokenizers, rendered as transformers' `apply_chat_template`
renders them (jinja2's sandbox, the same options, globals and variables), without transformers.

The template is the directory's `chat_template.jinja` (newer transformers save it there), else
the `chat_template` of its `tokenizer_config.json`: a string, or a list of
`{"name": ..., "template": ...}` of which "default" is used. The rendered text already holds
the special tokens the template writes (a Llama 3 template writes `bos_token` itself), so it
is encoded without the tokenizer adding its own (`HFTokenizer.encode(text, False)`).

Example::

  template = chat.load_template("/ckpt/Qwen2.5-0.5B-Instruct")
  text = template.render_user("Name a prime.")  # '<|im_start|>system\\n...<|im_start|>assistant\\n'
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os

# transformers' `special_tokens_map`: the named special tokens a template may read.
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                  "mask_token")
TEMPLATE_FILE = "chat_template.jinja"


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
  """A tokenizer's chat template and the special tokens it is rendered with."""
  source: str  # the file it came from, for error lines
  template: str
  special_tokens: dict[str, str]

  def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
    """The conversation as the model reads it; a template error is a ValueError naming the file."""
    import jinja2  # pylint: disable=import-outside-toplevel  # only --chat needs it
    try:
      compiled = _environment().from_string(self.template)
      return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                             **self.special_tokens)
    except jinja2.TemplateError as e:  # raise_exception's message, or a syntax error
      raise ValueError(f"{self.source}: the chat template fails: {e}") from None

  def render_user(self, prompt: str) -> str:
    """One user message with the assistant's generation prompt after it."""
    return self.render([{"role": "user", "content": prompt}])


def _environment():
  """transformers' environment (utils/chat_template_utils.py) less its `{% generation %}`
  tracker, which only marks assistant tokens for training masks."""
  import jinja2  # pylint: disable=import-outside-toplevel
  from jinja2 import ext, sandbox  # pylint: disable=import-outside-toplevel

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja's own tojson escapes HTML characters, which would change the prompt.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)

  env = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                              extensions=[ext.loopcontrols])
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
  return env


def load_template(directory: str) -> ChatTemplate:
  """The chat template of a Hugging Face tokenizer directory; ValueError naming the directory
  when it has none."""
  config_path = os.path.join(directory, "tokenizer_config.json")
  config = {}
  if os.path.isfile(config_path):
    try:
      with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
      raise ValueError(f"{config_path} cannot be read as JSON ({e})") from None
  tokens = {name: _content(config[name]) for name in SPECIAL_TOKENS
            if _content(config.get(name)) is not None}
  file = os.path.join(directory, TEMPLATE_FILE)
  if os.path.isfile(file):  # as transformers: the file wins over the config's entry
    with open(file, encoding="utf-8") as f:
      return ChatTemplate(file, f.read(), tokens)
  template = config.get("chat_template")
  if isinstance(template, list):
    named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
    if "default" not in named:
      raise ValueError(f"{config_path}: chat_template lists templates {sorted(map(str, named))} "
                       "but none named 'default'; --chat uses the default one")
    template = named["default"]
  if not isinstance(template, str) or not template:
    raise ValueError(f"{directory}: the tokenizer has no chat_template (neither "
                     f"{TEMPLATE_FILE} nor a chat_template in tokenizer_config.json); --chat "
                     "needs a chat model's tokenizer")
  return ChatTemplate(config_path, template, tokens)


def _content(token) -> str | None:
  """A special token's text: tokenizer_config writes it as a string or as an AddedToken dict."""
  token = token.get("content") if isinstance(token, dict) else token
  return token if isinstance(token, str) else None

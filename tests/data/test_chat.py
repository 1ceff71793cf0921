"""jaxsys.data.chat: a ChatML (Qwen) and a Llama 3 template render and encode as transformers'
`apply_chat_template` does; the three places a template lives; a tokenizer without one."""
import importlib.util
import json
import pathlib
import shutil

import pytest
import tokenizers

from jaxsys.data import chat
from jaxsys.data import tokenizer as tokenizer_lib

FIXTURE = pathlib.Path(__file__).resolve().parents[1] / "data" / "hf_fixture" / "llama3"
# Qwen2-Instruct's template (ChatML with a default system message).
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
          "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# Meta-Llama-3-8B-Instruct's template: it writes the BOS itself.
LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
          "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] "
          "| trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content "
          "%}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
CONTROL = ["<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
PROMPT = "Name a prime. "
EXPECTED = {
    "chatml": ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
               "Name a prime. <|im_end|>\n<|im_start|>assistant\n"),
    "llama3": ("<s><|start_header_id|>user<|end_header_id|>\n\nName a prime.<|eot_id|>"
               "<|start_header_id|>assistant<|end_header_id|>\n\n"),
}


def _tokenizer_dir(tmp_path, kind):
  """The fixture's tokenizer with the templates' control tokens added, and the template in
  chat_template.jinja (ChatML) or tokenizer_config.json's named list (Llama 3)."""
  out = tmp_path / kind
  out.mkdir()
  for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(FIXTURE / name, out / name)
  tok = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
  tok.add_special_tokens(CONTROL)
  tok.save(str(out / "tokenizer.json"))
  if kind == "chatml":
    (out / "chat_template.jinja").write_text(CHATML)
  else:
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "{{ raise_exception('no') }}"},
                               {"name": "default", "template": LLAMA3}]
    (out / "tokenizer_config.json").write_text(json.dumps(config))
  return out


@pytest.mark.parametrize("kind", ["chatml", "llama3"])
def test_rendered_and_encoded_as_transformers_does(tmp_path, kind):
  directory = _tokenizer_dir(tmp_path, kind)
  text = chat.load_template(str(directory)).render_user(PROMPT)
  assert text == EXPECTED[kind]
  ids = tokenizer_lib.HFTokenizer.load(directory).encode(text, add_special_tokens=False)
  assert list(ids).count(0) == (kind == "llama3")  # one BOS (<s> is id 0), the template's
  if not all(importlib.util.find_spec(m) for m in ("transformers", "torch")):
    pytest.skip("transformers is not installed: the committed expected text was checked")
  import transformers  # pylint: disable=import-outside-toplevel
  theirs = transformers.AutoTokenizer.from_pretrained(str(directory))
  messages = [{"role": "user", "content": PROMPT}]
  assert theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == text
  encoded = theirs.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
  assert list(encoded["input_ids"]) == ids.tolist()


def test_a_tokenizer_without_a_template_is_one_line():
  with pytest.raises(ValueError) as e:
    chat.load_template(str(FIXTURE))
  assert str(e.value) == (
      f"{FIXTURE}: the tokenizer has no chat_template (neither chat_template.jinja nor a "
      "chat_template in tokenizer_config.json); --chat needs a chat model's tokenizer")


def test_named_templates_without_a_default_and_a_failing_template(tmp_path):
  directory = _tokenizer_dir(tmp_path, "llama3")
  config_path = directory / "tokenizer_config.json"
  config = json.loads(config_path.read_text())
  config["chat_template"] = config["chat_template"][:1]  # tool_use only
  config_path.write_text(json.dumps(config))
  with pytest.raises(ValueError, match="lists templates \\['tool_use'\\] but none named"):
    chat.load_template(str(directory))
  # raise_exception, as templates call it on a conversation they refuse
  template = chat.ChatTemplate(str(config_path), "{{ raise_exception('roles must alternate') }}",
                               {})
  with pytest.raises(ValueError) as e:
    template.render_user("x")
  assert str(e.value) == f"{config_path}: the chat template fails: roles must alternate"

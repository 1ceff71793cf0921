"""jaxsys.cli.generate: --no_cache stops at EOS as the cached decoder does; --chat renders the
chat template, and a tokenizer without one is one error line."""
import json
import pathlib
import shutil
import sys
import types

import numpy as np
import pytest

from conftest import _only_flags
from jaxsys.checkpoint import hf
from jaxsys.data import tokenizer as tokenizer_lib
from jaxsys.models import generate

with _only_flags({}):  # the binary's flags set aside: other binaries define the same names
  from jaxsys.cli import generate as generate_cli

ROOT = pathlib.Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "data" / "hf_fixture"
EXPECTED = json.loads((FIXTURE / "expected.json").read_text())
# transformers' greedy ids of the llama3 fixture (expected.json): 115 is row 0's 4th token,
# row 2's and row 3's 2nd, and not among row 1's 8.
EOS = 115


def test_no_cache_stops_at_eos_as_the_cached_decoder():
  cfg, params = hf.load(str(FIXTURE / "llama3"))
  prompts, lengths = generate.pad_prompts([p["ids"] for p in EXPECTED["prompts"]])
  cached = generate.generate(cfg, params, prompts, lengths, max_new_tokens=8, eos_id=EOS)
  uncached = generate_cli.stop_at_eos(generate.greedy_without_cache(
      cfg, params, prompts, lengths, max_new_tokens=8), EOS)
  np.testing.assert_array_equal(uncached.lengths, [4, 8, 2, 2])
  np.testing.assert_array_equal(uncached.lengths, cached.lengths)
  np.testing.assert_array_equal(uncached.tokens, cached.tokens)
  assert generate_cli.stop_at_eos(cached, None) is cached


@pytest.mark.parametrize("tokenizer", ["byte", "bpe"])
def test_chat_with_a_run_tokenizer_without_a_template(tokenizer):
  data = types.SimpleNamespace(tokenizer=tokenizer)
  with pytest.raises(ValueError) as e:
    generate_cli._template(data, "/w/run")
  assert str(e.value) == (
      f"--chat: /w/run: the run's tokenizer (data.tokenizer='{tokenizer}') has no chat_template; "
      "--chat needs a Hugging Face tokenizer with one (--hf=<dir>, or a run with "
      "data.tokenizer='hf:<dir>')")


TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
            "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.mark.slow  # starts the binary
def test_chat_and_no_cache_from_the_command_line(tmp_path_factory):
  """--chat samples the rendered prompt (its one BOS the template's); --no_cache with an EOS
  prints what the cached decoder prints; --chat without a template: one error line."""
  sys.path.insert(0, str(ROOT / "tests" / "experiments"))  # forked_cli's home
  import forked_cli  # pylint: disable=import-outside-toplevel
  chat_dir = tmp_path_factory.mktemp("chat_model")
  for f in (FIXTURE / "llama3").iterdir():
    shutil.copy(f, chat_dir / f.name)
  (chat_dir / "chat_template.jinja").write_text(TEMPLATE)
  eos = ["--prompt=def fib(n):", "--prompt=import os", "--max_new_tokens=8", f"--eos_id={EOS}"]
  cases = [[f"--hf={chat_dir}", "--chat", "--prompt=hi", "--max_new_tokens=6"],
           [f"--hf={FIXTURE / 'llama3'}", *eos], [f"--hf={FIXTURE / 'llama3'}", *eos, "--no_cache"],
           [f"--hf={FIXTURE / 'llama3'}", "--chat", "--prompt=hi"]]
  (code, out, err), (ccode, cached, cerr), (ncode, uncached, nerr), (bad, bad_out, bad_err) = (
      forked_cli.run("experiments.generate", cases, tmp_path_factory.mktemp("generate_chat")))
  assert code == 0, err[-3000:]
  tok = tokenizer_lib.HFTokenizer.load(chat_dir)
  rendered = "<s><|user|>hi<|assistant|>"
  ids = tok.encode(rendered, add_special_tokens=False)
  assert list(ids).count(0) == 1  # one BOS (<s>)
  cfg, params = hf.load(str(chat_dir))
  want = generate.generate(cfg, params, ids[None], np.array([len(ids)]), max_new_tokens=6,
                           eos_id=1)  # config.json's eos_token_id
  n = int(want.lengths[0])
  text = rendered + tokenizer_lib.decode_continuation(tok, ids, np.asarray(want.tokens[0, :n]))
  assert f"--- sample 0: {n} new tokens ---\n{text}\n" in out
  assert ccode == 0 and ncode == 0, (cerr[-2000:], nerr[-2000:])
  samples = lambda s: s[:s.rindex("\n---")]  # the samples, not the rate line
  assert "--- sample 0: 4 new tokens ---" in cached
  assert samples(uncached) == samples(cached)
  assert bad == 1 and not bad_out
  assert sum(line.startswith("error:") for line in bad_err.splitlines()) == 1
  assert bad_err.strip().splitlines()[-1] == (
      f"error: {FIXTURE / 'llama3'}: the tokenizer has no chat_template (neither "
      "chat_template.jinja nor a chat_template in tokenizer_config.json); --chat needs a chat "
      "model's tokenizer")

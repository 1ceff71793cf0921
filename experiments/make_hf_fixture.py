r"""The Hugging Face test fixture: tiny random Llamas that transformers itself builds, saves
and runs, so the suite checks jaxsys against transformers' numbers without torch.

  pip install -e '.[hf]'   # transformers + torch (CPU)
  python -m experiments.make_hf_fixture --out=tests/data/hf_fixture
  python -m experiments.make_hf_fixture --models=mistral_window   # add or redo some models

--models rewrites only those models' directories and entries, keeping the others' expected
numbers byte for byte (torch's CPU reductions vary in the last bits between runs and
thread counts, so a full rerun moves every logit by ~5e-7 relative).

Writes, under --out:
  untied/   LlamaForCausalLM, float32 safetensors in shards (+ index), config.json,
            generation_config.json, tokenizer.json, tokenizer_config.json
  tied/     the same with tie_word_embeddings, head_dim 16 != hidden / heads, more
            embedding rows than the tokenizer has ids, and bfloat16 safetensors
  llama3/   float32, untied, with Llama 3.x's `llama3` rope scaling (factor 8 over an
            original context of 128, so the head dim's 8 frequencies fall in all three
            of its bands: kept, ramped and slowed)
  llama3_tied/  the same scaling at Llama 3.2's factor 32, tied embeddings, bfloat16 files
  qwen2/    Qwen2ForCausalLM (q/k/v biases), float32, tied as Qwen2.5's small models are
  qwen3/    Qwen3ForCausalLM (q/k norms, head_dim 16 != hidden / heads), float32, untied
  mistral_window/  MistralForCausalLM with sliding_window 5, shorter than most prompts plus
            their continuations (up to 20 tokens), float32, untied
  qwen2_yarn/  Qwen2ForCausalLM with Qwen2.5's long-context `yarn` rope scaling (factor 4
            over an original context of 64: of head dim 16's 8 frequencies one kept, two
            blended, five divided by 4; cos/sin scaled by 1.139), float32, untied
  expected.json  versions; per prompt: its text, the ids transformers' tokenizer gives
            (AutoTokenizer on the directory), and per model the greedy continuation of
            `model.generate(do_sample=False)` (ids and text) and the smallest gap between
            the best and second-best logit over its steps
  expected.npz   per model and prompt, `<model>/<prompt index>`: transformers' float32
            logits [prompt + continuation tokens, vocab] of the whole greedy sequence

Every expected number comes from the model transformers re-reads from the saved directory
(`from_pretrained(..., dtype=float32)`), so the files are the ones the numbers belong to.
Weights are random at unit-scale activations with RMSNorm scales in [0.5, 1.5]: HF's 0.02
init with unit norms would hide a swapped or mis-laid tensor.
"""
import json
import os
import sysconfig

import numpy as np
from absl import app, flags

from jaxsys.cli import hf_runs

_OUT = flags.DEFINE_string("out", "tests/data/hf_fixture", "Directory the fixture is written to.")
_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 8, "Greedy tokens generated per prompt.")
_ONLY = flags.DEFINE_list("models", [], "Models to (re)make, merged into the existing expected "
                          "files; empty: every model, expected files written anew.")

# name: LlamaConfig fields; "dtype" and "shard" say how save_pretrained writes it.
MODELS = {
    "untied": dict(vocab_size=280, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, rope_theta=10_000.0,
                   rms_norm_eps=1e-5, tie_word_embeddings=False, dtype="float32",
                   shard="48KB", seed=0),
    "tied": dict(vocab_size=296, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 rope_theta=500_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                 dtype="bfloat16", shard=None, seed=1),
    "llama3": dict(vocab_size=280, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                   rope_parameters=dict(rope_type="llama3", rope_theta=500_000.0, factor=8.0,
                                        low_freq_factor=1.0, high_freq_factor=4.0,
                                        original_max_position_embeddings=128),
                   rms_norm_eps=1e-5, tie_word_embeddings=False, dtype="float32", shard=None,
                   seed=2),
    "llama3_tied": dict(vocab_size=280, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                        head_dim=16,
                        rope_parameters=dict(rope_type="llama3", rope_theta=500_000.0,
                                             factor=32.0, low_freq_factor=1.0,
                                             high_freq_factor=4.0,
                                             original_max_position_embeddings=128),
                        rms_norm_eps=1e-5, tie_word_embeddings=True, dtype="bfloat16",
                        shard=None, seed=5),
    "qwen2": dict(arch="Qwen2", vocab_size=280, hidden_size=32, intermediate_size=64,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                  dtype="float32", shard=None, seed=3),
    "qwen3": dict(arch="Qwen3", vocab_size=280, hidden_size=32, intermediate_size=64,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, dtype="float32", shard=None, seed=4),
    "mistral_window": dict(arch="Mistral", vocab_size=280, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           sliding_window=5, rope_theta=10_000.0, rms_norm_eps=1e-5,
                           tie_word_embeddings=False, dtype="float32", shard=None, seed=6),
    "qwen2_yarn": dict(arch="Qwen2", vocab_size=280, hidden_size=32, intermediate_size=64,
                       num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                       head_dim=16,
                       rope_parameters=dict(rope_type="yarn", rope_theta=10_000.0, factor=4.0,
                                            original_max_position_embeddings=64),
                       rms_norm_eps=1e-6, tie_word_embeddings=False, dtype="float32",
                       shard=None, seed=7),
}
TOKENIZER_VOCAB = 280  # 256 bytes, <s>, </s> and 22 merges
PROMPTS = ["def fib(n):", "import os", "x", "héllo wörld"]


def make_tokenizer():
  """A byte-level BPE trained on a little stdlib text; its post-processor adds the <s> BOS."""
  # pylint: disable-next=import-outside-toplevel
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
  root = sysconfig.get_paths()["stdlib"]
  texts = []
  for name in ("textwrap.py", "string.py", "this.py"):
    with open(os.path.join(root, name), encoding="utf-8") as f:
      texts.append(f.read())
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=["<s>", "</s>"],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tok.train_from_iterator(texts, trainer=trainer)
  tok.post_processor = processors.TemplateProcessing(
      single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
  return tok


def make_model(directory: str, spec: dict, tokenizer) -> None:
  """save_pretrained of a random model (`arch`: Llama unless given) and its tokenizer into
  `directory`."""
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  spec = dict(spec)
  dtype, shard, seed = spec.pop("dtype"), spec.pop("shard"), spec.pop("seed")
  arch = spec.pop("arch", "Llama")
  bos, eos = tokenizer.token_to_id("<s>"), tokenizer.token_to_id("</s>")
  config = getattr(transformers, f"{arch}Config")(**spec, bos_token_id=bos, eos_token_id=eos,
                                                  max_position_embeddings=256)
  torch.manual_seed(seed)
  model = hf_runs.randomize_torch_llama(getattr(transformers, f"{arch}ForCausalLM")(config), seed)
  model = model.to(getattr(torch, dtype))
  model.save_pretrained(directory, **({"max_shard_size": shard} if shard else {}))
  fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>",
                                              eos_token="</s>")
  fast.save_pretrained(directory)


def run_model(directory: str, ids: list[list[int]], max_new_tokens: int):
  """transformers' greedy continuation of each prompt, the smallest top-1/top-2 logit gap
  over its steps, and the float32 logits of the whole sequence (prompt + continuation)."""
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
  eos = model.config.eos_token_id
  rows, logits = [], []
  for prompt in ids:
    x = torch.tensor([prompt])
    with torch.no_grad():
      out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                           max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=eos,
                           output_logits=True, return_dict_in_generate=True)
      new = out.sequences[0, len(prompt):].tolist()
      top2 = torch.stack(out.logits)[:, 0].float().topk(2, dim=-1).values
      full = model(out.sequences).logits[0].float().numpy()
    rows.append({"ids": new, "gap": float((top2[:, 0] - top2[:, 1]).min())})
    logits.append(full)
  return rows, logits


def _previous(out: str, names) -> tuple[dict, dict]:
  """The expected.json and expected.npz entries of the models not in `names` (for --models)."""
  with open(os.path.join(out, "expected.json")) as f:
    expected = json.load(f)
  with np.load(os.path.join(out, "expected.npz")) as z:
    arrays = {k: z[k] for k in z.files if k.split("/")[0] not in names}
  expected["models"] = {k: v for k, v in expected["models"].items() if k not in names}
  return expected, arrays


def main(argv):
  del argv
  import tokenizers  # pylint: disable=import-outside-toplevel
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  out = _OUT.value
  names = _ONLY.value or list(MODELS)
  unknown = sorted(set(names) - set(MODELS))
  if unknown:
    raise app.UsageError(f"--models={','.join(unknown)} is unknown; valid: {', '.join(MODELS)}")
  tokenizer = make_tokenizer()
  versions = {"transformers": transformers.__version__, "torch": torch.__version__,
              "tokenizers": tokenizers.__version__}
  if _ONLY.value:
    expected, arrays = _previous(out, names)
    expected.update(versions)  # the new models' numbers come from these versions
  else:
    expected, arrays = {**versions, "max_new_tokens": _NEW_TOKENS.value, "prompts": [],
                        "models": {}}, {}
  for name in names:
    make_model(os.path.join(out, name), MODELS[name], tokenizer)
  auto = transformers.AutoTokenizer.from_pretrained(os.path.join(out, names[0]))
  ids = [auto(text)["input_ids"] for text in PROMPTS]
  if _ONLY.value and [p["ids"] for p in expected["prompts"]] != ids:
    raise app.UsageError("the tokenizer's prompt ids differ from expected.json's; remake "
                         "every model (no --models)")
  expected["prompts"] = [{"text": t, "ids": i} for t, i in zip(PROMPTS, ids)]
  for name in names:
    rows, logits = run_model(os.path.join(out, name), ids, _NEW_TOKENS.value)
    for row in rows:
      row["text"] = auto.decode(row["ids"])
    expected["models"][name] = rows
    arrays.update({f"{name}/{i}": x for i, x in enumerate(logits)})
    print(f"{name}: continuations {[r['ids'] for r in rows]}, smallest top-1/top-2 gap "
          f"{min(r['gap'] for r in rows):.3f}")
  expected["models"] = {k: expected["models"][k] for k in MODELS if k in expected["models"]}
  with open(os.path.join(out, "expected.json"), "w") as f:
    json.dump(expected, f, indent=1, ensure_ascii=False)
  np.savez_compressed(os.path.join(out, "expected.npz"), **arrays)
  total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(out) for f in fs)
  print(f"wrote {out}: {total / 1024:.0f} KB")


if __name__ == "__main__":
  app.run(main)

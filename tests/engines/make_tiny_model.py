"""Builds the tiny model the real-vLLM test serves: no download, the same
files on every run.

A Llama with two layers and random weights (seed 0) and a byte-level BPE
tokenizer trained here on a generated corpus (seed 0), with Llama 3 style
special tokens and a ChatML-like chat template. The model's output is noise;
what the test needs from it is real: vLLM's tokenizer, template, scheduler,
prefix cache, KV events and metrics running on a model it accepts.

Usage: python make_tiny_model.py DIR
Writes DIR/config.json, model.safetensors, tokenizer.json,
tokenizer_config.json, generation_config.json and chat.jinja (the template
alone, for kvedge's picker).
"""

import json
import random
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"

# The template's text outside the messages begins and ends at special
# tokens, as the chat templates of real models do. It is written over
# several lines, as most models' templates are: it renders to that text only
# in transformers' environment (trim_blocks and lstrip_blocks on), which
# the real-engine tests hold kvedge to.
CHAT_TEMPLATE = r"""{{ bos_token }}
{%- for message in messages %}
    {% if message['role'] == 'system' %}
{{ '<|im_start|>system\n' + message['content'] + '<|im_end|>\n' }}
    {%- else %}
{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}
    {%- endif %}
{% endfor %}
{% if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}"""

WORDS = (
    "the a of to and in is that for it on with as was by be at this from "
    "cache block engine router request token prompt worker prefix load "
    "model server queue memory kernel batch decode prefill latency "
    "system user assistant question answer document summary history turn "
    "river mountain garden window letter music number paper market island "
    "quickly slowly always never often rarely here there today tomorrow "
    "red green blue yellow small large ancient modern quiet bright"
).split()


def corpus(seed: int, lines: int) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        n = rng.randint(4, 24)
        words = [rng.choice(WORDS) for _ in range(n)]
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 9999)))
        out.append(" ".join(words) + rng.choice([".", "?", "!", ","]))
    return out


def tokenizer(vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(0, 20000), trainer=trainer)
    bos = tok.token_to_id(BOS)
    # As Llama 3: the completions endpoint's prompt starts with BOS.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos)]
    )
    return tok


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    tok = tokenizer(2048)
    tok.save(str(out / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": BOS,
                "eos_token": EOS,
                "model_max_length": 4096,
                "chat_template": CHAT_TEMPLATE,
            },
            indent=2,
        )
    )
    (out / "chat.jinja").write_text(CHAT_TEMPLATE)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        bos_token_id=tok.token_to_id(BOS),
        eos_token_id=tok.token_to_id(EOS),
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").write_text(
        json.dumps(
            {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id},
            indent=2,
        )
    )


if __name__ == "__main__":
    main()

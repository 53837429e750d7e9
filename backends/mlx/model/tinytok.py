"""The tiny models' tokenizer and ChatML chat template, built locally and deterministically.

Owns: a byte-level BPE tokenizer trained (with the `tokenizers` library) on English sentences
generated from a word list shipped here, the Qwen3-style chat template (tools in the system
turn, `<tool_call>` JSON, tool results, `<think>` reasoning kept only after the last user
query), the set of "word" token ids the tiny models may emit, and saving it all next to a model.

The decoder is a `Sequence` wrapping `ByteLevel` on purpose: mlx-lm picks its
`BPEStreamingDetokenizer` for a bare `ByteLevel` decoder, and that detokenizer drops the leading
space of the first generated token. The tiny models only emit space-prefixed words, so the
dropped space would make a reply re-encode to different ids when a client sends it back. With a
`Sequence` decoder mlx-lm uses its naive detokenizer, which returns the exact decoded text.
"""

from __future__ import annotations

import random
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

EOS = "<|im_end|>"
PAD = "<|endoftext|>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, "<|im_start|>", EOS)
# Markup tokens that appear in decoded text (not skipped as "special"), as in Qwen3.
MARKUP_TOKENS: tuple[str, ...] = ("<think>", "</think>", "<tool_call>", "</tool_call>")

# Everyday English plus a few domain words; sentences drawn from these train the BPE merges.
_WORD_TEXT = """
the of and to in is was for on are with as by at be this from or have an they which one
you had not but what all were when we there can been has more if will each about how up out
them then she many some so these would other into her two make like him see time could no
make than first been its who now people my made over did down only way find use may water
long little very after words called just where most know get through back much before go good
new write our used me man too any day same right look think also around another came come
work three word must because does part even place well such here take why things help put
years different away again off went old number great tell men say small every found still
between name should home big give air line set own under read last never us left end along
while might next sound below saw something thought both few those always looked show large
often together asked house world going want school important until form food keep children
feet land side without boy once animals life enough took sometimes four head above kind began
almost live page got earth need far hand high year mother light parts country father let night
following picture being study second eyes soon times story boys since white days ever paper
hard near sentence better best across during today others however sure means knew its try told
young miles sun ways thing whole hear example heard several change answer room sea against top
turned learn point city play toward five using himself usually money seen car morning river
cache prefix token model state window layer memory agent request reply server client stream
"""
WORDS: tuple[str, ...] = tuple(_WORD_TEXT.split())

CHAT_TEMPLATE = """\
{%- macro render_content(content) -%}
{%- if content is string -%}{{ content }}
{%- elif content -%}{%- for part in content if part.type == 'text' -%}{{ part.text }}{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}
{{- render_content(messages[0].content) + '\\n\\n' }}
{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + tool | tojson }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and ' }}
{{- 'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n' }}
{{- '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + render_content(messages[0].content) + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_query_index=messages|length - 1, found=false) %}
{%- for message in messages[::-1] %}
{%- set content = render_content(message.content) %}
{%- if not ns.found and message.role == 'user' and not (content.startswith('<tool_response>')
      and content.endswith('</tool_response>')) %}
{%- set ns.found = true %}{%- set ns.last_query_index = messages|length - 1 - loop.index0 %}
{%- endif %}
{%- endfor %}
{%- for message in messages %}
{%- set content = render_content(message.content) %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{%- set reasoning = message.reasoning_content if message.reasoning_content is string else '' %}
{%- if '</think>' in content %}
{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
{%- set content = content.split('</think>')[-1].lstrip('\\n') %}
{%- endif %}
{{- '<|im_start|>assistant\\n' }}
{%- if loop.index0 > ns.last_query_index and reasoning %}
{{- '<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' }}
{%- endif %}
{{- content }}
{%- for tool_call in message.tool_calls or [] %}
{%- if loop.first and content or not loop.first %}{{- '\\n' }}{%- endif %}
{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
{{- tool_call.arguments if tool_call.arguments is string else tool_call.arguments | tojson }}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
{{- '<|im_start|>user' }}
{%- endif %}
{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}
{{- '<think>\\n\\n</think>\\n\\n' }}
{%- endif %}
{%- endif %}
"""


def corpus(n_sentences: int = 3000, seed: int = 1234) -> list[str]:
    """Deterministic English-looking training sentences drawn from WORDS."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n_sentences):
        words = rng.choices(WORDS, k=rng.randint(4, 14))
        words[0] = words[0].capitalize()
        lines.append(" ".join(words) + rng.choice((".", ".", "?", ",")))
    return lines


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer of at most `vocab_size` ids, the same on every run."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.Sequence([decoders.ByteLevel()])
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(MARKUP_TOKENS),
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    return tok


def word_token_ids(tok: Tokenizer) -> list[int]:
    """Ids of tokens that are a space plus a whole word from WORDS and encode back to themselves.

    Any sequence of such tokens decodes to text that re-encodes to the same ids, in isolation or
    after a chat template's `assistant\\n`, because ByteLevel pre-tokenization splits before each
    space-prefixed word and merges never cross that split.
    """
    words = set(WORDS)
    ids = []
    for token_id in range(tok.get_vocab_size()):
        text = tok.decode([token_id], skip_special_tokens=False)
        if text.startswith(" ") and text[1:] in words and tok.encode(text).ids == [token_id]:
            ids.append(token_id)
    return ids


def save_tokenizer(tok: Tokenizer, out_dir: Path) -> None:
    """Write tokenizer.json, tokenizer_config.json (with the chat template) into `out_dir`."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=PAD,
        bos_token=None,
        unk_token=None,
        clean_up_tokenization_spaces=False,
        model_max_length=32768,
        additional_special_tokens=[SPECIAL_TOKENS[1]],
    )
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(str(out_dir))

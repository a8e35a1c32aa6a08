"""Chat-template variants of forged models, one per tool-call format.

No hub checkpoint is reachable, so the tests' tool-calling and reasoning
models are forged ones whose tokenizer gets a family's chat conventions: the
markers mlx-lm infers a tool parser and think tags from, the family's way of
rendering tools, tool calls and tool results, and (where the family has them)
those markers as single tokens.  A marker token takes over the id of one of
the vocabulary's last BPE entries, so the model's embedding still covers
every id.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from .tokenizer import EOS

HERMES = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You may call one or more functions to assist with the user query.

<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages %}{% if m.role == 'system' and loop.first %}{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{% if m.reasoning_content %}<think>
{{ m.reasoning_content }}
</think>

{% endif %}{{ m.content or '' }}{% for tool_call in m.tool_calls or [] %}{% if tool_call.function %}{% set tool_call = tool_call.function %}{% endif %}
<tool_call>
{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% endif %}{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% else %}<think>
{% endif %}{% endif %}"""

MISTRAL = """\
{%- for m in messages %}{% if m.role == 'system' %}[SYSTEM_PROMPT]{{ m.content }}[/SYSTEM_PROMPT]\
{% elif m.role == 'user' %}{% if loop.last and tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}\
[INST]{{ m.content }}[/INST]\
{% elif m.role == 'tool' %}[TOOL_RESULTS]{"content": {{ m.content | tojson }}, "call_id": "{{ m.tool_call_id }}"}[/TOOL_RESULTS]\
{% elif m.tool_calls %}[TOOL_CALLS][{% for c in m.tool_calls %}{"name": "{{ c.function.name }}", \
"arguments": {{ c.function.arguments | tojson }}}{% if not loop.last %}, {% endif %}{% endfor %}]<|endoftext|>\
{% else %}{{ m.content }}<|endoftext|>{% endif %}{% endfor %}"""

LLAMA3 = """\
<|start_header_id|>system<|end_header_id|>

{% if tools %}Environment: ipython
Given the following functions, respond with a JSON for a function call with its proper arguments. \
Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.
{% for t in tools %}{{ t | tojson }}
{% endfor %}{% endif %}{% if messages[0].role == 'system' %}{{ messages[0].content }}{% endif %}<|eot_id|>
{%- for m in messages %}{% if m.role == 'system' %}{% elif m.role == 'tool' %}\
<|start_header_id|>ipython<|end_header_id|>

{{ m.content }}<|eot_id|>{% elif m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>

<|python_tag|>{% for c in m.tool_calls %}{"name": "{{ c.function.name }}", "parameters": \
{{ c.function.arguments | tojson }}}{% endfor %}<|eot_id|>{% else %}<|start_header_id|>{{ m.role }}<|end_header_id|>

{{ m.content }}<|eot_id|>{% endif %}{% endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

HARMONY = """\
<|start|>system<|message|>You are a helpful assistant.
Reasoning: {{ reasoning_effort | default('medium') }}

# Valid channels: analysis, commentary, final.<|end|>
{%- if tools %}<|start|>developer<|message|># Tools

## functions

namespace functions {
{% for t in tools %}// {{ t.function.description }}
type {{ t.function.name }} = (_: {{ t.function.parameters | tojson }}) => any;
{% endfor %}} // namespace functions<|end|>{% endif %}
{%- for m in messages %}{% if m.role == 'assistant' and m.tool_calls %}{% for c in m.tool_calls %}\
<|start|>assistant<|channel|>commentary to=functions.{{ c.function.name }} <|constrain|>json<|message|>\
{{ c.function.arguments | tojson }}<|call|>{% endfor %}{% elif m.role == 'assistant' %}\
<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>{% elif m.role == 'tool' %}\
<|start|>functions.{{ m.name }} to=assistant<|channel|>commentary<|message|>{{ m.content }}<|end|>\
{% else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endif %}{% endfor %}
{%- if add_generation_prompt %}<|start|>assistant{% endif %}"""

# style -> (template, marker tokens, special ones among them, extra end-of-sequence markers)
STYLES: dict[str, tuple[str, tuple[str, ...], bool, tuple[str, ...]]] = {
    "hermes": (HERMES, ("<think>", "</think>"), False, ()),
    "mistral": (MISTRAL, ("[TOOL_CALLS]",), True, ()),
    "llama3": (LLAMA3, (), True, ()),
    "harmony": (HARMONY, ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>",
                          "<|constrain|>"), True, ("<|return|>", "<|call|>")),
}


def chat_variant(source: Path | str, out_dir: Path | str, style: str, context: int | None = None) -> Path:
    """Copy the forged model at ``source`` with the ``style`` family's chat conventions;
    ``context`` widens its declared window (RoPE positions have no trained limit) to
    hold an agent client's prompt, whose system prompt and tools run to tens of
    thousands of tokens."""
    template, markers, special, ends = STYLES[style]
    source, out_dir = Path(source), Path(out_dir)
    shutil.copytree(source, out_dir, dirs_exist_ok=True)
    tokenizer = json.loads((out_dir / "tokenizer.json").read_text())
    config = json.loads((out_dir / "tokenizer_config.json").read_text())
    vocab, merges = tokenizer["model"]["vocab"], tokenizer["model"]["merges"]
    by_id = {i: piece for piece, i in vocab.items()}
    top = max(by_id)
    ids = {}
    for n, marker in enumerate(markers):
        token = top - len(markers) + 1 + n
        piece = by_id[token]
        del vocab[piece]
        merges[:] = [m for m in merges if "".join(m if isinstance(m, list) else m.split(" ")) != piece]
        entry = {"content": marker, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
                 "special": special}
        tokenizer["added_tokens"].append({"id": token, **entry})
        config["added_tokens_decoder"][str(token)] = entry
        ids[marker] = token
    tokenizer["added_tokens"].sort(key=lambda token: token["id"])  # in id order, as transformers reads them
    config["chat_template"] = template
    (out_dir / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=1))
    model_config = json.loads((out_dir / "config.json").read_text())
    if ends:
        eos = next(t["id"] for t in tokenizer["added_tokens"] if t["content"] == EOS)
        model_config["eos_token_id"] = [eos] + [ids[e] for e in ends]
    if context is not None:
        model_config["max_position_embeddings"] = context
    (out_dir / "config.json").write_text(json.dumps(model_config, indent=1))
    return out_dir

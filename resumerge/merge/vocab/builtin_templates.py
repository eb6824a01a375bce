"""The chat templates a config can name (``chat_template: chatml``), written for resumerge.

Each renders its model family's standard prompt format and uses ``{%- -%}`` whitespace control throughout, so it
renders the same whether or not the Jinja environment trims blocks (transformers does). They are Python strings
rather than package data files so an installed wheel can never lack them.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

# Stanford Alpaca: an optional system preamble, then "### Instruction:" / "### Input:" / "### Response:" blocks,
# all separated by one blank line; the generation prompt opens a response block.
ALPACA = (
    "{%- set ns = namespace(blocks=[]) -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{%- set ns.blocks = ns.blocks + [message['content'] | trim] -%}"
    "{%- elif message['role'] == 'user' -%}"
    "{%- set ns.blocks = ns.blocks + ['### Instruction:\\n' + message['content'] | trim] -%}"
    "{%- elif message['role'] == 'user_context' -%}"
    "{%- set ns.blocks = ns.blocks + ['### Input:\\n' + message['content'] | trim] -%}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{%- set ns.blocks = ns.blocks + ['### Response:\\n' + message['content'] | trim] -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt and (messages | length == 0 or messages[-1]['role'] != 'assistant') -%}"
    "{%- set ns.blocks = ns.blocks + ['### Response:\\n'] -%}"
    "{%- endif -%}"
    "{{- ns.blocks | join('\\n\\n') -}}"
)

# ChatML (OpenAI, Qwen, many fine-tunes): every turn is <|im_start|>role\ncontent<|im_end|>\n.
CHATML = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)

# Meta Llama 3: BOS once, then header-wrapped turns each closed by <|eot_id|> with the content trimmed.
LLAMA3 = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}"
    "{%- endif -%}"
)

# Mistral instruct (v1 text form): <s>[INST] user [/INST] answer</s>[INST] ..., an optional system message
# prefixed to the first user turn, and strictly alternating roles.
MISTRAL = (
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set system_message = messages[0]['content'] -%}"
    "{%- set turns = messages[1:] -%}"
    "{%- else -%}"
    "{%- set turns = messages -%}"
    "{%- endif -%}"
    "{{- bos_token -}}"
    "{%- for message in turns -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{- raise_exception('After an optional system message, roles must alternate user/assistant/user/...') -}}"
    "{%- endif -%}"
    "{%- if message['role'] == 'user' -%}"
    "{%- if loop.first and system_message is defined -%}"
    "{{- '[INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' -}}"
    "{%- else -%}"
    "{{- '[INST] ' + message['content'] + ' [/INST]' -}}"
    "{%- endif -%}"
    "{%- else -%}"
    "{{- ' ' + message['content'] + eos_token -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
)

# LG EXAONE 3: [|role|]content, user turns end with a newline, others with [|endofturn|]\n; a conversation that
# does not open with a system turn gets an empty one.
EXAONE = (
    "{%- for message in messages -%}"
    "{%- if loop.first and message['role'] != 'system' -%}"
    "{{- '[|system|][|endofturn|]\\n' -}}"
    "{%- endif -%}"
    "{{- '[|' + message['role'] + '|]' + message['content'] -}}"
    "{%- if message['role'] == 'user' -%}"
    "{{- '\\n' -}}"
    "{%- else -%}"
    "{{- '[|endofturn|]\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '[|assistant|]' -}}"
    "{%- endif -%}"
)

BUILTIN_TEMPLATES: Mapping[str, str] = MappingProxyType({
    "alpaca": ALPACA,
    "chatml": CHATML,
    "exaone": EXAONE,
    "llama3": LLAMA3,
    "mistral": MISTRAL,
})

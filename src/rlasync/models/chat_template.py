"""The ChatML chat template of rlasync's tiny models, with tool calls.

Qwen-style turns (``<|im_start|>role\\n…<|im_end|>\\n``); tools listed in the system turn as
JSON inside ``<tools>…</tools>``; an assistant's tool calls as
``<tool_call>{"name": …, "arguments": {…}}</tool_call>``; a tool's answer as a user turn
``<tool_response>…</tool_response>`` (the Hermes format our tool parser reads). Compact on
purpose: every token costs a tiny model. Literal newlines are emitted with ``{{- '…\\n' }}``,
because ``{%- … -%}`` would strip the newline after ``<|im_end|>`` (a transformers pitfall
measured here).
"""

CHAT_TEMPLATE = (
    "{%- set ns = namespace(start=0) -%}"
    "{%- if messages and messages[0].role == 'system' -%}"
    "{%- set ns.start = 1 -%}"
    "{{- '<|im_start|>system\\n' + messages[0].content -}}"
    "{%- if tools -%}{{- '\\n' -}}{%- endif -%}"
    "{%- elif tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- endif -%}"
    "{%- if tools -%}"
    "{{- '<tools>' -}}"
    "{%- for tool in tools -%}{{- (tool.function if tool.function is defined else tool) | tojson -}}{%- endfor -%}"
    "{{- '</tools>' -}}"
    "{%- endif -%}"
    "{%- if ns.start == 1 or tools -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- for message in messages[ns.start:] -%}"
    "{%- if message.role == 'user' -%}"
    "{{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' -}}"
    "{%- elif message.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if message.content -%}{{- message.content -}}{%- endif -%}"
    "{%- for call in (message.tool_calls or []) -%}"
    "{%- set fn = call.function if call.function is defined else call -%}"
    "{%- set args = fn.arguments if fn.arguments is string else (fn.arguments | tojson) -%}"
    "{{- '<tool_call>{\"name\": \"' + fn.name + '\", \"arguments\": ' + args + '}</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif message.role == 'tool' -%}"
    "{{- '<|im_start|>user\\n<tool_response>' + message.content + '</tool_response><|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

"""Chat templates: a checkpoint's Jinja template rendered in a bounded sandbox, and the prompt's token ids
with control tokens only where the template wrote them. The one entry the rest of the runtime uses.

    template = ChatTemplate(source, bos_token="<s>", eos_token="</s>")
    text = template.render(messages, add_generation_prompt=True, enable_thinking=False)
    ids = chat_prompt_ids(template, tokenizer, messages, tools=[...])

Extra keyword arguments of `render` and `chat_prompt_ids` (tools, documents, enable_thinking, ...) reach
the template as variables, as transformers' `apply_chat_template(..., **kwargs)` passes them; they are
data like the messages, so special-token text in them stays text.

The modules: chat_template.py (ChatTemplate, message checks), prompt_ids.py (render -> ids),
sandbox.py (the jinja environment: compile and render within bounds), limits.py (the bounds and the
render's budget), costs.py (what each operation would build, asked before it runs), sizes.py (bounds of
a value's printed size), filters.py (the bounded filters and globals). See docs/architecture.md.
"""

from .chat_template import ROLES, ChatTemplate, read_template_file, validate_messages
from .prompt_ids import chat_prompt_ids

__all__ = ["ROLES", "ChatTemplate", "chat_prompt_ids", "read_template_file", "validate_messages"]

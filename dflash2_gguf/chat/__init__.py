"""Chat: from messages to a prompt, and from generated text back to a chat message.

- :mod:`.templates`: the one chat renderer (a GGUF's Jinja chat template, rendered as Hugging
  Face renders it), :func:`~dflash2_gguf.chat.templates.chat_prompt_ids`.
- :mod:`.toolcalls`: tool-call formats of the templates, parsed from text as it streams.
- :mod:`.reasoning`: thinking text split from the answer (``reasoning_content``).
- :mod:`.stops`: stop strings held back across chunks until they can no longer match.
- :mod:`.grammar`: JSON schema -> GBNF grammar (constrained outputs, tool calls).
- :mod:`.output`: a chat completion's message assembled from the streamed text (content,
  reasoning, tool calls, finish reason), as the server answers it.

Importing this package imports neither jinja2 nor libllama.
"""

"""Tool calling and structured output: the tool-call formats of model families (a registry chosen from the
GGUF's chat template), the grammars that enforce ``tool_choice`` and ``response_format``, and the parsers
that turn a reply's text into OpenAI ``tool_calls``, streamed or whole."""

"""Whether llama.cpp starts a prompt of a model with BOS, read from the GGUF header alone (no load).

llama.cpp adds BOS to a text it tokenizes with ``add_special`` when its vocabulary says so
(``llama_vocab_get_add_bos``), which llama-server does for every prompt. The vocabulary decides as
``llama_vocab::impl::load`` does (``src/llama-vocab.cpp``): the header's ``tokenizer.ggml.add_bos_token``
when present, else a default by tokenizer: SentencePiece and WordPiece yes, the llama3, tekken and chameleon
pre-tokenizers of BPE yes, other BPE, T5's unigram and RWKV no; Gemma 4's is forced on. The BOS id is
``tokenizer.ggml.bos_token_id``, else the tokenizer's default id.

The engine worker knows the same from the loaded vocabulary (``serve_load``'s ``add_bos``); this is for code
that has the header and no serving engine: ``flux generate`` (a measuring load, whose ``tokenize`` adds
nothing) and the server's chat templates, chosen before the worker starts.
"""

from __future__ import annotations

from typing import Any

# BPE pre-tokenizers llama.cpp gives add_bos = true (llama-vocab.cpp, the pre_type switch)
BOS_PRE_TOKENIZERS = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
                                "lfm2", "jina-v5-nano", "tekken", "chameleon", "gemma4"})
# tokenizer.ggml.model -> (add_bos when the header does not say, BOS id when the header does not say)
_DEFAULTS: dict[str, tuple[bool, int | None]] = {"llama": (True, 1), "bert": (True, 101), "gpt2": (False, 11),
                                                 "t5": (False, None), "rwkv": (False, None),
                                                 "plamo2": (False, 1), "gemma4": (True, None)}


def adds_bos(metadata: dict[str, Any]) -> bool:
    """Whether llama.cpp adds BOS to this model's prompts (``llama_vocab_get_add_bos``)."""
    model = str(metadata.get("tokenizer.ggml.model") or "")
    pre = "gemma4" if model == "gemma4" else str(metadata.get("tokenizer.ggml.pre") or "")
    if pre == "gemma4":
        return True  # llama.cpp overrides a false add_bos_token for Gemma 4
    explicit = metadata.get("tokenizer.ggml.add_bos_token")
    if isinstance(explicit, bool):
        return explicit
    if model == "gpt2":
        return pre in BOS_PRE_TOKENIZERS
    return _DEFAULTS.get(model, (False, None))[0]


def bos_id(metadata: dict[str, Any]) -> int | None:
    """The BOS token's id (``llama_vocab_bos``), or None where the vocabulary has none."""
    tid = metadata.get("tokenizer.ggml.bos_token_id")
    if isinstance(tid, int) and not isinstance(tid, bool):
        return tid
    return _DEFAULTS.get(str(metadata.get("tokenizer.ggml.model") or ""), (False, None))[1]


def with_bos(metadata: dict[str, Any], tokens: list[int]) -> list[int]:
    """``tokens`` (of a text tokenized without special tokens added) as llama.cpp's ``add_special`` gives them:
    BOS first when the model adds it and has one."""
    bos = bos_id(metadata)
    return [bos, *tokens] if adds_bos(metadata) and bos is not None else list(tokens)

"""Next-token (MTP) heads apart from their model: a sidecar GGUF that llama-server grafts onto a model converted
without them (``-md heads.gguf --spec-type draft-mtp``).

Published GGUFs of the families with next-token heads (qwen35moe, qwen3next, ...) are most often converted without
their MTP block, and some repositories ship the block as a file of its own. The pinned llama.cpp loads such a
file: a model of the same architecture and metadata (its ``block_count`` counts the block) that holds the token
embeddings, the output norm and head, and the block's tensors, but no layer of the trunk (``mtp_only`` in
``src/models/qwen35moe.cpp``); the block reads the trunk's last hidden state from the model's own context.

``heads_of(model, out)`` writes that file from a model that has its block (a twin made with ``n_mtp``, or a
GGUF converted with it); :func:`heads_mismatch` says why a file cannot draft for a model.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from gguf import GGUFReader, GGUFValueType, GGUFWriter
from pydantic import BaseModel, ConfigDict

from artifacts.synth.draft import copy_tensor, vocabulary_mismatch

_BLOCK = re.compile(r"^blk\.(\d+)\.")


class HeadsResult(BaseModel):
    """What :func:`heads_of` wrote."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    path: Path
    n_nextn_layers: int
    n_tensors: int
    file_bytes: int
    seconds: float


def _shape(path: Path) -> tuple[GGUFReader, str, int, int]:
    """(reader, architecture, block count, next-token block count) of ``path``.

    Raises:
        ValueError: not a readable GGUF, or no architecture or layer count.
    """
    try:
        reader = GGUFReader(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} is not a readable GGUF file ({exc})") from exc
    arch = str(reader.fields["general.architecture"].contents()) if "general.architecture" in reader.fields else ""
    if not arch or f"{arch}.block_count" not in reader.fields:
        raise ValueError(f"{path} names no architecture or layer count ({arch or '?'}.block_count)")
    nextn = reader.fields.get(f"{arch}.nextn_predict_layers")
    return reader, arch, int(reader.fields[f"{arch}.block_count"].contents()), int(nextn.contents()) if nextn else 0


def heads_of(model: Path, out: Path) -> HeadsResult:
    """Write ``model``'s next-token block alone (see the module's docstring): every metadata key, the token
    embeddings, output norm and head, and the tensors of its last ``nextn_predict_layers`` blocks.

    Raises:
        ValueError: ``model`` is not a GGUF model, or has no next-token block.
    """
    t0 = time.monotonic()
    reader, arch, total, nextn = _shape(model)
    if not nextn:
        raise ValueError(f"{model.name} has no next-token (MTP) block ({arch}.nextn_predict_layers): nothing to "
                         "write; a qwen35moe or qwen3next model converted with it has one")
    first = total - nextn
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(out, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.alignment"):
            continue
        vtype = field.types[0]
        value = f"{field.contents()}-heads" if name == "general.name" else field.contents()
        writer.add_key_value(name, value, vtype, sub_type=field.types[-1] if vtype == GGUFValueType.ARRAY else None)
    n = 0
    for tensor in reader.tensors:
        m = _BLOCK.match(tensor.name)
        if m and int(m.group(1)) < first:
            continue  # a layer of the trunk: the model it grafts onto has it
        copy_tensor(writer, tensor, tensor.name)
        n += 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return HeadsResult(path=out, n_nextn_layers=nextn, n_tensors=n, file_bytes=out.stat().st_size,
                       seconds=time.monotonic() - t0)


def heads_mismatch(model: Path, heads: Path) -> str | None:
    """Why ``heads`` cannot draft for ``model`` (one phrase), or None when it can: it must hold a next-token
    block for a model of the same architecture, width, layer count and vocabulary that has none of its own."""
    try:
        m_reader, m_arch, m_total, m_nextn = _shape(model)
        h_reader, h_arch, h_total, h_nextn = _shape(heads)
    except ValueError as exc:
        return str(exc)
    if m_nextn:
        return (f"the model has its own next-token block ({m_nextn} layer(s)): --speculation with llama-server "
                "measures it; --heads grafts a block onto a model converted without one")
    if not h_nextn or not any(t.name.startswith(f"blk.{h_total - 1}.nextn.") for t in h_reader.tensors):
        return f"it holds no next-token (MTP) block ({h_arch}.nextn_predict_layers, blk.N.nextn.*)"
    if h_arch != m_arch:
        return f"its architecture is {h_arch}, the model's {m_arch}"
    width = f"{m_arch}.embedding_length"
    if int(h_reader.fields[width].contents()) != int(m_reader.fields[width].contents()):
        return (f"its width ({width}) is {int(h_reader.fields[width].contents())}, the model's "
                f"{int(m_reader.fields[width].contents())}")
    if h_total - h_nextn != m_total:
        return f"it follows a trunk of {h_total - h_nextn} layers, the model has {m_total}"
    why = vocabulary_mismatch(model, heads)
    return None if why is None else why.replace("the draft", "the heads")

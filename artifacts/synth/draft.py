"""Draft twins: a smaller model that drafts tokens for a target twin (speculative decoding).

``draft_twin(target, out, n_layer)`` writes a GGUF of the target's own first ``n_layer`` layers with its token
embeddings, output norm and output head, and every metadata key of the target (its tokenizer and chat template
included, so the two share a vocabulary), with the layer count and per-layer arrays cut to ``n_layer``. The
tensors are the target's bytes, copied: a twin's layers are conditioned to add small updates to the residual
stream (docs/twins.md), so the draft's greedy tokens agree with the target's often enough to exercise
acceptance. How often is measured, not assumed (:func:`tasks.measurement.draft.agreement`; `flux synth --draft-of`
prints it).
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, ReaderTensor
from pydantic import BaseModel, ConfigDict

_BLOCK = re.compile(r"^blk\.(\d+)\.")
# keys GGUFWriter writes itself, or that describe the file rather than the model
_SKIP = {"general.architecture", "general.alignment"}


class DraftResult(BaseModel):
    """What :func:`draft_twin` wrote."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    path: Path
    target_layers: int
    n_layer: int
    n_tensors: int
    file_bytes: int
    seconds: float


def _tokens(path: Path) -> list[str]:
    reader = GGUFReader(path)
    field = reader.fields.get("tokenizer.ggml.tokens")
    return [str(t) for t in field.contents()] if field is not None else []


def vocabulary_mismatch(target: Path, draft: Path) -> str | None:
    """How ``draft``'s vocabulary differs from ``target``'s (its token list), or None when they are the same."""
    try:
        theirs, ours = _tokens(draft), _tokens(target)
    except (OSError, ValueError) as exc:
        return f"not a readable GGUF file ({exc})"
    if not theirs:
        return "it has no tokenizer (tokenizer.ggml.tokens)"
    if len(theirs) != len(ours):
        return f"its vocabulary has {len(theirs)} tokens, the model's {len(ours)}"
    diff = next((i for i, (a, b) in enumerate(zip(theirs, ours, strict=True)) if a != b), None)
    return None if diff is None else f"token {diff} is {theirs[diff]!r} in the draft, {ours[diff]!r} in the model"


def draft_twin(target: Path, out: Path, n_layer: int, last: int = 0) -> DraftResult:
    """Write the draft of ``target`` made of ``n_layer`` of its layers (see the module's docstring): its first
    ``n_layer - last`` and its last ``last`` (a layer-skipping draft: the layers between are left out, the last
    ones that shape the output kept), renumbered in order.

    Raises:
        ValueError: ``target`` is not a GGUF with layers, ``n_layer`` is not between 1 and its layer count - 1,
            or ``last`` is not between 0 and ``n_layer``.
    """
    t0 = time.monotonic()
    try:
        reader = GGUFReader(target)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{target} is not a readable GGUF file ({exc})") from exc
    arch = str(reader.fields["general.architecture"].contents()) if "general.architecture" in reader.fields else ""
    key = f"{arch}.block_count"
    if not arch or key not in reader.fields:
        raise ValueError(f"{target} names no architecture or layer count ({key}): not a model this can draft for")
    total = int(reader.fields[key].contents())
    if not 1 <= n_layer < total:
        raise ValueError(f"a draft of {target.name} takes 1 to {total - 1} of its {total} layers, not {n_layer}")
    if not 0 <= last <= n_layer:
        raise ValueError(f"a draft of {n_layer} layers keeps 0 to {n_layer} of the model's last layers, not {last}")
    keep = [*range(n_layer - last), *range(total - last, total)]  # the target's layers, in the draft's order
    renumber = {old: new for new, old in enumerate(keep)}
    interval = f"{arch}.full_attention_interval"
    if interval in reader.fields and n_layer < int(reader.fields[interval].contents()):
        every = int(reader.fields[interval].contents())
        raise ValueError(f"{target.name} has a full-attention layer every {every} layers: a draft needs at least "
                         f"{every} of them, not {n_layer}")
    if last and interval in reader.fields and last % int(reader.fields[interval].contents()):
        every = int(reader.fields[interval].contents())  # a layer's kind follows its index: keep whole periods
        raise ValueError(f"{target.name} has a full-attention layer every {every} layers: a draft keeps its last "
                         f"layers in whole periods of {every}, not {last}")
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(out, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in _SKIP:
            continue
        value = field.contents()
        vtype = field.types[0]
        if name == key:
            value = n_layer
        elif name == "general.name":
            value = f"{value}-draft{n_layer}"
        elif vtype == GGUFValueType.ARRAY and isinstance(value, list) and len(value) == total:
            value = [value[i] for i in keep]  # per-layer arrays (head counts, sliding windows ...)
        writer.add_key_value(name, value, vtype, sub_type=field.types[-1] if vtype == GGUFValueType.ARRAY else None)
    writer.add_uint32("flux.draft.layers", n_layer)
    writer.add_uint32("flux.draft.target_layers", total)
    if last:
        writer.add_uint32("flux.draft.last_layers", last)
    n = 0
    for tensor in reader.tensors:
        name = tensor.name
        m = _BLOCK.match(name)
        if m:
            if int(m.group(1)) not in renumber:
                continue
            name = f"blk.{renumber[int(m.group(1))]}.{name[m.end():]}"
        copy_tensor(writer, tensor, name)
        n += 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return DraftResult(path=out, target_layers=total, n_layer=n_layer, n_tensors=n, file_bytes=out.stat().st_size,
                       seconds=time.monotonic() - t0)


def copy_tensor(writer: GGUFWriter, tensor: ReaderTensor, name: str) -> None:
    """Add ``tensor``'s bytes to ``writer`` as ``name``, in its own type."""
    qtype = GGMLQuantizationType(int(tensor.tensor_type))
    data = np.asarray(tensor.data)  # float tensors in their numpy shape, quantized ones as rows of bytes
    if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        writer.add_tensor(name, data)
    else:
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)

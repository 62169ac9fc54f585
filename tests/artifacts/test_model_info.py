"""Reading models from their headers: tiny twins, split files, and every kind of bad file."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from artifacts.errors import ModelFileError
from artifacts.gguf_header import read_header
from artifacts.model_info import model_info, shard_paths, supported_architectures, tensor_role


def write_split(src: Path, out_dir: Path, n: int = 2) -> list[Path]:
    """Split a GGUF into n shards the way gguf-split does (split.* keys, tensors partitioned)."""
    h = read_header(src)
    raw = src.read_bytes()
    kv_raw = raw[24 : h.metadata_end]
    n_kv = len(h.metadata)
    chunks = [h.tensors[i::n] for i in range(n)]
    paths = []
    for i, tensors in enumerate(chunks):
        def kv(key: str, vtype: int, fmt: str, value: int) -> bytes:
            k = key.encode()
            return struct.pack("<Q", len(k)) + k + struct.pack("<I", vtype) + struct.pack(fmt, value)
        split_kv = kv("split.no", 2, "<H", i) + kv("split.count", 2, "<H", n) + kv("split.tensors.count", 5, "<i", len(h.tensors))
        body_kv = (kv_raw if i == 0 else b"") + split_kv
        count_kv = (n_kv if i == 0 else 0) + 3
        infos, data, off = b"", b"", 0
        for t in tensors:
            name = t.name.encode()
            infos += struct.pack("<Q", len(name)) + name + struct.pack("<I", len(t.shape))
            infos += struct.pack(f"<{len(t.shape)}Q", *t.shape)
            from gguf import GGMLQuantizationType
            infos += struct.pack("<IQ", GGMLQuantizationType[t.ggml_type].value, off)
            blob = raw[h.data_offset + t.offset : h.data_offset + t.offset + t.n_bytes]
            pad = (-len(blob)) % 32
            data += blob + b"\0" * pad
            off += len(blob) + pad
        head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), count_kv) + body_kv + infos
        head += b"\0" * ((-len(head)) % 32)
        p = out_dir / f"split-{i + 1:05d}-of-{n:05d}.gguf"
        p.write_bytes(head + data)
        paths.append(p)
    return paths


def test_tiny_moe_facts(tiny_moe: Path) -> None:
    info = model_info(tiny_moe)
    assert info.architecture == "qwen3moe" and info.supported
    assert info.n_expert > 0 and 0 < info.n_expert_used <= info.n_expert
    assert len(info.layers) == info.n_layer
    assert all(layer.expert_bytes > 0 for layer in info.layers)
    assert sum(info.bytes_by_role.values()) <= info.file_bytes
    assert info.bytes_by_role["experts_gate"] == info.bytes_by_role["experts_up"] == info.bytes_by_role["experts_down"]
    head = info.key_length + info.value_length
    assert info.kv_bytes_per_token["f16"] == info.n_layer * info.n_head_kv * head * 2


def test_tiny_dense_has_no_experts(tiny_dense: Path) -> None:
    info = model_info(tiny_dense)
    assert info.architecture == "llama" and info.n_expert == 0 and not info.is_moe
    assert info.bytes_by_role["dense_ffn"] > 0 and info.bytes_by_role["experts_gate"] == 0


def test_roles() -> None:
    assert tensor_role("blk.3.ffn_gate_exps.weight") == "experts_gate"
    assert tensor_role("blk.3.ffn_down_exps.weight") == "experts_down"
    assert tensor_role("blk.3.ffn_gate_inp.weight") == "router"
    assert tensor_role("blk.3.ffn_up_shexp.weight") == "shared_expert"
    assert tensor_role("blk.3.attn_q.weight") == "attention"
    assert tensor_role("blk.3.ffn_up.weight") == "dense_ffn"
    assert tensor_role("blk.3.attn_norm.weight") == "norm"
    assert tensor_role("token_embd.weight") == "embeddings"
    assert tensor_role("output.weight") == "output"


def test_architecture_list_is_the_pinned_one() -> None:
    archs = supported_architectures()
    assert {"llama", "qwen3moe", "qwen3", "gemma3", "deepseek2", "gpt-oss"} <= archs
    assert len(archs) > 100


def test_split_model_is_one_model(tiny_moe: Path, tmp_path: Path) -> None:
    shards = write_split(tiny_moe, tmp_path, 3)
    whole = model_info(tiny_moe)
    info = model_info(shards[1])
    assert len(info.shards) == 3
    assert info.n_params == whole.n_params and info.bytes_by_role == whole.bytes_by_role


def test_missing_shard(tiny_moe: Path, tmp_path: Path) -> None:
    shards = write_split(tiny_moe, tmp_path, 3)
    shards[2].unlink()
    with pytest.raises(ModelFileError, match="missing shard.*00003-of-00003"):
        shard_paths(shards[0])


def test_not_gguf(tmp_path: Path) -> None:
    p = tmp_path / "x.gguf"
    p.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    with pytest.raises(ModelFileError, match="not a GGUF"):
        model_info(p)


def test_truncated(tiny_moe: Path, tmp_path: Path) -> None:
    p = tmp_path / "t.gguf"
    p.write_bytes(tiny_moe.read_bytes()[: tiny_moe.stat().st_size // 2])
    with pytest.raises(ModelFileError, match="truncated"):
        model_info(p)
    p.write_bytes(tiny_moe.read_bytes()[:1000])
    with pytest.raises(ModelFileError, match="truncated"):
        model_info(p)


def test_unknown_version(tiny_moe: Path, tmp_path: Path) -> None:
    raw = bytearray(tiny_moe.read_bytes())
    raw[4:8] = struct.pack("<I", 7)
    p = tmp_path / "v7.gguf"
    p.write_bytes(bytes(raw))
    with pytest.raises(ModelFileError, match="version 7"):
        model_info(p)


def test_unreadable(tmp_path: Path) -> None:
    with pytest.raises(ModelFileError, match="no such file"):
        model_info(tmp_path / "absent.gguf")
    with pytest.raises(ModelFileError, match="directory"):
        model_info(tmp_path)


def test_unsupported_architecture_is_reported(tiny_dense: Path) -> None:
    info = model_info(tiny_dense, supported=frozenset({"qwen3moe"}))
    assert not info.supported

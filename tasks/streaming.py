"""Storage streaming: a mapped placement whose host weights do not fit in RAM beside its KV cache and compute
buffers leaves the rest on the drive, and every decoded token reads from the drive what the page cache could not
keep. Its decode limit is those bytes over the probe's drive bandwidth (O_DIRECT sequential reads).

The page cache is assumed to hold as much of the mapped weights as the RAM left to them, every page as likely as
another to be resident (a token reads each mapped byte with the same chance): the bytes a token reads from the
drive are then its host weight reads times the share of the weights beyond that RAM. Pages that the kernel's
read-ahead brings in unused, or that an LRU evicts just before their reuse, only lower the speed: the limit is an
upper bound, as a roofline is.
"""

from __future__ import annotations

from artifacts.model_info import ModelInfo
from artifacts.records.hardware import HardwareReport
from artifacts.records.plan import StorageStreaming
from artifacts.records.search import Candidate
from tasks.costmodel import all_on, layer_bytes


def drive_bytes_per_token(host_read: float, mapped: int, ram_for_weights: int) -> float:
    """Bytes a decoded token reads from the drive: of the ``host_read`` bytes it reads from ``mapped`` bytes of
    mapped weights, the share beyond ``ram_for_weights`` (what the page cache cannot hold)."""
    if mapped <= 0 or host_read <= 0:
        return 0.0
    beyond = min(mapped, max(0, mapped - ram_for_weights))
    return host_read * beyond / mapped


def streaming_limit(host_read: float, mapped: int, ram_for_weights: int, hw: HardwareReport) -> StorageStreaming:
    """The drive's share of a token's reads and the decode tokens/s it allows at the probe's drive bandwidth."""
    drive = drive_bytes_per_token(host_read, mapped, ram_for_weights)
    bandwidth = max(hw.storage_read_gbs, 1e-6) * 1e9
    return StorageStreaming(weights_bytes=mapped, ram_for_weights=max(0, ram_for_weights),
                            drive_bytes_per_token=drive, drive_gbs=hw.storage_read_gbs,
                            storage_method=hw.storage_method,
                            decode_limit_tps=bandwidth / drive if drive > 0 else None)


def candidate_streaming(info: ModelInfo, hw: HardwareReport, cand: Candidate, host_limit: int) -> StorageStreaming:
    """What ``cand`` reads from the drive per token under ``host_limit`` bytes of host memory: its mapped host
    weights, less the RAM its KV cache and compute buffers take there."""
    host_read = layer_bytes(info, cand.placement).get("CPU", (0.0, 0.0))[0]
    room = host_limit - cand.kv_bytes.get("CPU", 0) - cand.compute_bytes.get("CPU", 0)
    return streaming_limit(host_read, cand.weights_bytes.get("CPU", 0), room, hw)


def whole_model_streaming(info: ModelInfo, hw: HardwareReport, host_limit: int, kv_bytes: int) -> StorageStreaming:
    """The decode limit of the whole model mapped on the CPU under ``host_limit`` beside ``kv_bytes`` of KV cache:
    what a refusal reports."""
    host_read = layer_bytes(info, all_on(info, "CPU"))["CPU"][0]
    return streaming_limit(host_read, info.weight_bytes, host_limit - kv_bytes, hw)

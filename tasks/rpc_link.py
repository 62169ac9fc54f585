"""What llama.cpp RPC devices a probe report holds and what their links cost a step (for the cost model and the
placements of :mod:`tasks.remote`)."""

from __future__ import annotations

from artifacts.model_info import ModelInfo
from artifacts.records.hardware import HardwareReport, RpcServer
from artifacts.records.search import Candidate


def rpc_devices(hw: HardwareReport) -> list[tuple[str, RpcServer, int]]:
    """(llama.cpp device name, server, device index) of every RPC device, in llama.cpp's order."""
    out: list[tuple[str, RpcServer, int]] = []
    for server in hw.rpc_servers:
        for dev in server.devices:
            out.append((f"RPC{len(out)}", server, dev.index))
    return out


def link_ms(info: ModelInfo, hw: HardwareReport, cand: Candidate, n_tokens: int) -> float:
    """Milliseconds the links cost one llama_decode of ``n_tokens``: per remote run, a round trip to run it and
    its input activations sent; the head's logits (the last token's row at decode) read back."""
    servers = {f"RPC{i}": s for i, (_, s, _) in enumerate(rpc_devices(hw))}
    seq = [*cand.placement.layer_device, cand.placement.output_device]
    runs = [d for i, d in enumerate(seq) if d in servers and (i == 0 or seq[i - 1] != d)]
    total = 0.0
    act = float(n_tokens * info.n_embd * 4)
    for d in runs:
        link = servers[d].link
        if link is None:
            continue
        total += 2 * link.rtt_ms + act / (link.up_gbs * 1e9) * 1e3
    last = servers.get(cand.placement.output_device)
    if last is not None and last.link is not None:
        total += info.n_vocab * 4 / (last.link.down_gbs * 1e9) * 1e3
    return total

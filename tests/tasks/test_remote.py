"""Placements over llama.cpp RPC servers (tasks/remote.py): the tensor split llama.cpp reads gives every
offloaded position the placement's device; enumerate offers remote runs only with servers, keeps this machine's
part within --host-mem-budget and each server's part within its budget; the link is priced per step."""

from __future__ import annotations

from pathlib import Path

import pytest

from artifacts.model_info import model_info
from artifacts.records.hardware import RpcDevice, RpcLink, RpcServer
from artifacts.records.plan import PlanRequest
from artifacts.records.search import Placement
from tasks import layer_split
from tasks.costmodel import Workload, predict
from tasks.gpu_memory import compute_bytes
from tasks.remote import rpc_notes, tensor_split
from tasks.rpc_link import link_ms, rpc_devices
from tasks.search.space import enumerate_placements, kv_at
from tasks.testing import h200_report

GIB = 2**30
FAST = RpcLink(rtt_ms=0.05, up_small_ms=0.06, down_small_ms=0.05, up_gbs=1.0, down_gbs=1.0)
SLOW = RpcLink(rtt_ms=2.0, up_small_ms=3.5, down_small_ms=3.5, up_gbs=0.0125, down_gbs=0.0125)


def _server(port: int, link: RpcLink | None = FAST, gib: float = 8.0) -> RpcServer:
    return RpcServer(endpoint=f"127.0.0.1:{port}", build_id="b", protocol="7.0.0", link=link,
                     devices=[RpcDevice(index=0, memory_free=int(gib * GIB), memory_total=int(gib * GIB))])


@pytest.mark.parametrize("runs", [(3, 2), (1, 4), (5, 0), (0, 5), (2, 2, 1)])
def test_the_split_gives_each_offloaded_position_its_device(runs: tuple[int, ...]) -> None:
    devices = [f"RPC{i}" for i in range(len(runs))]
    seq = [d for d, n in zip(devices, runs, strict=True) for _ in range(n)]
    placement = Placement(layer_device=["CPU", "CPU", *seq[:-1]], output_device=seq[-1])
    split = tensor_split(placement, devices, n_local_gpus=1)
    assert len(split) == len(devices) + 1 and split[-1] == 0.0
    k = len(seq) - 1  # offloaded positions: k layers and the head, as llama.cpp counts them with -ngl k+1
    got = [devices[layer_split.llama_gpu(split[:-1], k, pos)] for pos in range(len(seq))]
    assert got == seq


def _hw(*servers: RpcServer):  # noqa: ANN202 - a HardwareReport
    return h200_report(n_gpus=0).model_copy(update={"rpc_servers": list(servers)})


def test_enumerate_adds_remote_runs_only_with_servers_and_within_budgets(tiny_moe: Path) -> None:
    info = model_info(tiny_moe)
    plain = enumerate_placements(info, _hw(), PlanRequest(model=str(tiny_moe), ctx=512), 10.0)
    assert not any(c.params.rpc_servers for c in plain.candidates)
    hw = _hw(_server(1), _server(2))
    # the smallest local compute buffer, the embeddings, the KV cache and half the weights: no local plan fits
    host = (compute_bytes(info, 128, 512, True) + info.bytes_by_role.get("embeddings", 0)
            + kv_at(info, 512) + info.weight_bytes // 2)
    req = PlanRequest(model=str(tiny_moe), ctx=512, rpc=["127.0.0.1:1", "127.0.0.1:2"], host_mem_budget_gib=host / GIB)
    space = enumerate_placements(info, hw, req, 10.0)
    remote = [c for c in space.candidates if c.params.rpc_servers]
    assert remote and all(c.params.rpc_servers == ("127.0.0.1:1", "127.0.0.1:2") for c in remote)
    assert not [c for c in space.candidates if not c.params.rpc_servers], "the host budget leaves no local plan"
    for c in remote:
        assert c.params.n_gpu_layers == sum(d != "CPU" for d in c.placement.layer_device) + 1
        assert c.placement.output_device.startswith("RPC")
        assert c.weights_bytes.get("CPU", 0) <= space.memory_limits["CPU"]
    assert {d for c in remote for d in c.placement.layer_device} >= {"RPC0", "RPC1"}
    tight = req.model_copy(update={"rpc_mem_budget_gib": [0.001, 0.001]})
    with pytest.raises(Exception, match="no placement fits"):
        enumerate_placements(info, hw, tight, 10.0)


def test_a_slow_link_is_priced_per_step_and_named_in_the_notes(tiny_moe: Path) -> None:
    info = model_info(tiny_moe)
    req = PlanRequest(model=str(tiny_moe), ctx=512, rpc=["127.0.0.1:1"])
    fast, slow = _hw(_server(1, FAST)), _hw(_server(1, SLOW))
    cand = next(c for c in enumerate_placements(info, fast, req, 10.0).candidates if c.params.rpc_servers)
    assert rpc_devices(fast)[0][0] == "RPC0"
    assert link_ms(info, slow, cand, 1) > 20 * link_ms(info, fast, cand, 1) > 0
    work = Workload(prefill_tokens=512, decode_tokens=64, mean_prompt_tokens=512)
    assert predict(info, slow, cand, work).decode_tps < predict(info, fast, cand, work).decode_tps
    assert "RPC servers:" in rpc_notes(fast, cand)[0] and "round trip 0.05 ms" in rpc_notes(fast, cand)[0]
    local = next(c for c in enumerate_placements(info, fast, req, 10.0).candidates if not c.params.rpc_servers)
    assert rpc_notes(slow, local)[0].startswith("RPC servers not used")

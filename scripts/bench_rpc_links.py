"""Plans across two llama.cpp RPC servers behind links of different speeds, on one machine (root; docs/rpc.md).

    sudo python3 scripts/bench_rpc_links.py TWIN OUT_DIR [--host-mem-budget GIB] [--budget-s 60]

Each server (`flux rpc-server`) runs in its own network namespace, joined to this one by a veth pair whose two
ends are shaped with a token-bucket filter (`tc qdisc ... tbf rate R`): unshaped (the servers on 127.0.0.1, no
namespace), 1 Gbit/s and 100 Mbit/s. For each link, `flux plan TWIN --rpc A,B --host-mem-budget H --replan`
(the product path: the Prefect flow, its probe of the links, its measurement; --reprobe: the link changed,
not the servers) makes a plan; the script reads
the plan back (`flux show --json`) and writes one row per link: the measured link, the layers the plan left on
this machine, its measured decode and prefill. Latency is not shaped: this kernel has no `sch_netem`.
Writes OUT_DIR/rpc-links.json and OUT_DIR/rpc-links.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from engine_bridge import rpc  # noqa: E402

LINKS = {"unshaped": None, "1gbit": "1gbit", "100mbit": "100mbit"}
PORT = 50052


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True)


def make_namespaces(rate: str) -> list[str]:
    """Two namespaces, each with a server address, their veth ends shaped to ``rate``; returns the addresses."""
    hosts = []
    for i in (1, 2):
        ns, here, there = f"fluxrpc{i}", f"fxr{i}a", f"fxr{i}b"
        sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", here, "type", "veth", "peer", "name", there)
        sh("ip", "link", "set", there, "netns", ns)
        sh("ip", "addr", "add", f"10.78.{i}.1/24", "dev", here)
        sh("ip", "link", "set", here, "up")
        sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"10.78.{i}.2/24", "dev", there)
        sh("ip", "netns", "exec", ns, "ip", "link", "set", there, "up")
        sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        for prefix, dev in (([], here), (["ip", "netns", "exec", ns], there)):
            sh(*prefix, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", "256kb",
               "latency", "50ms")
        hosts.append(f"10.78.{i}.2")
    return hosts


def drop_namespaces() -> None:
    for i in (1, 2):
        subprocess.run(["ip", "link", "del", f"fxr{i}a"], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "del", f"fluxrpc{i}"], capture_output=True, check=False)


def start_servers(hosts: list[str], namespaced: bool) -> list[subprocess.Popen[bytes]]:
    procs = []
    for i, host in enumerate(hosts, start=1):
        prefix = ["ip", "netns", "exec", f"fluxrpc{i}"] if namespaced else []
        port = PORT if namespaced else PORT + i
        procs.append(subprocess.Popen([*prefix, sys.executable, "-m", "flows", "rpc-server", "--host", host,
                                       "--port", str(port), "--threads", "1"], cwd=REPO,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    for host, i in zip(hosts, range(1, 3), strict=True):
        ep = f"{host}:{PORT if namespaced else PORT + i}"
        deadline = time.monotonic() + 30
        while not rpc.reachable(ep) and time.monotonic() < deadline:
            time.sleep(0.2)
    return procs


def flux(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "flows", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=1800, env={**os.environ, "PYTHONPATH": str(REPO)})


def one_link(name: str, rate: str | None, twin: Path, host_gib: float, budget_s: float) -> dict[str, object]:
    drop_namespaces()
    hosts = make_namespaces(rate) if rate else ["127.0.0.1", "127.0.0.1"]
    endpoints = [f"{h}:{PORT}" for h in hosts] if rate else [f"127.0.0.1:{PORT + i}" for i in (1, 2)]
    procs = start_servers(hosts, namespaced=rate is not None)
    try:
        t0 = time.monotonic()
        planned = flux("plan", str(twin), "--ctx", "512", "--budget-s", str(budget_s), "--rpc", ",".join(endpoints),
                       "--host-mem-budget", f"{host_gib:.6f}", "--replan", "--reprobe")
        if planned.returncode != 0:
            return {"link": name, "error": planned.stderr.strip().splitlines()[-1:]}
        plan_id = planned.stdout.strip().splitlines()[-1]
        plan = json.loads(flux("show", plan_id[:12], "--json").stdout)
    finally:
        for p in procs:
            p.terminate()
            p.wait(timeout=10)
        drop_namespaces()
    cand, m = plan["candidate"], plan["measured"]
    layers = cand["placement"]["layer_device"]
    return {"link": name, "rate": rate or "loopback", "plan": plan_id[:12], "planning_s": round(time.monotonic() - t0),
            "family": plan["families"].get(cand["id"], ""), "local_layers": layers.count("CPU"),
            "remote_layers": len(layers) - layers.count("CPU"), "decode_tps": m.get("decode_tps"),
            "prefill_tps": m.get("prefill_tps"), "notes": [n for n in plan["notes"] if "RPC" in n],
            "finalists": {plan["families"].get(s["candidate_id"], s["candidate_id"]): s.get("decode_tps")
                          for s in plan["finalists"]}}


def table(rows: list[dict[str, object]]) -> str:
    out = ["| link | plan | family | layers here / remote | decode tok/s | prefill tok/s | planning s |",
           "|---|---|---|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['link']} | failed: {r['error']} ||||||")
            continue
        out.append(f"| {r['link']} | {r['plan']} | {r['family']} | {r['local_layers']} / {r['remote_layers']} | "
                   f"{float(r['decode_tps'] or 0):.1f} | {float(r['prefill_tps'] or 0):.1f} | {r['planning_s']} |")
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("twin", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--host-mem-budget", type=float, required=True, help="GiB of this machine the plans may hold")
    ap.add_argument("--budget-s", type=float, default=60.0)
    ap.add_argument("--links", default=",".join(LINKS))
    ns = ap.parse_args()
    ns.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in ns.links.split(","):
        rows.append(one_link(name, LINKS[name], ns.twin.resolve(), ns.host_mem_budget, ns.budget_s))
        sys.stdout.write(json.dumps(rows[-1]) + "\n")
        sys.stdout.flush()
        (ns.out / "rpc-links.json").write_text(json.dumps(rows, indent=1))
        (ns.out / "rpc-links.md").write_text(table(rows))


if __name__ == "__main__":
    main()

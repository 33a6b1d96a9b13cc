"""The doctor's all-reduce bus bandwidth on loopback and across network namespaces (the veth path's cost).

How to run (as root for the namespaces; without root only the loopback figures are printed):
  .venv/bin/python benchmarks/doctor_network.py [--nodes 3] [--sizes-kib 4,64,1024,4096] [--iters 20]

The same three-node job (one rank per node, torchrun agents, etcd-v3 rendezvous, gloo) runs
``elastic_ddp.doctor`` first with every node on 127.0.0.1, then with every node and etcd in a
network namespace of its own on one bridge (chaos.netns), then once more in namespaces with
``--latency-ms`` added to what the last node receives from the others. It prints, per size, the
all-reduce time and busbw of each run side by side, then the pair and round-trip figures and the
doctor's findings of each run.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

from chaos.cluster import JobSpec, LocalCluster
from chaos.etcd import start_etcd
from chaos.netns import Fabric, unavailable
from chaos.scenario import ETCD_CONF, REPO

DOCTOR = str(REPO / "elastic_ddp" / "doctor.py")


def run_doctor(workdir: Path, nodes: int, doctor_args: list[str], fabric: Fabric | None, latency_ms: float) -> dict:
    with ExitStack() as stack:
        etcd = start_etcd("embedded", workdir / "etcd", stack, fabric=fabric)
        if fabric is not None:
            for index in range(nodes):
                fabric.add_host(f"n{index}")
            if latency_ms:
                fabric.latency(f"n{nodes - 1}", [f"n{index}" for index in range(nodes - 1)], latency_ms)
        report = workdir / "doctor.json"
        spec = JobSpec(script=DOCTOR, args=["--report", str(report), "--rdzv-endpoint", etcd.endpoint, *doctor_args],
                       nnodes=str(nodes), nproc_per_node=1, rdzv_backend="etcd-v3", rdzv_endpoint=etcd.endpoint,
                       rdzv_conf=dict(ETCD_CONF), run_id=f"doctor-bench-{workdir.name}", max_restarts=0, prefork=False)
        with LocalCluster(spec, workdir, fabric) as cluster:
            cluster.start(nodes)
            cluster.wait_all(timeout=300)
        return json.loads(report.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--sizes-kib", default="4,64,1024,4096")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--latency-ms", type=float, default=50.0)
    args = parser.parse_args()
    doctor_args = ["--sizes-kib", args.sizes_kib, "--iters", str(args.iters)]
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="doctor-bench-") as tmp:
        runs["loopback"] = run_doctor(Path(tmp) / "loopback", args.nodes, doctor_args, None, 0.0)
        why = unavailable()
        if why:
            print(f"namespaces skipped: {why}", file=sys.stderr)
        else:
            with Fabric() as fabric:
                runs["namespaces"] = run_doctor(Path(tmp) / "netns", args.nodes, doctor_args, fabric, 0.0)
            with Fabric() as fabric:
                runs[f"namespaces +{args.latency_ms:g} ms"] = run_doctor(Path(tmp) / "slow", args.nodes, doctor_args,
                                                                         fabric, args.latency_ms)
    names = list(runs)
    print(f"all-reduce, {args.nodes} ranks (1 per node), gloo, float32; time = the slowest rank's median of {args.iters}")
    print("| size (B) | " + " | ".join(f"{name}: time (us) | busbw (GB/s)" for name in names) + " |")
    print("|---|" + "---|---|" * len(names))
    rows = zip(*(runs[name]["measurements"]["allreduce"] for name in names))
    for cells in rows:
        figures = " | ".join(f"{cell['time_us']:.0f} | {cell['busbw_gbps']:.3f}" for cell in cells)
        print(f"| {cells[0]['bytes']} | {figures} |")
    for name in names:
        m = runs[name]["measurements"]
        pairs = ", ".join(f"node{row['nodes'][0]}-node{row['nodes'][1]} {row['busbw_gbps']:.3f} GB/s rtt {row['rtt_ms']:.2f} ms"
                          for row in m["pairs"])
        findings = "; ".join(f"{f['kind']}: {f['message']}" for f in runs[name]["findings"]) or "none"
        print(f"{name}: exit {runs[name]['exit_status']}; pairs: {pairs}; findings: {findings}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

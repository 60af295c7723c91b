"""Another machine's ranks of the local trainer: `python -m clawbridge_local.trainer.node`.

The proxy's trainer client (`clawbridge_local.trainer.client`, `Nodes.count > 1`) is node 0 and
writes the run it starts to `<work_dir>/current-run.json`; this command, on node K, waits for
that file, runs the same torchrun with `--node-rank K`, and, when the run ends (the proxy closed
or restarted its group), waits for the next run and joins it too (`--once`: just one).

Invariants:
- The work dir is the proxy's trainer work dir (`<state_dir>/trainer/local`), on a filesystem
  this node mounts at the same path: the ranks read requests and batches from it.
- A run is joined at most once; this command never writes into a run dir itself (its ranks do,
  through the worker protocol).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from clawbridge_local.trainer.client import RUN_FILE, Nodes, torchrun_command, worker_env


def read_run(work_dir: Path) -> dict[str, Any] | None:
    """The run node 0 announced, or None when there is none (yet)."""
    try:
        run: dict[str, Any] = json.loads((work_dir / RUN_FILE).read_text())
    except (OSError, ValueError):
        return None
    return run


def join(run: dict[str, Any], node_rank: int, python: str = sys.executable) -> int:
    """Run this node's torchrun for `run` until it exits; its exit code."""
    nodes = Nodes(int(run["nnodes"]), str(run["master_addr"]), int(run["master_port"]))
    if not 0 < node_rank < nodes.count:
        raise SystemExit(f"--node-rank must be 1..{nodes.count - 1} for this run of {nodes.count} nodes")
    nproc = int(run["nproc_per_node"])
    cmd = torchrun_command(python, nproc, nodes, node_rank, Path(run["run_dir"]), 0)
    return subprocess.call(cmd, env=worker_env(nproc))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work-dir", type=Path, required=True,
                    help="the proxy's trainer work dir (<state_dir>/trainer/local), shared by every node")
    ap.add_argument("--node-rank", type=int, required=True, help="this machine's node rank (1 .. nodes-1)")
    ap.add_argument("--once", action="store_true", help="join one run, then exit")
    ap.add_argument("--wait-s", type=float, default=0.0,
                    help="give up after this long without a new run to join (0: wait forever)")
    ns = ap.parse_args(argv)
    joined: set[str] = set()
    waited_since = time.monotonic()
    while True:
        run = read_run(ns.work_dir)
        if run is None or run["run_dir"] in joined:
            if ns.wait_s and time.monotonic() - waited_since > ns.wait_s:
                print(f"no new run in {ns.work_dir / RUN_FILE} within {ns.wait_s:g}s", file=sys.stderr)
                return 1
            time.sleep(0.2)
            continue
        joined.add(run["run_dir"])
        print(f"node {ns.node_rank}: joining {run['run_dir']} ({run['nnodes']} nodes x "
              f"{run['nproc_per_node']} ranks, master {run['master_addr']}:{run['master_port']})", flush=True)
        code = join(run, ns.node_rank)
        print(f"node {ns.node_rank}: run {run['run_dir']} ended (torchrun exit {code})", flush=True)
        if ns.once:
            return code
        waited_since = time.monotonic()


if __name__ == "__main__":
    sys.exit(main())

"""The GPU validation kit: one table of what the local backend does on this machine's accelerator.

`bash bench/gpu/run.sh [--out DIR] [options]` installs the wheel folder (offline) and runs this;
docs/gpu-kit.md says what each row means. The parts (`kit_parts.PARTS`, in order: quickest
evidence first; measured in kit_serving.py and kit_training.py) run one after the other, each in
its own process under its own time
budget, inside the kit's whole `--deadline`:

- after every part the table so far is printed (stdout) and written to the output folder
  (`gpu-kit.md`, `gpu-kit.json`; each part's log in `logs/`), so a run cut short keeps what it
  measured; each part's wall time is a column;
- a part that breaks gives `failed: <error>` rows (its traceback in its log) and the kit goes on;
  one that overruns its budget is killed, keeps the rows it had finished, and gets a `cut after`
  row; one that cannot start in the time left gets `skipped: out of time`; one that cannot run
  here (no sglang, one GPU) a `skipped: <reason>` row without starting a process.

`--quick` shrinks every size (2-layer scaled shapes, a few steps and sessions) so the whole table
runs on a CPU in minutes: the kit's test (tests/test_gpu_kit.py) runs it that way.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from kit_parts import PARTS, Kit, Row  # noqa: E402

ROW_PREFIX = "@row "
"""How a part's process hands a row to the kit (one JSON object per line on its stdout)."""
DEADLINE_S = 420.0
"""The whole kit's default time (full sizes): about 7 minutes, the install not counted."""
MIN_START_S = 20.0
"""A part does not start with less time than this left."""


# ------------------------------------------------------------------------------------------ one part


def part_main(args: argparse.Namespace) -> int:
    """`--part NAME`: run one part in this process, each row to stdout as soon as it is measured."""
    rows_out = sys.stdout
    sys.stdout = sys.stderr  # the bench scripts' own prints go to the part's log

    def emit(row: Row) -> None:  # under the part's name (train_rows serves train-0.6b, train-1.7b and fsdp-N)
        print(ROW_PREFIX + json.dumps(asdict(replace(row, part=args.part))), file=rows_out, flush=True)

    kit = Kit(args.device, args.quick, args.work, args.peak_tflops)
    try:
        if args.inject_failure == args.part:
            raise RuntimeError("failure injected by --inject-failure (the kit's own test)")
        for row in PARTS[args.part].rows(kit):
            emit(row)
        if args.inject_hang == args.part:  # the kit's test: an overrun after some rows, on any machine's speed
            threading.Event().wait()
    except Exception as exc:  # the kit goes on: this part's error becomes its row
        import traceback

        traceback.print_exc()
        emit(Row(args.part, "", f"failed: {type(exc).__name__}: {str(exc)[:200]}"))
        return 1
    return 0


def run_part(name: str, budget: float, args: argparse.Namespace, logs: Path) -> tuple[list[Row], str]:
    """Run part `name` in a child process for at most `budget` seconds; its rows and how it ended."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--part", name, "--device", args.device,
           "--work", str(args.work)]
    cmd += ["--quick"] if args.quick else []
    cmd += ["--peak-tflops", str(args.peak_tflops)] if args.peak_tflops else []
    cmd += ["--inject-failure", args.inject_failure] if args.inject_failure else []
    cmd += ["--inject-hang", args.inject_hang] if args.inject_hang else []
    rows: list[Row] = []
    log_path = logs / f"{name}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)

        def read() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                if line.startswith(ROW_PREFIX):
                    rows.append(Row(**json.loads(line[len(ROW_PREFIX):])))
                    print(f"[kit] {name}: {rows[-1].what}: {rows[-1].figure}", file=sys.stderr, flush=True)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            code = proc.wait(timeout=budget)
            ended = "ok" if code == 0 else f"exit {code}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            ended = "cut"
        reader.join(timeout=10)
    if ended == "cut":
        rows.append(Row(name, "", f"cut after {budget:.0f}s (its time budget); the rows above are what it finished",
                        f"log: logs/{log_path.name}"))
    elif ended != "ok" and not any(r.figure.startswith("failed:") for r in rows):
        tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] or ["(empty log)"]
        rows.append(Row(name, "", f"failed: {ended}: {tail[0][:200]}", f"log: logs/{log_path.name}"))
    return rows, ended


# ------------------------------------------------------------------------------------------ the table


def render(rows: list[Row], seconds: dict[str, float], header: str) -> str:
    """The table as text: one line per row, the part's wall time on its first row."""
    cols = ("part", "what", "figure", "baseline (same run)", "part s")
    cells = [cols]
    seen: set[str] = set()
    for r in rows:
        wall = f"{seconds[r.part]:.0f}" if r.part in seconds and r.part not in seen else ""
        seen.add(r.part)
        cells.append((r.part, r.what, r.figure, r.baseline, wall))
    widths = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    lines = [header, " | ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)),
             "-+-".join("-" * w for w in widths)]
    lines += [" | ".join(c.ljust(w) for c, w in zip(cell, widths, strict=True)) for cell in cells[1:]]
    return "\n".join(lines)


def markdown(rows: list[Row], seconds: dict[str, float], header: str) -> str:
    """The same table in Markdown (for the README)."""
    out = [header, "", "| part | what | figure | baseline (same run) | part s |", "|---|---|---|---|---|"]
    seen: set[str] = set()
    for r in rows:
        wall = f"{seconds[r.part]:.0f}" if r.part in seconds and r.part not in seen else ""
        seen.add(r.part)
        out.append("| " + " | ".join(c.replace("|", "/") for c in (r.part, r.what, r.figure, r.baseline, wall)) + " |")
    return "\n".join(out) + "\n"


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def publish(out: Path, rows: list[Row], seconds: dict[str, float], header: str, status: dict[str, Any]) -> None:
    """Print the table so far and write it to `out` (gpu-kit.md, gpu-kit.json)."""
    print(f"\n=== {status['state']} ===\n" + render(rows, seconds, header), flush=True)
    write_atomic(out / "gpu-kit.md", markdown(rows, seconds, header))
    write_atomic(out / "gpu-kit.json", json.dumps({"header": header, "status": status, "seconds": seconds,
                                                   "rows": [asdict(r) for r in rows]}, indent=1))


def describe_machine(device: str) -> str:
    """The GPU's name from nvidia-smi (torch would create a CUDA context here, and hold its memory
    for the whole run), or the CPU count."""
    if not device.startswith("cuda"):
        return f"cpu x{os.cpu_count()}"
    index = device.partition(":")[2] or "0"
    try:
        out = subprocess.run(["nvidia-smi", f"--id={index}", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        return out.stdout.strip() or "cuda (nvidia-smi gave no name)"
    except (OSError, subprocess.TimeoutExpired):
        return "cuda (no nvidia-smi)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: the whole table in minutes on a CPU")
    ap.add_argument("--peak-tflops", type=float, default=None, help="the GPU's dense bf16 peak, for MFU")
    ap.add_argument("--work", type=Path, default=None, help="folder for models and state (default: a temp dir)")
    ap.add_argument("--out", type=Path, default=None,
                    help="folder for the table and the logs (default: $OUT if set, else ./gpu-kit-out)")
    ap.add_argument("--deadline", type=float, default=None,
                    help=f"seconds for all parts (default {DEADLINE_S:.0f}; 1800 with --quick)")
    ap.add_argument("--parts", default=",".join(PARTS), help="which parts, comma-separated (default: all)")
    ap.add_argument("--budget", action="append", default=[], metavar="PART=SECONDS", help="a part's time budget")
    ap.add_argument("--part", choices=sorted(PARTS), help=argparse.SUPPRESS)  # one part, in this process
    ap.add_argument("--inject-failure", default=None, metavar="PART", help=argparse.SUPPRESS)  # the kit's test
    ap.add_argument("--inject-hang", default=None, metavar="PART", help=argparse.SUPPRESS)  # the kit's test
    args = ap.parse_args(argv)
    if args.part:
        return part_main(args)
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"no CUDA device visible to torch {torch.__version__}; rerun with --device cpu", file=sys.stderr)
        return 2
    chosen = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in chosen if p not in PARTS]
    if unknown:
        ap.error(f"unknown parts {unknown}; the parts are {', '.join(PARTS)}")
    budgets = {}
    for item in args.budget:
        name, _, secs = item.partition("=")
        budgets[name] = float(secs)
    out = args.out or Path(os.environ.get("OUT") or "gpu-kit-out")
    (out / "logs").mkdir(parents=True, exist_ok=True)
    deadline = args.deadline or (1800.0 if args.quick else DEADLINE_S)
    own_work = args.work is None
    args.work = args.work or Path(tempfile.mkdtemp(prefix="clawbridge-gpukit-"))
    args.work.mkdir(parents=True, exist_ok=True)
    header = (f"clawbridge GPU kit: {describe_machine(args.device)}, torch {torch.__version__}, device "
              f"{args.device}, {'quick (scaled shapes)' if args.quick else 'full sizes'}")
    kit = Kit(args.device, args.quick, args.work, args.peak_tflops)
    rows: list[Row] = []
    seconds: dict[str, float] = {}
    t_start = time.monotonic()
    try:
        for i, name in enumerate(chosen):
            part = PARTS[name]
            t0 = time.monotonic()
            left = deadline - (t0 - t_start)
            why = part.precheck(kit)
            if why:
                rows.append(Row(name, "", f"skipped: {why}"))
            elif left < min(MIN_START_S, deadline / 10):
                rows.append(Row(name, "", f"skipped: out of time ({left:.0f}s of the kit's {deadline:.0f}s left)"))
            else:
                budget = min(budgets.get(name, part.quick_budget_s if args.quick else part.budget_s), left)
                print(f"[kit] {name}: starting, budget {budget:.0f}s ({left:.0f}s left)", file=sys.stderr, flush=True)
                got, ended = run_part(name, budget, args, out / "logs")
                rows += got
                print(f"[kit] {name}: {ended} in {time.monotonic() - t0:.0f}s", file=sys.stderr, flush=True)
            seconds[name] = time.monotonic() - t0
            state = f"after {name} ({i + 1}/{len(chosen)}), {time.monotonic() - t_start:.0f}s"
            publish(out, rows, seconds, header, {"state": state, "done": chosen[:i + 1]})
    finally:
        if own_work:
            shutil.rmtree(args.work, ignore_errors=True)
    publish(out, rows, seconds, header, {"state": f"final, {time.monotonic() - t_start:.0f}s", "done": chosen})
    print(f"[kit] table written to {out / 'gpu-kit.md'} and {out / 'gpu-kit.json'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

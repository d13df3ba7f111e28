"""Every GPU result in one command (`make gpu-check`): the `gpu` tests, then every GPU benchmark, each piece in its
own processes under a 10-minute limit, and their tables written into docs/gpu-results.md with the device, driver,
torch version and date. Without CUDA it runs nothing, writes nothing, and exits 2 with one line.

    .venv/bin/python bench/gpu_all.py                       # everything, into docs/gpu-results.md
    .venv/bin/python bench/gpu_all.py --only tests,tiering  # some pieces
    .venv/bin/python bench/gpu_all.py --list                # the pieces and their commands

Pieces (`--only` names): tests (pytest -m gpu), offload-compare and offload-capacity (bench/gpu_offload.py: plain,
ZeRO-Offload-style, FSDP2 CPUOffloadPolicy, hetero; the largest model under the cap), tiering (bench/tiering.py:
against save_on_cpu), peak-memory (profile, plan, traced run and `hetero report` of examples/train_gpt.py on the
GPU: predicted against measured peak GPU memory). A piece that fails or runs out of time is recorded as such, with
its output, and the others still run. The results go between two markers in the file, replacing the last ones.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LIMIT_S = 590  # per piece: under the 10 minutes a device call may take
BEGIN, END = "<!-- gpu-check: begin -->", "<!-- gpu-check: end -->"
NO_CUDA = "gpu-check: no CUDA device here (torch.cuda.is_available() is False); nothing was run or written"


@dataclass(frozen=True)
class Piece:
    name: str
    title: str
    commands: tuple[tuple[str, ...], ...]  # run in order, in the repository root, sharing the piece's limit
    limit_s: float = LIMIT_S


@dataclass(frozen=True)
class Outcome:
    piece: Piece
    status: str  # ok | failed (exit N) | timed out
    seconds: float
    output: str


def pieces(python: str, work: Path) -> list[Piece]:
    """The pieces, in the order they run; `work` holds the files the peak-memory piece makes."""
    hetero = (python, "-m", "hetero")
    gpt = ("examples/train_gpt.py", "--device", "cuda", "--n-layer", "8", "--n-embd", "512", "--n-head", "8",
           "--batch-size", "8", "--seq-len", "256")
    profile, plan, trace = str(work / "profile.yaml"), str(work / "plan.yaml"), str(work / "run.json")
    return [
        Piece("tests", "GPU tests (pytest -m gpu)", ((python, "-m", "pytest", "-q", "-m", "gpu", "-rs"),)),
        Piece("offload-compare", "Step time and peak GPU memory at one model size: plain, ZeRO-Offload-style, "
              "FSDP2 CPUOffloadPolicy, hetero", ((python, "bench/gpu_offload.py", "--only", "compare",
                                                  "--timeout", "150"),)),
        Piece("offload-capacity", "The largest model each method trains under the GPU memory cap",
              ((python, "bench/gpu_offload.py", "--only", "capacity", "--timeout", "120", "--max-layers", "96"),)),
        Piece("tiering", "Activation tiering against save_on_cpu(pin_memory=True)",
              ((python, "bench/tiering.py", "--rounds", "2", "--", *gpt, "--steps", "5"),)),
        Piece("peak-memory", "Predicted against measured peak GPU memory (hetero report of a traced run)",
              ((*hetero, "profile", "-o", profile, *gpt),
               (*hetero, "plan", "--profile", profile, "-o", plan),
               (*hetero, "run", "--plan", plan, "--trace", trace, *gpt, "--steps", "12"),
               (*hetero, "report", str(work / "run.yaml"), "--plan", plan))),
    ]


def run_piece(piece: Piece, cwd: Path = REPO) -> Outcome:
    """Run a piece's commands in order within its limit; the first failure ends it."""
    start, output = time.monotonic(), []
    status = "ok"
    for command in piece.commands:
        left = piece.limit_s - (time.monotonic() - start)
        output.append("$ " + shown(command))
        try:
            done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=max(left, 1))
        except subprocess.TimeoutExpired as e:
            output.append(_text(e.stdout) + _text(e.stderr))
            status = f"timed out after {piece.limit_s:.0f} s"
            break
        output.append(done.stdout + done.stderr)
        if done.returncode != 0:
            status = f"failed (exit {done.returncode})"
            break
    return Outcome(piece, status, time.monotonic() - start, "\n".join(output).rstrip())


def shown(command: tuple[str, ...]) -> str:
    return " ".join(("python" if a == sys.executable else a) for a in command)


def _text(data: bytes | str | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


def environment() -> dict[str, str]:
    """What the results were measured on."""
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "none (no CUDA device)"
    return {"device": device, "driver": _driver(), "torch": torch.__version__,
            "CUDA (torch's)": str(torch.version.cuda), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def _driver() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown (nvidia-smi not found)"
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "unknown"


def section(env: dict[str, str], outcomes: list[Outcome]) -> str:
    """The Markdown written into the results file: the environment, then each piece's status and output."""
    lines = [BEGIN, f"## make gpu-check, {env['date']}", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in env.items()]
    for o in outcomes:
        lines += ["", f"### {o.piece.title}", "", f"`{o.piece.name}`: {o.status}, {o.seconds:.0f} s", "", "```",
                  o.output.replace("```", "'''"), "```"]
    return "\n".join(lines + [END]) + "\n"


def write(path: Path, text: str) -> None:
    """Put `text` between the markers in `path`, replacing an earlier section, or append it."""
    old = path.read_text() if path.exists() else "# GPU results\n"
    if BEGIN in old and END in old:
        before, rest = old.split(BEGIN, 1)
        new = before + text.rstrip("\n") + rest.split(END, 1)[1]
    else:
        new = old.rstrip("\n") + "\n\n" + text
    path.write_text(new)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default=None, help="comma-separated piece names")
    p.add_argument("--list", action="store_true", help="print the pieces and their commands, run nothing")
    p.add_argument("--out", type=Path, default=REPO / "docs" / "gpu-results.md")
    a = p.parse_args(argv)
    work = Path(tempfile.gettempdir()) / f"hetero-gpu-check-{os.getpid()}"  # made only when something runs
    chosen = pieces(sys.executable, work)
    if a.only:
        names = a.only.split(",")
        unknown = [n for n in names if n not in {x.name for x in chosen}]
        if unknown:
            p.error(f"unknown piece(s) {', '.join(unknown)}; pieces: {', '.join(x.name for x in chosen)}")
        chosen = [x for x in chosen if x.name in names]
    if a.list:
        for x in chosen:
            print(f"{x.name}: " + " && ".join(shown(c) for c in x.commands))
        return 0
    import torch

    if not torch.cuda.is_available():
        print(NO_CUDA, file=sys.stderr)
        return 2
    work.mkdir(parents=True, exist_ok=True)
    env, outcomes = environment(), []
    for x in chosen:
        print(f"gpu-check: {x.name} ...", flush=True)
        outcomes.append(run_piece(x))
        print(f"gpu-check: {x.name}: {outcomes[-1].status} ({outcomes[-1].seconds:.0f} s)", flush=True)
        write(a.out, section(env, outcomes))  # after each piece: what ran is kept if a later one hangs the machine
    return 0 if all(o.status == "ok" for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())

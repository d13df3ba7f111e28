"""Every GPU result in one command (`make gpu-check`), sized for a rented GPU: within 8 minutes on one H100, each
piece under its own limit in its own processes. Pieces: the `gpu` tests, the whole CPU suite on the GPU machine
(CUDA present, so nothing of it may start CUDA), a model that fits (examples/train_gpt.py: plain against the default
plan, which must be plain), a held-out LM end to end (bench/heldout_lm.py: plain, the default plan, and a plan for
half of plain's reserved GPU peak run under that budget), and training beyond a GPU budget beside ZeRO-Offload-style
and FSDP2 CPU offload (bench/gpu_offload.py). Everything each piece made (logs, profiles, plans, JUnit files) is
kept in one folder (--artifacts; default $OUT where set), with the results section and the names of failing tests.
Without CUDA, or with a Python that has no torch, it runs nothing, writes nothing, and exits 2 with one line (and,
for the latter, its hint).

    python bench/gpu_all.py                       # everything, into docs/gpu-results.md and --artifacts
    python bench/gpu_all.py --only tests,fits     # some pieces
    python bench/gpu_all.py --list                # the pieces and their commands

A piece that fails or runs out of time is recorded as such, with its output, and the others still run. The results
go between two markers in docs/gpu-results.md (and into the artifacts folder), replacing the last ones.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- gpu-check: begin -->", "<!-- gpu-check: end -->"
NO_CUDA = "gpu-check: no CUDA device here (torch.cuda.is_available() is False); nothing was run or written"
TOTAL_S = 510  # the whole check: 8.5 minutes on one H100

@dataclass(frozen=True)
class Piece:
    name: str
    title: str
    commands: tuple[tuple[str, ...], ...]  # run in order, in the repository root, sharing the piece's limit
    limit_s: float = 60.0
    env: tuple[tuple[str, str], ...] = ()  # set for its commands


@dataclass(frozen=True)
class Outcome:
    piece: Piece
    status: str  # ok | failed (exit N) | timed out
    seconds: float
    output: str


def pieces(python: str, work: Path) -> list[Piece]:
    """The pieces, in the order they run, their limits summing to TOTAL_S; `work` holds what they make."""
    gpt = ("examples/train_gpt.py", "--device", "cuda", "--n-layer", "8", "--n-embd", "512", "--n-head", "8",
           "--batch-size", "8", "--seq-len", "256", "--steps", "30", "--log-every", "15", "--weight-sum")
    # 120M parameters with the head tied to the token embedding; no evaluation pass: the runs compare training
    heldout = ("bench/heldout_lm.py", "--device", "cuda", "--tied", "--width", "1024", "--blocks", "8", "--heads",
               "16", "--vocab", "16384", "--batch", "8", "--context", "512", "--steps", "30", "--log-every", "15",
               "--eval-batches", "0", "--weight-sum")
    # -vv (the project's addopts say -q): each test's outcome as it ends, so a suite cut at its limit still names
    # what failed; 60 s a test, so one that hangs cannot eat the piece
    suite = (python, "-m", "pytest", "-vv", "-rfE", "--tb=short", "-o", "timeout=60", "-p", "no:cacheprovider",
             "-m", "not gpu",
             f"--junitxml={work / 'suite.xml'}", *(("-n", "14") if importlib.util.find_spec("xdist") else ()))
    return [
        Piece("tests", "GPU tests (pytest -m gpu)",
              ((python, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", "-m", "gpu",
                f"--junitxml={work / 'gpu-tests.xml'}"),), limit_s=60),  # 24 tests: 45 s on an H100 was short
        Piece("suite", "The whole CPU suite on the GPU machine (CUDA present)", (suite,), limit_s=170,
              env=(("OMP_NUM_THREADS", "1"),)),  # 14 workers of torch's 16 threads each would only thrash
        Piece("fits", "A model that fits: plain against the default plan (examples/train_gpt.py, 27M parameters)",
              ((python, "bench/gpu_e2e.py", "--out", str(work / "fits"), "--timeout", "45", "--", *gpt),),
              limit_s=85),  # a profile and four runs of 12-16 s each, CUDA's start included
        Piece("heldout", "A held-out LM end to end: plain, the default plan, and half of plain's reserved GPU peak",
              ((python, "bench/gpu_e2e.py", "--out", str(work / "heldout"), "--half", "--rounds", "1", "--timeout",
                "50", "--", *heldout),), limit_s=90),
        Piece("offload", "Beyond a GPU budget: plain, ZeRO-Offload-style, FSDP2 CPUOffloadPolicy, hetero",
              ((python, "bench/gpu_offload.py", "--only", "compare", "--n-layer", "14", "--steps", "6",
                "--timeout", "70", "--keep", str(work / "offload")),), limit_s=100),
    ]


def run_piece(piece: Piece, cwd: Path = REPO) -> Outcome:
    """Run a piece's commands in order within its limit; the first failure ends it."""
    start, output = time.monotonic(), []
    status = "ok"
    for command in piece.commands:
        left = piece.limit_s - (time.monotonic() - start)
        output.append("$ " + shown(command))
        try:
            done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=max(left, 1),
                                  env=os.environ | {"PYTHONPATH": str(REPO)} | dict(piece.env))  # no install needed
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


def failing(output: str) -> list[str]:
    """The tests pytest's short summary names as failed or in error (`-rfE`)."""
    return list(dict.fromkeys(re.findall(r"^(?:\[gw\d+\] \[ *\d+%\] )?(?:FAILED|ERROR) (\S+::\S+)", output,
                                         flags=re.M)))


def section(env: dict[str, str], outcomes: list[Outcome], tail: int = 60) -> str:
    """The Markdown written into the results file: the environment, then each piece's status, the tests it failed
    and the last `tail` lines of its output (the whole output is in the artifacts)."""
    lines = [BEGIN, f"## make gpu-check, {env['date']}", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in env.items()]
    for o in outcomes:
        failed = failing(o.output)
        shown_lines = o.output.splitlines()[-tail:]
        lines += ["", f"### {o.piece.title}", "", f"`{o.piece.name}`: {o.status}, {o.seconds:.0f} s", ""]
        lines += [f"Failing tests ({len(failed)}): " + ", ".join(f"`{t}`" for t in failed), ""] if failed else []
        lines += ["```", "\n".join(shown_lines).replace("```", "'''"), "```"]
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
    p.add_argument("--artifacts", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None,
                   help="folder for everything the pieces make [default: $OUT, else a temporary folder]")
    a = p.parse_args(argv)
    artifacts = a.artifacts or Path(tempfile.gettempdir()) / f"hetero-gpu-check-{os.getpid()}"
    # made only when something runs; outside the artifacts folder, which gets its archive (a device call brings back
    # a few files, not a tree)
    work = Path(tempfile.gettempdir()) / f"hetero-gpu-check-work-{os.getpid()}"
    chosen = pieces(sys.executable, work)
    if a.only:
        names = a.only.split(",")
        unknown = [n for n in names if n not in {x.name for x in chosen}]
        if unknown:
            p.error(f"unknown piece(s) {', '.join(unknown)}; pieces: {', '.join(x.name for x in chosen)}")
        chosen = [x for x in chosen if x.name in names]
    if a.list:
        for x in chosen:
            print(f"{x.name} (up to {x.limit_s:.0f} s): " + " && ".join(shown(c) for c in x.commands))
        return 0
    try:
        import torch
    except ImportError as e:  # `make gpu-check` runs the machine's python3, which may not be the one with torch
        print(f"error: gpu-check: {sys.executable} cannot import torch ({e}); nothing was run or written\n"
              "hint: run it with a Python that has torch and CUDA, e.g. make gpu-check PYTHON=.venv/bin/python",
              file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print(NO_CUDA, file=sys.stderr)
        return 2
    shutil.rmtree(work, ignore_errors=True)  # a rented machine may keep /tmp: never archive an earlier call's files
    work.mkdir(parents=True)
    artifacts.mkdir(parents=True, exist_ok=True)
    env, outcomes = environment(), []
    for x in chosen:
        print(f"gpu-check: {x.name} (up to {x.limit_s:.0f} s) ...", flush=True)
        outcomes.append(run_piece(x))
        o = outcomes[-1]
        (work / f"{x.name}.log").write_text(o.output)
        print(f"gpu-check: {x.name}: {o.status} ({o.seconds:.0f} s)"
              + "".join(f"\n  failed: {t}" for t in failing(o.output)), flush=True)
        text = section(env, outcomes)
        # after each piece: what ran is kept if a later one hangs the machine or the call is cut
        write(a.out, text)
        (artifacts / "gpu-results-section.md").write_text(text)
        shutil.make_archive(str(artifacts / "gpu-check-work"), "gztar", work)
    print(f"gpu-check: artifacts in {artifacts} (gpu-results-section.md, gpu-check-work.tar.gz)")
    return 0 if all(o.status == "ok" for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())

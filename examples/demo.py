"""`make demo`: profile, plan and run examples/train_gpt.py under hetero, next to a plain PyTorch run, then report
what ran against what the plan predicted (the trace opens in https://ui.perfetto.dev).

Two plans: the default one (on a machine without a GPU it runs plain training: nothing hetero does there saves
memory the process pays for), and one with every CPU mechanism forced (`--emulate axdimm --tier-activations`: the
emulated AXDIMM and activation tiering), which is traced, reported and timed.

Every step is the real command a user types. The closing table compares step times from interleaved pairs of
untraced runs (plain, hetero, plain, ...: load on a shared machine hits both alike), as medians with their range.
"""

import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "build" / "demo"
SCRIPT = ["examples/train_gpt.py", "--steps", "30", "--log-every", "10"]
HETERO = [sys.executable, "-m", "hetero"]
PAIRS = 3  # interleaved plain/hetero runs behind the step-time comparison
TIMED = ["examples/train_gpt.py", "--steps", "12", "--log-every", "12"]
# libgomp's spin-waiting makes a plain 2-thread run collapse under load while hetero's extra threads change its
# spin policy (docs/benchmarks.md): time both with the same, short spin
TIMING_ENV = {"GOMP_SPINCOUNT": "1000"}
console = Console()


def sh(title: str, argv: list[str], quiet: bool = False, env: dict | None = None) -> subprocess.CompletedProcess:
    console.print(f"[bold]$ {' '.join(Path(a).name if a == sys.executable else a for a in argv)}[/bold]  # {title}")
    start = time.perf_counter()
    result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, env=os.environ | (env or {}))
    if not quiet or result.returncode != 0:
        sys.stdout.write(result.stdout)
        sys.stderr.write(result.stderr)
    if result.returncode != 0:
        console.print(f"[red]failed with exit code {result.returncode}[/red]")
        sys.exit(result.returncode)
    console.print(f"[dim]({time.perf_counter() - start:.1f}s)[/dim]\n")
    return result


def last_step(output: str) -> tuple[int, float, float]:
    """(step, loss, ms/step) of the last progress line train_gpt.py printed."""
    step, loss, ms = re.findall(r"step\s+(\d+)\s+loss ([\d.]+)\s+(\d+) ms/step", output)[-1]
    return int(step), float(loss), float(ms)


def interleaved(plan: str) -> tuple[list[float], list[float]]:
    """ms/step of PAIRS plain and PAIRS hetero runs, alternating."""
    plain, hetero = [], []
    for i in range(PAIRS):
        pair = f"timing pair {i + 1}/{PAIRS}"
        plain.append(last_step(sh(f"{pair}: plain", [sys.executable, *TIMED], True, TIMING_ENV).stdout)[2])
        hetero.append(last_step(sh(f"{pair}: hetero", HETERO + ["run", "--plan", plan, *TIMED], True,
                                   TIMING_ENV).stdout)[2])
    return plain, hetero


def spread(samples: list[float]) -> str:
    """The median, with the range around it: how noisy the machine was."""
    median = statistics.median(samples)
    low, high = min(samples), max(samples)
    return f"{median:.0f} ms (range {low:.0f}-{high:.0f}, {(high - low) / median:.0%})"


def _viz() -> bool:
    try:
        import matplotlib  # noqa: F401  (hetero[viz]: the memory plot)
    except ImportError:
        return False
    return True


def main() -> None:
    WORK.mkdir(parents=True, exist_ok=True)
    profile, default, plan = str(WORK / "profile.yaml"), str(WORK / "default.yaml"), str(WORK / "plan.yaml")
    sh("measure the machine and every layer", HETERO + ["profile", "-o", profile, "--nvme", str(WORK / "nvme"),
                                                          *SCRIPT])
    sh("solve the default plan", HETERO + ["plan", "--profile", profile, "-o", default, "--reserve", "0.5"])
    sh("solve a plan with the CPU mechanisms forced, to show them", HETERO + [
        "plan", "--profile", profile, "-o", plan, "--emulate", "axdimm", "--tier-activations"])
    plain = sh("plain PyTorch, for comparison", [sys.executable, *SCRIPT])
    as_planned = sh("the same script under the default plan", HETERO + ["run", "--plan", default, *SCRIPT])
    trace = str(WORK / "run.json")
    hetero = sh("the same script under the plan, traced", HETERO + ["run", "--plan", plan, "--trace", trace, *SCRIPT])
    sh("what ran against what the plan predicted", HETERO + ["report", str(WORK / "run.yaml"), "--plan", plan,
                                                              *(["--png", str(WORK / "memory.png")] if _viz() else [])])

    (steps, loss_plain, _), (_, loss_hetero, _) = last_step(plain.stdout), last_step(hetero.stdout)
    times_plain, times_hetero = interleaved(plan)
    table = Table(title="hetero demo: examples/train_gpt.py", title_justify="left", show_header=False)
    table.add_row("steps", str(steps))
    table.add_row("default plan", next((line.removeprefix("hetero: ") for line in as_planned.stderr.splitlines()
                                        if line.startswith("hetero: ") and "dram peak" in line), "(no memory line)"))
    table.add_row("final loss", f"{loss_hetero:.4f} under the forced plan, {last_step(as_planned.stdout)[1]:.4f} "
                                f"under the default plan, {loss_plain:.4f} plain PyTorch")
    ratio = statistics.median(times_hetero) / statistics.median(times_plain)
    load = f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"  # contended cores favour more threads
    table.add_row(f"step time, {PAIRS} interleaved pairs", f"{spread(times_hetero)} under the forced plan, "
                                                            f"{spread(times_plain)} plain: {ratio:.2f}x of medians "
                                                            f"({load})")
    for line in hetero.stderr.splitlines():
        if line.startswith("hetero: ") and not line.startswith("hetero: trace of"):
            table.add_row("forced plan", line.removeprefix("hetero: "))
    console.print(table)


if __name__ == "__main__":
    main()

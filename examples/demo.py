"""`make demo`: profile, plan and run examples/train_gpt.py under hetero, next to a plain PyTorch run, then report
what ran against what the plan predicted (the trace opens in https://ui.perfetto.dev).

Every step is the real command a user types; the closing table compares the two runs.
"""

import re
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
console = Console()


def sh(title: str, argv: list[str]) -> subprocess.CompletedProcess:
    console.print(f"[bold]$ {' '.join(Path(a).name if a == sys.executable else a for a in argv)}[/bold]  # {title}")
    start = time.perf_counter()
    result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
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


def _viz() -> bool:
    try:
        import matplotlib  # noqa: F401  (hetero[viz]: the memory plot)
    except ImportError:
        return False
    return True


def main() -> None:
    WORK.mkdir(parents=True, exist_ok=True)
    profile, plan = str(WORK / "profile.yaml"), str(WORK / "plan.yaml")
    sh("measure the machine and every layer", HETERO + ["profile", "-o", profile, "--nvme", str(WORK / "nvme"),
                                                          *SCRIPT])
    sh("solve the plan", HETERO + ["plan", "--profile", profile, "-o", plan, "--reserve", "0.5"])
    plain = sh("plain PyTorch, for comparison", [sys.executable, *SCRIPT])
    trace = str(WORK / "run.json")
    hetero = sh("the same script under the plan, traced", HETERO + ["run", "--plan", plan, "--trace", trace, *SCRIPT])
    sh("what ran against what the plan predicted", HETERO + ["report", str(WORK / "run.yaml"), "--plan", plan,
                                                              *(["--png", str(WORK / "memory.png")] if _viz() else [])])

    (steps, loss_plain, ms_plain), (_, loss_hetero, ms_hetero) = last_step(plain.stdout), last_step(hetero.stdout)
    table = Table(title="hetero demo: examples/train_gpt.py", title_justify="left", show_header=False)
    table.add_row("steps", str(steps))
    table.add_row("final loss", f"{loss_hetero:.4f} under hetero, {loss_plain:.4f} plain PyTorch")
    table.add_row("step time", f"{ms_hetero:.0f} ms under hetero, {ms_plain:.0f} ms plain "
                               f"({ms_hetero / ms_plain:.2f}x)")
    for line in hetero.stderr.splitlines():
        if line.startswith("hetero: ") and not line.startswith("hetero: trace of"):
            table.add_row("where bytes went", line.removeprefix("hetero: "))
    console.print(table)


if __name__ == "__main__":
    main()

"""`hetero profile [OPTIONS] SCRIPT [ARGS]...`: measure the machine and every layer of a script into a profile."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from hetero.cli.run import ARGS, MASTER_ADDR, MASTER_PORT, NNODES, NODE_RANK, NPROC, RDZV, SCRIPT, SETTINGS, torchrun
from hetero.cli.usage import console, own_process, quantity
from hetero.launch import launcher as launch
from hetero.schema import files
from hetero.schema.profile import Profile
from hetero.units import SIZE, TIME

EXAMPLE = ("Example: hetero profile --steps 5 examples/train_gpt.py --batch-size 8   (then: hetero plan; data "
           "parallel: hetero profile --nproc-per-node 2 train_ddp.py)")


def profile(
    ctx: typer.Context,
    script: str = SCRIPT, args: list[str] = ARGS,
    steps: int = typer.Option(5, help="Optimizer steps to measure."),
    warmup: int | None = typer.Option(None, help="Optimizer steps to run first, unmeasured [default: 2; 6 on a GPU, "
                                                 "whose last 5 time plain training's step]."),
    granularity: str = typer.Option("module", help="module: a layer per module owning parameters; block: per "
                                                   "repeated transformer block."),
    nvme: str = typer.Option(None, "--nvme", metavar="DIR", help="Directory for the disk tier [default: a temp dir]."),
    model: str = typer.Option(None, "--model", metavar="NAME", help="Which model, when the script has several."),
    dram_budget: str = typer.Option(None, "--dram-budget", metavar="SIZE",
                                    help="Profile under this host-memory budget: freed memory is returned from the "
                                         "start, and plain training's own peak is estimated [default: the limit of "
                                         "the memory cgroup hetero runs in, if any]."),
    machine: str = typer.Option(None, "--machine", metavar="FILE",
                                help="Take the machine section of FILE, an earlier profile written on this machine, "
                                     "instead of measuring the machine again (tens of seconds); refused if FILE is of "
                                     "another host, processor, core count, disk filesystem or GPU. By default the "
                                     "last profile that measured this host is taken (kept in ~/.cache/hetero)."),
    measure_machine: bool = typer.Option(False, "--measure-machine",
                                         help="Measure the machine even where an earlier profile on this host did."),
    output: Path = typer.Option(Path("profile.yaml"), "-o", "--output", help="Where to write the profile."),
    as_json: bool = typer.Option(False, "--json", help="Print the profile as JSON on stdout (script output goes "
                                                       "to stderr)."),
    nproc: int = NPROC, nnodes: str = NNODES, node_rank: int = NODE_RANK, master_addr: str = MASTER_ADDR,
    master_port: int = MASTER_PORT, rdzv: str = RDZV,
) -> None:
    """Run SCRIPT for a few steps and write what hetero measured about the machine and each layer (and, with
    --nproc-per-node, the links between its ranks). Without a GPU, 4 more steps time the disk with every layer's
    activations tiered to it, as `hetero run` would; a script that ends sooner gets the disk timed beside a GEMM
    loop instead."""
    from hetero.launch import guard

    ranks = torchrun(nproc, nnodes, node_rank, master_addr, master_port, rdzv)
    # Before torch is imported: the waiter a memory limit needs should hold as little as it can. Called from a Python
    # program (a test, a notebook), forking would turn the caller into the waiter.
    phases = guard.fork(script, nvme) if own_process(ctx) and ranks is None and guard.needed() else None
    from hetero.profile.profiler import ProfileOptions, profile_script, save  # imports torch: only for this command

    options = ProfileOptions(steps=steps, warmup=warmup, granularity=granularity, nvme_dir=nvme, model_name=model,
                             dram_budget_bytes=quantity(SIZE, dram_budget, "--dram-budget"), machine=machine,
                             measure_machine=measure_machine)
    launch.sweep_earlier([nvme])  # what killed runs and profiles left there and in the temp directory
    with contextlib.redirect_stdout(sys.stderr) if as_json else contextlib.nullcontext():
        if ranks is not None:
            options.check()
            code = launch.profile_workers(script, list(args or []), options, output, ranks, stdout_to_stderr=as_json)
            if code or not output.is_file():  # a node other than rank 0's: the profile is on that node
                raise typer.Exit(code)
            result = files.load(output, expect=Profile)
        else:
            with _progress(phases) as report:
                result = profile_script(script, list(args or []), options, report)
            save(result, output, script)
    if as_json:
        print(json.dumps(files.to_data(result), indent=2))
    else:
        _summary(result, output)


@contextlib.contextmanager
def _progress(phases=None):
    """A progress bar per phase on stderr; where stderr is no terminal (a log, `make demo`), a line as each phase
    starts and ends. Each phase also goes to `phases` (hetero.launch.guard), where a memory limit could kill it."""
    err = Console(stderr=True)
    with Progress(TextColumn("{task.description:<16}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err, disable=not err.is_terminal, transient=True) as bar:
        tasks: dict[str, int] = {}
        ended: set[str] = set()

        def report(phase: str, done: int, total: int) -> None:
            if phases is not None:
                phases.reached(phase, done, total)
            if not err.is_terminal and (phase not in tasks or (done == total and phase not in ended)):
                print(f"hetero profile: {phase} {done}/{total}", file=sys.stderr, flush=True)
                ended.update([phase] if done == total else [])
            if phase not in tasks:
                tasks[phase] = bar.add_task(phase, total=total)
            bar.update(tasks[phase], completed=done, total=total)

        yield report


def _summary(profile, output: Path) -> None:
    t = profile.training
    table = Table(title=f"wrote {output}", title_justify="left", show_header=False)
    table.add_row("model", f"{profile.model.num_params:,} parameters, {len(profile.layers)} layers "
                           f"({t.granularity} granularity)")
    untimed = profile.unmeasured.get("layers")  # a compiled model: its layers are listed, not measured
    phases = "" if untimed else (f"forward {TIME.format_short(t.forward_s)}, backward "
                                 f"{TIME.format_short(t.backward_s)}, ")
    table.add_row("step", f"{TIME.format_short(t.iteration_s)} ({phases}optimizer "
                          f"{TIME.format_short(t.optimizer_step_s)})")
    table.add_row("saved activations", "not measured: " + untimed if untimed else
                  SIZE.format_short(sum(layer.saved_bytes for layer in profile.layers)))
    optimizers = ", ".join(f"{o.name} ({o.kind}, {o.model})" for o in t.optimizers) if len(t.optimizers) > 1 \
        else "no torch.optim optimizer (steps counted from backward calls)" if t.optimizer == "none" else t.optimizer
    table.add_row("training", f"{optimizers}, {t.grad_accumulation} backward pass(es) per step, "
                              f"changes gradients before step: {'yes' if t.edits_grads else 'no'}")
    table.add_row("tiers", ", ".join(f"{tier.name} ({tier.kind}, {SIZE.format_short(tier.capacity_bytes)})"
                                     for tier in profile.machine.tiers))
    for tier in profile.machine.tiers:
        if tier.write_beside_compute and tier.write_cpu is not None:
            writes = ", ".join(f"{SIZE.format_short(p.size_bytes)} {TIME.format_short(p.time_s)}"
                               for p in tier.write_beside_compute)
            table.add_row(f"{tier.name} beside compute", f"writes {writes}; its workers slow training "
                                                         f"{_interference(tier.write_cpu)}")
    if profile.memory is not None:
        table.add_row("plain peak", _plain_peak(profile.memory))
    table.add_row("profiling overhead", f"{t.overhead:.1%} of step time")
    if profile.blocks:
        refused = [b for b in profile.blocks if not b.recomputable]
        why = f"; not {', '.join(b.name for b in refused[:3])}{'...' * (len(refused) > 3)}: {refused[0].why}" \
            if refused else ""
        table.add_row("blocks", f"{len(profile.blocks) - len(refused)} of {len(profile.blocks)} repeated blocks can "
                                f"be recomputed in backward{why}")
    console(widest=100).print(table)


def _plain_peak(memory) -> str:
    """The whole process's peak under plain training: where a `--dram-budget` starts to mean something."""
    peak = SIZE.format_short(memory.dram_peak_bytes)
    if memory.dram_peak_estimated:
        return f"{peak} estimated, not measured (profiled under a budget: {memory.profiled_under})"
    returned = "" if memory.dram_peak_returned_bytes is None else \
        f", {SIZE.format_short(memory.dram_peak_returned_bytes)} with freed memory returned"
    return (f"{peak} resident{returned}: a --dram-budget near or below it has hetero plan measure the plan it "
            "chooses in fresh processes before writing it")


def _interference(share: float) -> str:
    """`write_cpu` in words: a share of the slowdown a thread streaming memory causes."""
    return "hardly at all" if share < 0.05 else f"{share:.0%} as much as a thread copying memory does"


def register(app: typer.Typer) -> None:
    app.command(name="profile", epilog=EXAMPLE, context_settings=SETTINGS)(profile)

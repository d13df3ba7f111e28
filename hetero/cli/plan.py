"""`hetero plan`: solve profile.yaml into plan.yaml, then print a short summary (or the plan as JSON)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import typer
from rich.table import Table

from hetero import __version__
from hetero.cli.usage import console, own_process, quantity
from hetero.errors import USAGE, HeteroError
from hetero.launch import trials
from hetero.launch.waiter import TRIAL_WANTED
from hetero.plan.solve import PlanOptions
from hetero.report.retime import retime
from hetero.schema import files
from hetero.schema.plan import ActivationPrediction, LayerGrad, LayerMode, Plan
from hetero.schema.profile import Profile
from hetero.schema.sources import written_profile_path
from hetero.units import SIZE, TIME


def plan(
    ctx: typer.Context,
    profile: Path | None = typer.Option(None, "--profile", help="The profile to plan from [default: profile.yaml; "
                                        "with --from-run, the profile of the run's plan]."),
    output: Path = typer.Option(Path("plan.yaml"), "-o", "--output", help="Where to write the plan."),
    reserve: float = typer.Option(0.5, "--reserve", help="Fraction of gradient bytes allowed to stay on the GPU."),
    gpu_memory: str | None = typer.Option(None, "--gpu-memory", help="GPU memory the plan may use, e.g. 20GiB "
                                                                     "(default: the whole device)."),
    dram_budget: str | None = typer.Option(None, "--dram-budget", help="Host memory the whole process may peak at, "
                                                                       "e.g. 8GiB (default: the limit of the memory "
                                                                       "cgroup the profile ran in, if any)."),
    optimizer_device: str | None = typer.Option(None, "--optimizer-device", metavar="axdimm|host|gpu|none",
                                                help="Where Adam runs (default: a real AXDIMM if the profile has "
                                                     "one, else host; none: the script's own optimizer)."),
    emulate: str | None = typer.Option(None, "--emulate", metavar="axdimm",
                                       help="Place optimizer states on the emulated AXDIMM (host DRAM and worker "
                                            "threads: for tests and demonstrations, never faster or smaller)."),
    tier_activations: bool = typer.Option(False, "--tier-activations",
                                          help="Evict saved activations even where the plan finds it saves no "
                                               "memory the process pays for (host memory without a GPU)."),
    recompute: bool = typer.Option(False, "--recompute",
                                   help="Recompute every block the profile found recomputable in backward, even where "
                                        "no budget needs it (activation checkpointing)."),
    slow_tier: str | None = typer.Option(None, "--slow-tier", metavar="NAME",
                                         help="Tier saved activations are evicted to (a tier name in the profile)."),
    stay_time: str = typer.Option("1ms", "--stay-time", help="Least time an evicted tensor stays in the slow tier."),
    previous: Path | None = typer.Option(None, "--from", metavar="OLD_PLAN",
                                         help="Re-plan, keeping the entries marked `pinned: true` in OLD_PLAN."),
    from_run: Path | None = typer.Option(None, "--from-run", metavar="RUN.yaml",
                                         help="Re-plan with the timings a traced run measured (hetero run --trace), "
                                              "keeping the pinned entries of the plan it ran."),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON (base units) instead of a summary."),
    trial_state: str | None = typer.Option(None, "--trial-state", hidden=True,
                                           help="hetero.launch.waiter's state file: the trials run so far."),
) -> None:
    """Solve a profile into a plan: per-layer GPU modes, gradient offload, optimizer placement, activation
    tiering and routing, with the simulator's predicted iteration. Every decision carries a `# why:` comment."""
    old = files.load(previous, expect=Plan) if previous else None
    if from_run is not None:
        retimed = retime(from_run, profile, output)
        print(f"wrote {retimed.path}: {retimed.ran.source.profile} with the layer timings measured in {from_run}")
        profile, prof, old = retimed.path, retimed.profile, old or retimed.ran
    else:
        profile = profile or Path("profile.yaml")
        prof = files.load(profile, expect=Profile)
    if emulate not in (None, "axdimm"):
        raise HeteroError(f"--emulate {emulate}: only axdimm can be emulated", hint="--emulate axdimm",
                          exit_code=USAGE)
    options = PlanOptions(emulate=emulate == "axdimm", tier_activations=tier_activations, recompute=recompute,
                          profile_path=written_profile_path(profile, output), reserve=reserve,
                          gpu_memory_bytes=quantity(SIZE, gpu_memory, "--gpu-memory"),
                          dram_budget_bytes=quantity(SIZE, dram_budget, "--dram-budget"),
                          optimizer_device=optimizer_device, slow_tier=slow_tier,
                          stay_time_s=quantity(TIME, stay_time, "--stay-time"), previous=old)
    # under a binding DRAM budget, the plan chosen is run in fresh processes first (hetero.launch.trials); under a
    # memory limit, beside a bare interpreter this process becomes (hetero.launch.waiter)
    lean = trials.waiter_argv(prof, options, sys.argv[1:]) if trial_state is None and own_process(ctx) else None
    if lean is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(lean[0], lean)
    try:
        result = trials.plan(prof, options, say=lambda line: print(f"hetero plan: {line}", file=sys.stderr,
                                                                   flush=True), state=trial_state)
    except trials.TrialWanted:
        raise typer.Exit(TRIAL_WANTED) from None
    except BaseException:
        if trial_state is not None:
            trials.end(trial_state)
        raise
    if trial_state is not None:
        trials.end(trial_state)
    for unhonoured in (_unhonoured(optimizer_device, emulate == "axdimm", result),
                       _unapplied("--tier-activations", tier_activations, "activations", result),
                       _unapplied("--recompute", recompute, "recompute", result)):
        if unhonoured:
            print(f"hetero: warning: {unhonoured}", file=sys.stderr)
    header = (f"hetero plan of {profile} ({prof.model.script}), hetero {__version__}.",
              "Edit freely: `hetero check` validates it; entries marked `pinned: true` survive `hetero plan --from`.")
    try:
        files.save(result, output, header)
    except OSError as e:
        raise HeteroError(f"cannot write {output}: {e.strerror}", hint="pass -o with a writable path") from None
    if as_json:
        print(json.dumps(files.to_data(result), indent=2))
        return
    _summary(prof, result, output)


def _unhonoured(optimizer_device: str | None, emulate: bool, out: Plan) -> str | None:
    """What the plan says instead of an optimizer option the user gave (never dropped in silence); None: honoured."""
    asked = "--emulate axdimm" if emulate else f"--optimizer-device {optimizer_device}" if optimizer_device else None
    wanted = "axdimm" if emulate else optimizer_device
    if asked is None or wanted == "none":
        return None
    if out.optimizer is None:
        return f"{asked} not applied: {out.omitted.get('optimizer', 'the plan has no optimizer section')}"
    if out.optimizer.device != wanted:
        return f"{asked} not applied: the plan's optimizer runs on {out.optimizer.device}: {out.optimizer.why}"
    return None


def _unapplied(flag: str, given: bool, section: str, out: Plan) -> str | None:
    """What the plan says instead of a mechanism forced by `flag` that ended up applying to nothing (one line, from
    `omitted`); None: not given, or applied."""
    if not given or getattr(out, section) is not None:
        return None
    budget = f" ({out.budget.why})" if out.budget.why else ""
    return f"{flag} not applied: {out.omitted.get(section, f'the plan has no {section} section{budget}')}"


def _summary(profile: Profile, out: Plan, path: Path) -> None:
    p = out.predicted
    table = Table(title=f"wrote {path}", title_justify="left", show_header=False)
    table.add_row("iteration", f"{TIME.format_short(p.iteration_s)} predicted "
                               f"({TIME.format_short(profile.training.iteration_s)} profiled)")
    for tier, used in p.peak_bytes.items():
        table.add_row(f"peak {tier}", SIZE.format_short(used))
    if out.budget.why:
        table.add_row("budget", out.budget.why)
    if out.allocator:
        start = f"from {SIZE.format_short(out.allocator.from_bytes)} resident on" if out.allocator.from_bytes \
            else "from the start"
        table.add_row("allocator", f"malloc returns freed memory {start}")
    if out.update_in_backward:
        table.add_row("updates", f"the script's {out.update_in_backward.kind} steps each parameter in backward")
    if out.recompute:
        table.add_row("recompute", f"{len(out.recompute.blocks)} blocks recomputed in backward "
                                   f"({', '.join(out.recompute.blocks)})")
    if out.layers:
        modes = {m: sum(x.mode == m for x in out.layers) for m in LayerMode.ALL}
        host = sum(x.grad == LayerGrad.HOST for x in out.layers)
        table.add_row("layers", ", ".join(f"{n} {m}" for m, n in modes.items()) + f"; {host} write gradients to host")
    if out.optimizer:
        spill = f", {SIZE.format_short(out.optimizer.nvme.size_bytes)} on NVMe" if out.optimizer.nvme else ""
        table.add_row("optimizer", f"{out.optimizer.device}{spill}")
    if out.activations:
        moved = sum(e.evict_bytes > 0 for e in out.activations.schedule)
        table.add_row("activations", f"{moved} of {len(out.activations.schedule)} layers evict to "
                                     f"{out.activations.slow}{_reduction(p.activations)}")
    if out.routing:
        table.add_row("routing", f"threshold {SIZE.format_short(out.routing.threshold_bytes)}, shard "
                                 f"{SIZE.format_short(out.routing.shard_bytes)}")
    for section, reason in out.omitted.items():
        table.add_row(section, f"none: {reason}")
    if not (out.layers or out.optimizer or out.activations or out.routing or out.allocator or
            out.update_in_backward or out.recompute):
        table.add_row("plan", "plain training: nothing hetero can do here saves memory or time (`hetero run` "
                              "runs the script as it is)")
    console(widest=120).print(table)


def _reduction(a: ActivationPrediction | None) -> str:
    if a is None:
        return ""
    avg = 1 - a.avg_fast_bytes / a.avg_fast_untiered_bytes if a.avg_fast_untiered_bytes else 0.0
    peak = 1 - a.peak_fast_bytes / a.peak_fast_untiered_bytes if a.peak_fast_untiered_bytes else 0.0
    return f"; fast memory -{avg:.0%} on average, -{peak:.0%} at peak"


def register(app: typer.Typer) -> None:
    app.command(name="plan", epilog="Example: hetero plan --profile profile.yaml -o plan.yaml --gpu-memory 20GiB   "
                                    "|   hetero plan --from-run run.yaml -o plan2.yaml")(plan)

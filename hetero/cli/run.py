"""`hetero run [--plan plan.yaml] [--allow-stale] [--skip-profile-check] [--nproc-per-node N ...] SCRIPT [ARGS]...`:
run a script under a plan, in this process or in one torchrun worker per rank."""

from __future__ import annotations

from pathlib import Path

import typer

from hetero.cli.usage import own_process
from hetero.launch import launcher as launch

# shared with `hetero profile`: the script, its arguments, and torchrun's own options
SCRIPT = typer.Argument(..., metavar="SCRIPT", help="The training script, run as `python SCRIPT ARGS`.")
ARGS = typer.Argument(None, metavar="ARGS", help="Arguments for the script, passed unchanged.")
NPROC = typer.Option(None, "--nproc-per-node", metavar="N", help="Workers on this node, started by torchrun "
                     "(data parallel: wrap the model in DistributedDataParallel); default: run in this process.")
NNODES = typer.Option("1", "--nnodes", metavar="N|MIN:MAX", help="Nodes taking part (with --nproc-per-node).")
NODE_RANK = typer.Option(None, "--node-rank", metavar="I", help="This node's index, with --master-addr.")
MASTER_ADDR = typer.Option(None, "--master-addr", metavar="HOST", help="Node 0's address (static rendezvous).")
MASTER_PORT = typer.Option(None, "--master-port", metavar="PORT", help="Node 0's port (static rendezvous).")
RDZV = typer.Option(None, "--rdzv-endpoint", metavar="HOST:PORT", help="Where the nodes meet (c10d rendezvous).")
# Options for hetero come before SCRIPT; everything after it belongs to the script, `--plan` and `--help` too.
SETTINGS = {"allow_interspersed_args": False, "ignore_unknown_options": True}


def torchrun(nproc: int | None, nnodes: str, node_rank: int | None, master_addr: str | None,
             master_port: int | None, rdzv: str | None) -> launch.Torchrun | None:
    return None if nproc is None else launch.Torchrun(nproc_per_node=nproc, nnodes=nnodes, node_rank=node_rank,
                                                      master_addr=master_addr, master_port=master_port,
                                                      rdzv_endpoint=rdzv)


def run(
    ctx: typer.Context,
    script: str = SCRIPT, args: list[str] = ARGS,
    plan: str = typer.Option(None, "--plan", metavar="FILE", help="The plan to enforce [default: plan.yaml]."),
    allow_stale: bool = typer.Option(False, "--allow-stale", help="Run a plan made for another profile or model."),
    skip_profile_check: bool = typer.Option(False, "--skip-profile-check", help="Run a plan whose profile cannot be "
                                            "found or read, unchecked against it (refused otherwise)."),
    trace: Path = typer.Option(None, "--trace", metavar="FILE.json", help="Record steps into a Chrome/Perfetto "
                               "trace, with a summary (FILE.yaml) for `hetero report`; rank 0 only."),
    trace_steps: int = typer.Option(10, "--trace-steps", metavar="N", help="Steps to record, after the first."),
    nproc: int = NPROC, nnodes: str = NNODES, node_rank: int = NODE_RANK, master_addr: str = MASTER_ADDR,
    master_port: int = MASTER_PORT, rdzv: str = RDZV,
) -> None:
    """Run SCRIPT unmodified, with parameters, optimizer states and activations where the plan puts them, and
    gradient synchronization routed as it says.

    The script's exit code passes through; with several workers, that of the first one to fail."""
    ranks = torchrun(nproc, nnodes, node_rank, master_addr, master_port, rdzv)
    traced = launch.Trace(trace, trace_steps) if trace is not None else None
    code = launch.run(script, list(args or []), plan=plan, allow_stale=allow_stale, torchrun=ranks, trace=traced,
                      skip_profile_check=skip_profile_check, replace_process=own_process(ctx))
    raise typer.Exit(code)


def register(app: typer.Typer) -> None:
    app.command(name="run", epilog="Example: hetero run --plan plan.yaml examples/train_gpt.py --steps 20   "
                                   "(data parallel: hetero run --nproc-per-node 2 train_ddp.py)",
                context_settings=SETTINGS)(run)

"""Synthetic profiles for planner tests and bench/plan.py: a GPU machine with PCIe curves, DHA timings and tiers."""

from __future__ import annotations

import random

from hetero.schema.profile import (
    Axdimm,
    Cpu,
    CurvePoint,
    Gpu,
    Layer,
    Machine,
    ModelInfo,
    NumaNode,
    Peer,
    Profile,
    ScriptOptimizer,
    Tier,
    Training,
)

GiB, MiB, KiB = 2**30, 2**20, 2**10
# Options for the plan every GPU mechanism is in (the default plan of a model that fits is plain training)
OFFLOAD = {"optimizer_device": "host", "tier_activations": True}
SIZES = [4 * KiB, 64 * KiB, MiB, 16 * MiB, 256 * MiB]


def curve(rate: float, latency: float) -> list[CurvePoint]:
    return [CurvePoint(size_bytes=s, time_s=latency + s / rate) for s in SIZES]


def machine(gpu_memory: int = 80 * GiB, peers: int = 0, axdimm: bool = False) -> Machine:
    gpu = Gpu(name="Synthetic GPU", uuid="GPU-0", memory_bytes=gpu_memory, pcie=None, h2d=curve(12e9, 10e-6),
              d2h=curve(12e9, 10e-6), dha_read_bytes_per_s=10e9, dha_write_bytes_per_s=9e9)
    tiers = [Tier(name="dram", kind="dram", capacity_bytes=512 * GiB, read=curve(20e9, 1e-6), write=curve(20e9, 1e-6)),
             Tier(name="nvme0", kind="nvme", capacity_bytes=2048 * GiB, path="/tmp/hetero-nvme",
                  read=curve(3e9, 80e-6), write=curve(2e9, 60e-6))]
    links = [Peer(src=0, dst=d, backend="nccl", transfer=curve(rate, lat))
             for d, (rate, lat) in zip(range(1, peers + 1), [(9e9, 5e-6), (16e9, 20e-6), (12e9, 10e-6)] * peers)]
    return Machine(cpu=Cpu(model="Synthetic CPU", cores=32, dram_bandwidth_bytes_per_s=100e9, adam_params_per_s=2e9),
                   numa=[NumaNode(node=0, memory_bytes=512 * GiB)], gpu=gpu, tiers=tiers,
                   axdimm=Axdimm(backend="emulated", channels=2, channel_capacity_bytes=16 * GiB,
                                 adam_params_per_s=4e8, launch_s=0.0) if axdimm else None, peers=links)


def layers(n: int, rng: random.Random) -> list[Layer]:
    """Layers whose parameters range from small to embedding-sized, so DHA, GFGB and DFGB each win somewhere."""
    out, t = [], 0.2e-3
    specs = []
    for _ in range(n):
        size = int(2 ** rng.uniform(16, 27)) // 4 * 4
        fp = rng.uniform(0.05e-3, 2e-3)
        read = size / 10e9
        specs.append((size, fp, max(fp, read) * rng.uniform(1.0, 1.4), read))
    for i, (size, fp, fp_dha, read) in enumerate(specs):
        t += rng.uniform(0, 0.1e-3) + fp
        out.append(Layer(name=f"layer{i}", type="Linear", num_params=size // 4, params={"weight": size}, fp_s=fp,
                         bp_s=2 * fp, fp_dha_s=fp_dha, bp_dha_s=2 * fp + read * rng.uniform(0.2, 1.0),
                         bp_grad_host_s=2 * fp + size / 9e9 * rng.uniform(0.2, 1.2),
                         saved_bytes=int(2 ** rng.uniform(18, 25)), fp_end_s=t, bp_start_s=0.0))
    t += 0.5e-3
    for layer in reversed(out):
        t += rng.uniform(0, 0.1e-3)
        layer.bp_start_s = t
        t += layer.bp_s
    return out


def gpu_profile(n: int, seed: int = 0, gpu_memory: int = 80 * GiB, peers: int = 0, axdimm: bool = False) -> Profile:
    rng = random.Random(seed)
    ls = layers(n, rng)
    backward_end = max(x.bp_start_s + x.bp_s for x in ls)
    forward_end = ls[-1].fp_end_s if ls else 0.0
    num = sum(x.num_params for x in ls)
    training = Training(optimizer="adamw", grad_accumulation=1, edits_grads=False, warmup_steps=2, steps_measured=5,
                        granularity="module", iteration_s=backward_end + 2e-3, forward_s=forward_end,
                        backward_s=backward_end - forward_end, optimizer_step_s=1e-3, overhead=0.02)
    model = ModelInfo(fingerprint=f"sha256:{seed:064x}", script="synthetic.py", num_params=num, dtype="float32")
    return Profile(model=model, training=training, machine=machine(gpu_memory, peers, axdimm), layers=ls)


def gpt_profile(n_layer: int = 14, n_embd: int = 1024, n_head: int = 16, vocab: int = 8192, batch: int = 1,
                seq: int = 256, implementation: str = "foreach") -> Profile:
    """examples/train_gpt.py's GPT (tied head, AdamW of every parameter, stepped as `implementation`) as `hetero
    profile` lists it: a layer per module owning parameters or saving tensors, in forward order. Parameters from the
    model's shapes; saved storages from its shapes at `batch` x `seq`, by the rule a GPU profile of the script showed
    (8 blocks of width 512, 8 heads, batch 8 x 256: every storage below at those shapes). Times from a compute rate
    and the synthetic machine's DHA read rate, not measured; no memory section (a test adds plain's peaks)."""
    f32, b, t, c = 4, batch, seq, n_embd
    act, att, stats = b * t * c * f32, b * n_head * t * t * f32, b * t * f32  # activation, attention matrix, LN's

    def linear(n_in: int, n_out: int) -> dict[str, int]:
        return {"weight": n_in * n_out * f32, "bias": n_out * f32}

    norm = {"weight": c * f32, "bias": c * f32}
    block = [("ln_1", "LayerNorm", norm, [act, stats, stats]),  # its input, mean and rstd
             ("attn.c_attn", "Linear", linear(c, 3 * c), [act, act, act, act, att, t * t]),  # q, k, v copies; mask
             ("attn.c_proj", "Linear", linear(c, c), [act]),
             ("ln_2", "LayerNorm", norm, [act, stats, stats]),
             ("mlp.c_fc", "Linear", linear(c, 4 * c), [act, 4 * act]),  # GELU's input
             ("mlp.c_proj", "Linear", linear(4 * c, c), [4 * act])]
    specs = [("wte", "Embedding", {"weight": vocab * c * f32}, [b * t * 8]),  # int64 token and position indices
             ("wpe", "Embedding", {"weight": t * c * f32}, [t * 8]),
             *((f"h.{i}.{name}", kind, params, saved) for i in range(n_layer) for name, kind, params, saved in block),
             ("ln_f", "LayerNorm", norm, [act, stats, stats]), ("lm_head", "Linear", {}, [act])]  # wte's weight
    ls, clock = [], 0.0
    for name, kind, params, saved in specs:
        size = sum(params.values())
        fp = 10e-6 + 2 * b * t * size / f32 / 100e12  # a launch, and a GEMM's flops over its weight
        read = 8 * size / 10e9  # a DHA GEMM reads its weight several times over the link
        clock += fp + 5e-6
        ls.append(Layer(name=name, type=kind, num_params=size // f32, params=params, fp_s=fp, bp_s=2 * fp,
                        fp_dha_s=fp + read, bp_dha_s=2 * fp + read, bp_grad_host_s=2 * fp + size / 9e9,
                        saved_bytes=sum(saved), saved_storages_bytes=sorted(saved, reverse=True), fp_end_s=clock,
                        bp_start_s=0.0))
    forward_end = clock
    for layer in reversed(ls):
        clock += 5e-6
        layer.bp_start_s = clock
        clock += layer.bp_s
    num = sum(x.num_params for x in ls)
    adamw = ScriptOptimizer(name="optimizer", kind="adamw", model="GPT", num_params=num,
                            implementation=implementation)
    training = Training(optimizer="adamw", grad_accumulation=1, edits_grads=False, warmup_steps=2, steps_measured=5,
                        granularity="module", iteration_s=clock + 2e-3, forward_s=forward_end,
                        backward_s=clock - forward_end, optimizer_step_s=1e-3, overhead=0.02, optimizers=[adamw],
                        output_bytes=b * t * vocab * f32)  # the logits
    model = ModelInfo(fingerprint=f"sha256:{n_layer:064x}", script="examples/train_gpt.py", num_params=num,
                      dtype="float32")
    return Profile(model=model, training=training, machine=machine(), layers=ls)


def search_case(n: int, seed: int, gpu_memory: int = 80 * GiB):
    """(costs, template) of a small synthetic model, as `hetero plan` hands them to MemFerry's search."""
    from hetero.plan.choices import build
    from hetero.plan.solve import PlanOptions, plan

    profile = gpu_profile(n, seed, gpu_memory)
    return build(profile, plan(profile, PlanOptions(**OFFLOAD)))


def gap_study(instances: int, layers: int, seed: int = 0, forward_only: bool = False,
              budget_fraction: float | None = None) -> dict[str, float]:
    """Worst gaps to the exhaustive optimum (3^L plans; 2^L GFGB/DHA plans with `forward_only`) of the paper's
    method (Alg. 1 + greedy DFGB) and of the planner (plus local search and the budget family), and how often each
    was slower than the optimum. With `budget_fraction`, the GPU budget is that fraction of what the unconstrained
    optimum uses (instances where nothing fits are skipped; the paper's method is then not compared)."""
    from hetero.plan import memferry, memferry_solve

    allowed = memferry.FORWARD_MODES if forward_only else memferry.MODES
    stats = {"paper_worst": 0.0, "paper_worse": 0, "ours_worst": 0.0, "ours_worse": 0, "instances": 0}
    device = 80 * GiB
    for k in range(instances):
        costs, template = search_case(layers, seed + k)
        optimum = memferry_solve.exhaustive(costs, template, device, allowed)
        budget = device if budget_fraction is None else int(budget_fraction * optimum.gpu_bytes)
        optimum = memferry_solve.exhaustive(costs, template, budget, allowed)
        if optimum is None:
            continue
        stats["instances"] += 1
        ours, _ = memferry_solve.solve(costs, template, {}, device, budget, allowed)
        results = [("ours", ours)]
        if budget_fraction is None:
            alg1 = memferry.forward_modes(costs.layers, {}, allowed)
            first = memferry_solve.evaluate(costs, template, alg1.modes)
            dfgb = memferry.choose_dfgb(costs, alg1.modes, first.result, device, {}, allowed)
            results.append(("paper", memferry_solve.evaluate(costs, template, dfgb.modes)))
        for name, e in results:
            gap = e.time_s / optimum.time_s - 1
            stats[f"{name}_worst"] = max(stats[f"{name}_worst"], gap)
            stats[f"{name}_worse"] += gap > 1e-9
    return stats

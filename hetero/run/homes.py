"""Every parameter's optimizer home, built from the plan's `optimizer` section once the parameters have names: a
channel of the (emulated) AXDIMM, host memory (whose master is the parameter's own host bytes where the plan's rule
says so: `OptimizerPlan.shares_master`), or NVMe files updated through staging slots."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hetero.errors import STALE_PLAN, HeteroError
from hetero.kernels.adam import AdamKernel
from hetero.run.devices.axdimm import EmulatedAxdimm
from hetero.run.devices.nvme import NvmeStore
from hetero.run.nvme_states import NvmeStaging, on_host, slot_numel
from hetero.run.states import FP32, AxdimmHome, ChannelDriver, Driver, HostHome
from hetero.schema.plan import NvmeOverflow, OptimizerPlan

ALIGN = 64  # the emulated device aligns every allocation to this


@dataclass(eq=False, slots=True)
class ParamState:
    """One parameter's place in the optimizer."""

    name: str
    home: AxdimmHome | HostHome | None  # None: the states live in NVMe files
    step: int = 0  # updates done (torch's state["step"])
    grads_seen: int = 0  # gradients accumulated since the last step
    launched: bool = False  # this step's update is already running


class Homes:
    """Builds every parameter's home from the plan once the parameters have names; owns devices and drivers."""

    def __init__(self, plan: OptimizerPlan):
        self.plan = plan
        self.where = {s.param: s for s in plan.states}
        self.drivers: list[Driver] = []
        self.device: EmulatedAxdimm | None = None
        self.store: NvmeStore | None = None
        self.staging: NvmeStaging | None = None

    def build(self, named: list[tuple[str, torch.nn.Parameter]]) -> dict[torch.nn.Parameter, ParamState]:
        if missing := [name for name, _ in named if name not in self.where]:
            raise HeteroError(f"the plan places no optimizer state for {len(missing)} parameter(s), e.g. {missing[0]}",
                              hint="re-plan for this model: hetero profile, then hetero plan", exit_code=STALE_PLAN)
        tiers = {name: self.where[name] for name, _ in named}
        spilled = [(n, p) for n, p in named if tiers[n].tier == "nvme"]
        make = self._axdimm(named, tiers, spilled) if self.plan.device == "axdimm" else self._host()
        slots = {p: ParamState(n, None if tiers[n].tier == "nvme" else
                               make(tiers[n].channel, p, self.plan.shares_master(tiers[n].tier))) for n, p in named}
        if spilled:
            self._nvme(spilled, make)
        return slots

    def _axdimm(self, named, tiers, spilled):
        channels = self.plan.channels
        need = [0] * channels
        for name, p in named:
            if tiers[name].channel is not None:
                need[tiers[name].channel] += 4 * _aligned(p.numel() * FP32)
        if spilled:
            largest = 4 * _aligned(max(slot_numel(p) for _, p in spilled) * FP32)
            for slot in range(NvmeOverflow.STAGING_SLOTS):
                need[NvmeOverflow.staging_channel(slot, channels)] += largest
        self.device = EmulatedAxdimm(channel_capacity_bytes=max(need) + ALIGN, channels=channels,
                                     pinned=any(p.is_cuda for _, p in named))  # GPU gradients are copied in
        drivers = [ChannelDriver(self.device, c) for c in range(channels)]
        self.drivers += drivers
        return lambda channel, param, shared=False: AxdimmHome(drivers[channel], param)  # never shared: memcpy only

    def _host(self):
        driver, kernel = Driver("host-adam"), AdamKernel()
        self.drivers.append(driver)
        return lambda channel, param, shared=False: HostHome(driver, kernel, param, shared)

    def _nvme(self, spilled, make) -> None:
        # 1 MiB bounce buffers (one per I/O thread): the staged pieces' aligned middles move straight to and from
        # disk, so larger ones would only hold host memory the plan counts (hetero.plan.footprint)
        self.store = NvmeStore.private(self.plan.nvme.path, "states", "optimizer.nvme.path",
                                       chunk_bytes=NvmeOverflow.STORE_CHUNK_BYTES)
        largest = max((p for _, p in spilled), key=slot_numel)
        n = slot_numel(largest)
        like = torch.zeros(n) if on_host(largest) else largest  # what a slot is made for: its size and device
        # each slot keeps a master of its own: it stages many parameters' pieces in turn
        slots = [make(NvmeOverflow.staging_channel(s, self.plan.channels or 1) if self.device else None, like)
                 for s in range(NvmeOverflow.STAGING_SLOTS)]
        self.staging = NvmeStaging(self.store, slots, n, grads=self.plan.nvme.grads)
        for name, p in spilled:
            self.staging.add(name, p)

    def drain(self) -> None:
        for driver in self.drivers:
            driver.drain()

    def close(self) -> None:
        for driver in self.drivers:
            driver.close()
        for closeable in (self.device, self.store):
            if closeable is not None:
                closeable.close()


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN

"""In the shape of torchtitan / PyTorch's FSDP2 tutorial: fully_shard each block, then the root; AdamW over the
sharded (DTensor) parameters; gloo on CPU.

    torchrun --nproc-per-node 2 fsdp2.py OUT [STEPS]   (rank 0 saves the losses and the full weights to OUT)
"""

import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

try:
    from torch.distributed.fsdp import fully_shard
except ImportError:  # torch 2.4 and 2.5
    from torch.distributed._composable.fsdp import fully_shard

out, steps = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 8
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
mesh = init_device_mesh("cpu", (dist.get_world_size(),))  # FSDP2's default mesh is CUDA's wherever CUDA exists
for layer in (model[0], model[2], model[4]):
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
data = torch.Generator().manual_seed(100 + rank)
losses = []
for step in range(steps):
    loss = F.cross_entropy(model(torch.randn(8, 16, generator=data)), torch.randint(4, (8,), generator=data))
    loss.backward()
    opt.step()
    opt.zero_grad()
    losses.append(loss.item())
state = {n: p.full_tensor().detach() for n, p in model.named_parameters()}
if rank == 0:
    torch.save({"losses": losses, "state": state}, out)
dist.destroy_process_group()

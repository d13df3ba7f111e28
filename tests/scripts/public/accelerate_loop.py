"""A training loop in the shape of accelerate's examples: `Accelerator` on the CPU, the model, optimizer, data and
LR schedule through `accelerator.prepare`, `accelerator.backward`, clipping with `accelerator.clip_grad_norm_`.

    python accelerate_loop.py OUT [STEPS] [fused] [noclip]     (fused: AdamW(fused=True); noclip: no clipping)
"""

import sys

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch import nn

out, steps = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 8
fused, clip = "fused" in sys.argv[3:] or None, "noclip" not in sys.argv[3:]
set_seed(0)
accelerator = Accelerator(cpu=True)
model = nn.Sequential(nn.Embedding(64, 32), nn.Flatten(), nn.Linear(8 * 32, 64), nn.ReLU(), nn.Linear(64, 64))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
data = torch.utils.data.TensorDataset(torch.randint(64, (128, 8)), torch.randint(64, (128,)))
loader = torch.utils.data.DataLoader(data, batch_size=16, shuffle=True)
schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
model, optimizer, loader, schedule = accelerator.prepare(model, optimizer, loader, schedule)
losses, done = [], 0
while done < steps:
    for x, y in loader:
        loss = nn.functional.cross_entropy(model(x), y)
        accelerator.backward(loss)
        if clip:
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        done += 1
        if done == steps:
            break
torch.save({"losses": losses, "state": {k: v.clone() for k, v in model.state_dict().items()}}, out)

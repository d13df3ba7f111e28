"""A model trained through torch.compile (the eager backend: dynamo traces it, no code is generated).

    python compiled.py OUT [STEPS]
"""

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

out, steps = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 10
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
compiled = torch.compile(model, backend="eager")
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
losses = []
for step in range(steps):
    loss = F.cross_entropy(compiled(torch.randn(8, 16)), torch.randint(4, (8,)))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    losses.append(loss.item())
torch.save({"losses": losses, "state": model.state_dict()}, out)

"""Adam with amsgrad=True, which hetero's Adam does not implement: the optimizer stays the script's own.

    python amsgrad.py OUT [STEPS]
"""

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

out, steps = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 10
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, amsgrad=True)
losses = []
for step in range(steps):
    loss = F.cross_entropy(model(torch.randn(8, 16)), torch.randint(4, (8,)))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    losses.append(loss.item())
torch.save({"losses": losses, "state": model.state_dict()}, out)

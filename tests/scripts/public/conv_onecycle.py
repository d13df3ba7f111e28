"""In the shape of a small image classifier as tutorials write one: two Conv2d + ReLU and a Linear head on 3x32x32
images, a DataLoader (with worker processes unless `workers=0` is given), bf16 autocast on the CPU (unless
`fp32` is given), AdamW under OneCycleLR, batch 32. With `scaled`, the logits are scaled by a learnable parameter of
the model's own (as CLIP's logit scale or a ViT's position embedding are): the model is then a layer itself.

    python conv_onecycle.py OUT [STEPS] [fp32] [workers=N] [scaled]
"""

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

out, steps = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 10
fp32 = "fp32" in sys.argv[3:]
workers = next((int(a.split("=")[1]) for a in sys.argv[3:] if a.startswith("workers=")), 2)
scaled = "scaled" in sys.argv[3:]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 3, padding=1)
        self.conv2 = nn.Conv2d(64, 32, 3, padding=1)
        self.fc = nn.Linear(32 * 8 * 8, 10)
        self.scale = nn.Parameter(torch.ones(())) if scaled else None

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = self.fc(torch.flatten(x, 1))
        return x * self.scale if self.scale is not None else x


if __name__ == "__main__":
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(steps * 32, 3, 32, 32, generator=g), torch.randint(10, (steps * 32,), generator=g))
    loader = DataLoader(data, batch_size=32, shuffle=False, num_workers=workers)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, total_steps=steps)
    losses = []
    for x, y in loader:
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not fp32):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    torch.save({"losses": losses, "state": model.state_dict()}, out)

"""Small training scripts written the way users write them, for profiling tests."""

import textwrap
from pathlib import Path

HEADER = """
import argparse, sys
import torch
import torch.nn as nn
import torch.nn.functional as F

class Net(nn.Module):
    # registered out of forward order on purpose: layers must come out in the order forward calls them
    def __init__(self, width=32):
        super().__init__()
        self.head = nn.Linear(width, 4)
        self.norm = nn.LayerNorm(width)
        self.body = nn.Sequential(nn.Linear(16, width), nn.ReLU(), nn.Linear(width, width))

    def forward(self, x):
        return self.head(self.norm(self.body(x)))
"""


def write(tmp_path: Path, body: str, name: str = "train.py") -> str:
    path = tmp_path / name
    path.write_text(HEADER + textwrap.dedent(body))
    return str(path)


LOOP = """
parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--accum", type=int, default=1)
parser.add_argument("--clip", type=float, default=0.0)
args = parser.parse_args()
torch.manual_seed(0)
model = Net()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(args.steps):
    opt.zero_grad()
    for _ in range(args.accum):
        x, y = torch.randn(8, 16), torch.randint(4, (8,))
        F.cross_entropy(model(x), y).backward()
    if args.clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
    opt.step()
print("finished", args.steps)
"""

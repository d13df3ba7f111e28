"""In the shape of pytorch/examples' dcgan: a generator and a discriminator, each with its own Adam.

    python gan.py OUT [STEPS]
"""

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

out, steps = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 10
torch.manual_seed(0)
netG = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16), nn.Tanh())
netD = nn.Sequential(nn.Linear(16, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
optimizerD = torch.optim.Adam(netD.parameters(), lr=2e-4, betas=(0.5, 0.999))
optimizerG = torch.optim.Adam(netG.parameters(), lr=2e-4, betas=(0.5, 0.999))
losses = []
for i in range(steps):
    real = torch.randn(8, 16) * 0.5 + 1
    netD.zero_grad()
    errD_real = F.binary_cross_entropy_with_logits(netD(real), torch.ones(8, 1))
    errD_real.backward()
    fake = netG(torch.randn(8, 8))
    errD_fake = F.binary_cross_entropy_with_logits(netD(fake.detach()), torch.zeros(8, 1))
    errD_fake.backward()
    optimizerD.step()
    netG.zero_grad()
    errG = F.binary_cross_entropy_with_logits(netD(fake), torch.ones(8, 1))
    errG.backward()
    optimizerG.step()
    losses += [(errD_real + errD_fake).item(), errG.item()]
state = {f"G.{k}": v for k, v in netG.state_dict().items()} | {f"D.{k}": v for k, v in netD.state_dict().items()}
torch.save({"losses": losses, "state": state}, out)

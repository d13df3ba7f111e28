"""In the shape of pytorch/examples' dcgan, small: a transposed-convolution generator and a convolution
discriminator with batch norm, each with its own Adam (betas 0.5, 0.999), trained in DCGAN's order (D on real,
D on detached fakes, step D; G through D, step G).

    python gan.py OUT [STEPS] [amsgrad]     (amsgrad: the generator's Adam with amsgrad=True)
"""

import sys

import torch
import torch.nn as nn

out, steps = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 10
amsgrad = sys.argv[3:] == ["amsgrad"]
nz, ngf, ndf, batch = 8, 8, 8, 4
torch.manual_seed(0)


def weights_init(m):
    if "Conv" in type(m).__name__:
        nn.init.normal_(m.weight, 0.0, 0.02)
    elif "BatchNorm" in type(m).__name__:
        nn.init.normal_(m.weight, 1.0, 0.02)
        nn.init.zeros_(m.bias)


netG = nn.Sequential(  # nz x 1 x 1 -> 1 x 8 x 8
    nn.ConvTranspose2d(nz, ngf * 2, 4, 1, 0, bias=False), nn.BatchNorm2d(ngf * 2), nn.ReLU(True),
    nn.ConvTranspose2d(ngf * 2, 1, 4, 2, 1, bias=False), nn.Tanh())
netD = nn.Sequential(  # 1 x 8 x 8 -> 1
    nn.Conv2d(1, ndf, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, inplace=True),
    nn.Conv2d(ndf, ndf * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(ndf * 2), nn.LeakyReLU(0.2, inplace=True),
    nn.Conv2d(ndf * 2, 1, 2, 1, 0, bias=False), nn.Sigmoid(), nn.Flatten(0))
netG.apply(weights_init)
netD.apply(weights_init)
criterion = nn.BCELoss()
optimizerD = torch.optim.Adam(netD.parameters(), lr=2e-4, betas=(0.5, 0.999))
optimizerG = torch.optim.Adam(netG.parameters(), lr=2e-4, betas=(0.5, 0.999), amsgrad=amsgrad)
losses = []
for i in range(steps):
    real = torch.tanh(torch.randn(batch, 1, 8, 8))
    netD.zero_grad()
    label = torch.full((batch,), 1.0)
    errD_real = criterion(netD(real), label)
    errD_real.backward()
    fake = netG(torch.randn(batch, nz, 1, 1))
    label.fill_(0.0)
    errD_fake = criterion(netD(fake.detach()), label)
    errD_fake.backward()
    optimizerD.step()
    netG.zero_grad()
    label.fill_(1.0)
    errG = criterion(netD(fake), label)
    errG.backward()
    optimizerG.step()
    losses += [(errD_real + errD_fake).item(), errG.item()]
state = {f"G.{k}": v for k, v in netG.state_dict().items()} | {f"D.{k}": v for k, v in netD.state_dict().items()}
torch.save({"losses": losses, "state": state}, out)

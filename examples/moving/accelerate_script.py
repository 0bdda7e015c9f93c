"""An Accelerate script, unchanged: `accelerate launch` reads torchrun's variables, so
`multigpu run -n 2 accelerate_script.py` starts it (with multigpu's hang verdicts, restarts and logs)."""
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

accelerator = Accelerator(cpu=not torch.cuda.is_available())
torch.manual_seed(0)
g = torch.Generator().manual_seed(1)
X = torch.randn(1024, 20, generator=g, dtype=torch.float64)
y = (X[:, :4].sum(1) > 0).long()
model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 2)).double()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(TensorDataset(X, y), batch_size=64, shuffle=True)  # 64 per process
model, opt, loader = accelerator.prepare(model, opt, loader)
for epoch in range(3):
    for x, t in loader:
        loss = F.cross_entropy(model(x), t)
        opt.zero_grad()
        accelerator.backward(loss)
        opt.step()
accelerator.print(f"final loss {accelerator.reduce(loss.detach(), 'mean').item():.12f}")
accelerator.print(f"checksum {sum(p.double().sum().item() for p in accelerator.unwrap_model(model).parameters()):.15f}")

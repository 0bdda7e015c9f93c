"""Before: a one-machine nn.DataParallel script (the pattern PyTorch's docs call legacy)."""
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
g = torch.Generator().manual_seed(1)
X = torch.randn(1024, 20, generator=g, dtype=torch.float64)
y = (X[:, :4].sum(1) > 0).long()
device = "cuda" if torch.cuda.is_available() else "cpu"
model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 2)).double()
if torch.cuda.device_count() > 1:
    model = nn.DataParallel(model)
model = model.to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(TensorDataset(X, y), batch_size=64, shuffle=True)
for epoch in range(3):
    for x, t in loader:
        loss = F.cross_entropy(model(x.to(device)), t.to(device))
        opt.zero_grad()
        loss.backward()
        opt.step()
print(f"final loss {loss.item():.12f}")
print(f"checksum {sum(p.double().sum().item() for p in model.parameters()):.15f}")

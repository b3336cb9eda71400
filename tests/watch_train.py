"""A small training script that knows nothing of hookcli: docs/watch.md runs it under
``hookcli watch -- python tests/watch_train.py``. ``--freeze-head`` is a bug a watch finds: the head's
parameters are never given to the optimizer."""

import argparse

import torch
from torch import nn

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--lr", type=float, default=0.1)
parser.add_argument("--freeze-head", action="store_true", help="the bug: the head is not in the optimizer")
args = parser.parse_args()

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
optimizer = torch.optim.SGD(model[0].parameters() if args.freeze_head else model.parameters(), lr=args.lr)
x = torch.randn(64, 4)
y = x.sum(1, keepdim=True)
for _step in range(args.steps):
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
print(f"trained {args.steps} steps, loss {loss.item():.4f}")

"""A small ResNet-style CNN standing in for torchvision's ``resnet18`` / ``resnet34`` in the
product notes' examples (torchvision is not a dependency), and fake CIFAR-shaped data.

Two residual blocks (3x3 convolutions, batch norm, a strided 1x1 shortcut), global average
pooling and a linear classifier: the ops of a ResNet at a size a 2-core test runs in seconds.
"""

from __future__ import annotations

import torch
from torch import nn

IMAGE = 8  # side of the fake images (CIFAR's are 32)


class Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                         if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, num_classes: int = 1000, width: int = 4) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.layer1 = Block(width, width, 1)
        self.layer2 = Block(width, 2 * width, 2)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.layer2(self.layer1(self.stem(x)))), 1))


def resnet18(num_classes: int = 1000) -> ResNet:
    return ResNet(num_classes)


resnet34 = resnet18


def fake_cifar(n: int, *, seed: int = 0, num_classes: int = 10) -> torch.utils.data.TensorDataset:
    """``n`` random (image, label) samples, as ``CIFAR10(...)`` with its transforms yields them."""
    gen = torch.Generator().manual_seed(seed)
    images = torch.randn(n, 3, IMAGE, IMAGE, generator=gen)
    return torch.utils.data.TensorDataset(images, torch.randint(0, num_classes, (n,), generator=gen))

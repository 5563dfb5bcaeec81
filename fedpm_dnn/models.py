"""Models of the paper's Test 2, in plain torch (no torchvision).

SimpleCNN: the CNN of MOON (Li et al. 2021) / CCVR (Luo et al. 2021) used for CIFAR-10 -- the
classifier only: MOON's projection head (two extra fc layers feeding its contrastive loss) is left
out, since the paper trains with cross-entropy alone and is silent on the head.
ResNet18-GN: ResNet-18 with the CIFAR stem (3x3 conv, no max-pool) and every BatchNorm
replaced by GroupNorm (Wu & He 2018), which the paper uses for robustness to heterogeneity.  The paper
does not state the group count: 2 is the default, as in the FL literature (``groups``).  Convolutions are
initialised as the reference ResNets (He et al. 2015; torchvision): kaiming_normal_, fan-out, ReLU gain;
GroupNorm starts as the identity (weight 1, bias 0).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class SimpleCNN(nn.Module):
    def __init__(self, num_classes: int = 10, in_channels: int = 3, image_size: int = 32):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 6, 5)
        self.conv2 = nn.Conv2d(6, 16, 5)
        side = ((image_size - 4) // 2 - 4) // 2
        self.fc1 = nn.Linear(16 * side * side, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, num_classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(x, 1)
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, groups: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.norm1 = nn.GroupNorm(groups, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.norm2 = nn.GroupNorm(groups, cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.GroupNorm(groups, cout))

    def forward(self, x):
        out = F.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet18GN(nn.Module):
    def __init__(self, num_classes: int = 100, in_channels: int = 3, groups: int = 2, width: int = 64):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, width, 3, 1, 1, bias=False)
        self.norm1 = nn.GroupNorm(groups, width)
        layers, cin = [], width
        for i, stride in enumerate((1, 2, 2, 2)):
            cout = width * 2**i
            layers.append(nn.Sequential(BasicBlock(cin, cout, stride, groups), BasicBlock(cout, cout, 1, groups)))
            cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x):
        x = F.relu(self.norm1(self.conv1(x)))
        x = self.layers(x)
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.fc(x)


MODELS = {
    "cnn": lambda num_classes, in_channels, image_size, groups: SimpleCNN(num_classes, in_channels, image_size),
    "resnet18gn": lambda num_classes, in_channels, image_size, groups: ResNet18GN(num_classes, in_channels, groups),
}


def make_model(name: str, num_classes: int, in_channels: int = 3, image_size: int = 32, groups: int = 2):
    """``groups``: ResNet18-GN's GroupNorm group count (must divide 64, the narrowest layer's channels)."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose {' or '.join(MODELS)}")
    return MODELS[name](num_classes, in_channels, image_size, groups)

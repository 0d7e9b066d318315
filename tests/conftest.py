import sys
from pathlib import Path

import torch

# Helpers such as tests/torchrun.py import as top-level modules.
sys.path.insert(0, str(Path(__file__).resolve().parent))
torch.set_num_threads(1)

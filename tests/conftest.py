import sys
from pathlib import Path

import torch

# Helpers such as tests/torchrun.py import as top-level modules.
sys.path.insert(0, str(Path(__file__).resolve().parent))
# Tiny models and masks: intra-op threads only add overhead (10x on a loaded 2-core machine).
torch.set_num_threads(1)

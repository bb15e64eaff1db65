# Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors. Triton reads
# TRITON_INTERPRET when a kernel is defined (at import of kernels.py), so it is set here, before
# any test module is collected. An explicit TRITON_INTERPRET in the environment wins.
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

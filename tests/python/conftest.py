import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

# torch, where installed, loads before ferry: a ferry built against an older system NCCL would
# otherwise bind torch's CUDA libraries to that NCCL (undefined symbols), and the torch tests skip.
try:
    import torch  # noqa: F401
except ImportError:
    pass

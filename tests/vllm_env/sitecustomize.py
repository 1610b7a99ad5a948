"""The test machines' quirk, not the library's: their CPUs report AMX tiles, but vLLM's AMX kernels
die there with SIGILL, so every engine process of the vLLM tests selects the portable kernels.
tests/test_vllm.py puts this folder on PYTHONPATH for the processes it starts."""

import torch

torch.cpu._is_amx_tile_supported = lambda: False

import os
import subprocess
import sys

import pytest
import torch

torch.set_num_threads(1)


def run_cli(*args, timeout=240, env=None):
    """Run ``python -m sinkprof ...`` in a real subprocess; returns CompletedProcess."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "sinkprof", *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env)


@pytest.fixture
def cli():
    return run_cli


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

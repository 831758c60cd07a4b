"""bench/gpu/torch_baseline.py's CPU self-test: the PyTorch baselines' quantizers (fp8_block among
them) against their float64 checks, those checks catching a flipped code and a wrong scale, and the
tiny dense and mixture-of-experts rollouts (experts per tensor and stacked) landing every tensor."""

import pathlib
import subprocess
import sys

import pytest

BASELINE = pathlib.Path(__file__).resolve().parents[2] / "bench" / "gpu" / "torch_baseline.py"


def test_selftest_passes():
    pytest.importorskip("torch")
    r = subprocess.run([sys.executable, str(BASELINE), "--selftest"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "selftest: 0 failed" in r.stdout
    assert "fp8_block (experts, stacked): tiny fused rollout matches every tensor" in r.stdout

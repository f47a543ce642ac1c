"""Shared test setup: make the CPU look like two JAX devices before jax is imported,
so the sharding code paths (seeds split over devices) run in every test session."""

import os
import sys
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# The scripts live at the repository root, not in a package.
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

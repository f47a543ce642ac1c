"""Shared test setup: make the CPU look like two JAX devices before jax is imported,
so the sharding code paths (seeds split over devices) run in every test session."""

import atexit
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import pytest

# XLA's backend (LLVM) at its lowest optimization: the tests' programs are tiny and each is
# compiled once, so that compiling takes about half the time and running them, a fraction of
# it, longer (measured: README, "Tests and layout"). The same HLO; its rounding may differ from
# the default level's, so runs compared bit for bit share these flags.
os.environ.setdefault(
    "XLA_FLAGS", "--xla_force_host_platform_device_count=2 --xla_backend_optimization_level=0"
)
# A session on a GPU (JAX_PLATFORMS=cuda) keeps JAX's CPU too, as parallel_q_learning.py's main()
# does: its progress callback needs it, and its tests call main() after JAX has started.
platforms = os.environ.setdefault("JAX_PLATFORMS", "cpu")
if platforms and "cpu" not in platforms.split(","):  # "": JAX chooses, and starts the CPU too
    os.environ["JAX_PLATFORMS"] = f"{platforms},cpu"
# One compilation cache for the session and the scripts its tests launch: many tests compile
# the same small programs again (a run, then its --load or --resume, two processes of a
# cluster), and compiling is most of the suite's time. Fresh each session.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jax_cache_")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], True)
# Every program, not only those over JAX's default of a second to compile: the small ones add up
# (measured: README, "Tests and layout").
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

# A suite started in the background by a script (`pytest &`) inherits Ctrl-C ignored, and so
# would every script a test starts: the tests that send it would wait for nothing. A handler
# here gives those scripts the default again (an exec resets a handled signal, not an ignored one).
signal.signal(signal.SIGINT, signal.default_int_handler)
# Likewise SIGHUP for a suite started under nohup (the scripts leave an ignored one ignored),
# with a handler that ignores it: the suite still outlives its terminal, as nohup wanted.
if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN:
    signal.signal(signal.SIGHUP, lambda signum, frame: None)

# The scripts live at the repository root, not in a package.
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def pytest_collection_modifyitems(config, items):
    """Tests marked cpu_devices check the layout of seeds over the two CPU devices set up above:
    a session on a GPU (JAX_PLATFORMS=cuda: one device, other batches) skips them."""
    import jax  # here, not above: after the environment it reads is set

    if jax.default_backend() != "cpu":
        skip = pytest.mark.skip(reason=f"needs the two CPU devices; this session runs on "
                                f"{jax.default_backend()}")  # fmt: skip
        for item in items:
            if item.get_closest_marker("cpu_devices"):
                item.add_marker(skip)


GIB = 2**30


@pytest.fixture
def fake_cgroups(tmp_path) -> tuple[Path, Path]:
    """A Slurm job's memory cgroups as /proc/self/cgroup and /sys/fs/cgroup show them, v1 and v2
    side by side -> (that file, that folder). v1: the job limited to 5 GiB, 3 GiB in use of which
    1 GiB is page cache the kernel can drop, its step unlimited; v2: the job 6 GiB, 2 GiB in use,
    its step "max". So the tightest limit is 5 GiB and the least left 3 GiB (2 GiB if the cache
    were counted as used). A limit file under the cpu controller is not a memory limit; a line
    not as documented, and a blank line in memory.stat, are no error."""
    proc = tmp_path / "cgroup"
    lines = ["a line not as documented", "5:cpu,cpuacct:/slurm/job_1"]
    lines += ["4:memory:/slurm/job_1/step_0", "0::/slurm/job_1/step_0"]
    proc.write_text("\n".join(lines))
    v1 = {"memory.usage_in_bytes": 3 * GIB, "memory.stat": f"cache 5\n\ntotal_inactive_file {GIB}"}
    v2 = {"memory.current": 2 * GIB, "memory.stat": "anon 5\ninactive_file 0"}
    folders = {
        "memory/slurm/job_1": {**v1, "memory.limit_in_bytes": 5 * GIB},
        "memory/slurm/job_1/step_0": {**v1, "memory.limit_in_bytes": 9223372036854771712},
        "slurm/job_1": {**v2, "memory.max": 6 * GIB},
        "slurm/job_1/step_0": {**v2, "memory.max": "max"},
        "cpu,cpuacct/slurm/job_1": {**v1, "memory.limit_in_bytes": 1},
    }
    for folder, files in folders.items():
        (tmp_path / folder).mkdir(parents=True)
        for name, text in files.items():
            (tmp_path / folder / name).write_text(f"{text}\n")
    return proc, tmp_path

"""Side-by-side speed: dqn_cartpole.py against the article-style yardstick, same run.

    python benchmarks/dqn_cartpole.py                 # from the repository root
    python benchmarks/dqn_cartpole.py --timesteps 5000 --num-agents 64

Both train 64 agents for 5000 steps at the article's settings (MLP 64-64-64, batch 32,
buffer 512, one update per env step, target copy every 10 steps, gamma 0.9, plain DQN,
our agent keeps its Huber loss and gradient clipping, which cost next to nothing).
The yardstick runs `jit(vmap)` on one device, as written; ours runs `jit(vmap)` with the
seeds sharded over 2 CPU devices (and, for reference, over 1). Compile time is excluded
from both; our timing includes one final greedy evaluation (1 episode, <= 500 steps).
Each side runs in its own process so that XLA_FLAGS can differ. Prints agent-steps/s
and the ratio.
"""

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
YARDSTICK = ROOT / ".." / "shared" / "baselines" / "seed_style_dqn.py"

OURS = """
import dataclasses, sys, time
sys.path.insert(0, {root!r})
import dqn_cartpole as dqn
config = dataclasses.replace(
    dqn.Config(), total_timesteps={steps}, eval_every={steps}, num_seeds={agents},
    hidden_sizes=(64, 64, 64), batch_size=32, buffer_size=512, train_frequency=1,
    learning_starts=0, target_update_interval=10, tau=1.0, gamma=0.9,
    learning_rate=1e-3, anneal_lr=False, double_dqn=False, layer_norm=False,
    eval_episodes=1)
plan = dqn.plan_seeds(config)
_, compile_s, train_s = dqn.train_seeds(config, plan)
print(f"ours steps_per_s={{config.total_timesteps * config.num_seeds / train_s:.0f}} "
      f"devices={{plan.num_devices}} compile_s={{compile_s:.1f}} seconds={{train_s:.3f}}")
"""


def run(cmd: list[str], env_update: dict[str, str]) -> tuple[float, str]:
    env = {**os.environ, **env_update}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, check=True)
    line = [ln for ln in out.stdout.splitlines() if "steps_per_s=" in ln][-1]
    return float(re.search(r"steps_per_s=(\d+)", line).group(1)), line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timesteps", type=int, default=5_000)
    parser.add_argument("--num-agents", type=int, default=64)
    args = parser.parse_args()

    yard, yard_line = run(
        [
            sys.executable,
            str(YARDSTICK),
            "--timesteps",
            str(args.timesteps),
            "--num-agents",
            str(args.num_agents),
        ],
        {"XLA_FLAGS": ""},
    )
    print(yard_line)
    code = OURS.format(root=str(ROOT), steps=args.timesteps, agents=args.num_agents)
    results = {}
    for devices in (2, 1):
        flags = {"XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
        results[devices], line = run([sys.executable, "-c", code], flags)
        print(line)
    print(
        f"speed-up vs yardstick: {results[2] / yard:.2f}x sharded over 2 CPU devices, "
        f"{results[1] / yard:.2f}x on 1 device"
    )


if __name__ == "__main__":
    main()

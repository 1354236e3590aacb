"""Sluice's benchmark suite: `make bench` (bench.run_all) runs every scenario
against the real processes and writes bench/RESULTS.md and bench/plots/.
Each scenario also runs alone: `python -m bench.<scenario> --seed N`."""

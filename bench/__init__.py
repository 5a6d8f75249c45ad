"""iop's benchmarks: `python -m bench` runs them (bench/run.py); bench/experiments/ holds one-off measurements."""

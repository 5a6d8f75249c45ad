"""One-off measurements behind a decision (each cited in docs/): run one with `python -m bench.experiments.NAME`."""

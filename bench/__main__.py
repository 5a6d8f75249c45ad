"""`python -m bench`: the benchmark run of bench/run.py."""

from __future__ import annotations

from bench.run import main

raise SystemExit(main())

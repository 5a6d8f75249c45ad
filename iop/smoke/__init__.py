"""`iop smoke`: start a deployment (or reach a running one), fill a pool past its capacity, check and report."""

from iop.smoke.runner import Options, run

__all__ = ["Options", "run"]

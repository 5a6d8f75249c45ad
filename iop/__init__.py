"""iop: one OpenAI-compatible endpoint over a handful of machines."""

__version__ = "0.1.0"

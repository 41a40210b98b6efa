"""gpufault: fault injection and fault forensics for GPU inference stacks."""

__version__ = "0.1.0"

"""Poros: QLoRA with blockwise residency, bitwise equal to resident QLoRA."""

__version__ = "0.1.0"

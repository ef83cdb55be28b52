"""hsx: hidden-state extraction for EAGLE-3 draft training."""

__version__ = "0.1.0"

"""plait: train one PyTorch model on many devices.

The public API lives here and nowhere else; see README.md for a tour.
"""

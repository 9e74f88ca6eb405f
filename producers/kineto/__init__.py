"""Kineto (PyTorch profiler) traces replayed as wire-v1 events."""

"""Skew-balanced distributed training that produces a deployable artifact directory."""

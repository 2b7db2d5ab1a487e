"""Offline datasets: loaders return plain records (dicts)."""

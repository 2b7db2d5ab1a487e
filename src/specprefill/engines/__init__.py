"""Engines: each one only captures q/k and feeds kept tokens + positions; the algorithm lives in core."""

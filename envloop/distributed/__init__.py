"""Batched containers and Ray helpers."""

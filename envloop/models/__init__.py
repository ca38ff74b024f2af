"""Policies: generation backends."""

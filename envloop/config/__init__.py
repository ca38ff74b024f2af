"""Configuration: one way to declare and validate every config (pydantic; see validation), the
errors it raises, environment config fields, and import paths (``module:Name``).

A foundation layer: the library packages and the application both use it; it imports
neither.
"""

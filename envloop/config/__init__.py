"""Configuration: the errors every config check raises, the dataclass schema the run config is
built with, environment config fields, and import paths (``module:Name``).

A foundation layer: the library packages and the application both use it; it imports
neither.
"""

"""Adapters that let other training libraries use envloop's rollouts. Each lives in its own
module behind an optional extra and is imported by name (``envloop.integrations.trl``
needs ``pip install 'envloop[trl]'``); this package imports none of them."""

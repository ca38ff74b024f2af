"""The rollout engine."""

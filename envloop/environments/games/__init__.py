"""Game environments: multi-turn puzzles whose whole state lives in per-sample metadata."""

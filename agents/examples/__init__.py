"""The example agents: arithmetic, tic-tac-toe, research (one module each)."""

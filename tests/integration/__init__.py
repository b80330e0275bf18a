"""Flow, resume, evaluation and ART end-to-end tests."""

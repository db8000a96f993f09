"""One thin entry point per DVC stage, run as `python -m stages.<name>`."""

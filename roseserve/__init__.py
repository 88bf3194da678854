"""The ``roseserve`` command: starts roseserve's processes."""

"""Shared by every roseserve process: wire protocol, config, errors, logging.

Imports none of the process packages.
"""

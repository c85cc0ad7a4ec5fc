"""The operator CLI: `logitpool serve | status | scale | generate | bench` (entry point `cluster.cli:main`)."""

from cluster.cli.main import main

__all__ = ["main"]

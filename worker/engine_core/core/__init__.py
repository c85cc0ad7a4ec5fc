"""The core side: the child process that builds the engine and runs AsyncEngine's loop (no Ray)."""

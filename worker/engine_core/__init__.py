"""The served engine loop in its own process: `client` (EngineProcess, in the replica) and
`core` (the child that runs AsyncEngine's loop), speaking `protocol`'s messages over one Pipe."""

from worker.engine_core.client.engine_process import EngineProcess

__all__ = ["EngineProcess"]

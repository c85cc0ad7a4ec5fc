"""The client side: EngineProcess, what a served replica holds in place of an in-process engine."""

"""The gRPC wing: the LogitPool service adapter and pb <-> worker conversion."""

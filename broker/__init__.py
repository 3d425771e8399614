"""Broker: the hub service on top of agentstream.wire: trajectory and group assembly, the write-ahead-logged state,
batches, stats and the dashboard."""

"""The encoder fleet as a receiver sees it: discovery, channels, health, load, placement, failover and the shard calls."""

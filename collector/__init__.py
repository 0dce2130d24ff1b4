"""The contract and its transport: event models, topics, encoding, the Bus and its backends, traces."""

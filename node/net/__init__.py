"""Networking of one node: the p2pd session, identities, swarm access, rate limits and the RPC server."""

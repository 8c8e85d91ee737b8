"""Swarm membership: the daemon, its adverts, view, gossip and the schedule coordinator."""

"""Local swarms the product starts: ``skippipe up`` and ``skippipe swarm local`` (and the tests, through them)."""

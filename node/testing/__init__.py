"""Harnesses for tests only (the product never imports them): network-namespace swarms. The local swarms the
command line starts live in :mod:`node.launch`, fault injection in :mod:`node.train.faults`."""

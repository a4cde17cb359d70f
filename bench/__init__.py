"""``make bench``: what the gRPC hop between the bridge and the engine server costs.

See ``bench/__main__.py`` for the harness and README's "Benchmarks" for the table.
"""

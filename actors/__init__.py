"""Ray actors over the `specdec` core: draft worker, tensor-parallel target shards, coordinator.

Imports go one way: deployments -> actors -> specdec.
"""

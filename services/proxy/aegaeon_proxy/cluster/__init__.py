"""The proxy's backend: placement over the store (one node or many), dispatch to instances."""

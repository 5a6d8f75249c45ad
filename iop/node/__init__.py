"""The node: an identity that connects to the edge and serves the catalog of resources under it."""

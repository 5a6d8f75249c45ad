"""What the edge, the nodes and the clients agree on: the `/status` schema and the refresh diff."""

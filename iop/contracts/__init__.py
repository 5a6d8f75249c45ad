"""What the edge, the nodes and the clients agree on: the `/status` schema, the refresh diff, the `/usage` query."""

"""Stored responses: what `store: true` keeps, and the state the edge expands from it before dispatch."""

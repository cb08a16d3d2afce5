"""Tool servers the agents call (the search agent's retrieval server) and their clients."""

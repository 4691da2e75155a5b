"""API keys as tenants: their shares, priorities and limits, without a server and on real ones."""

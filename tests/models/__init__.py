"""Several models from one server: their configuration, routing, loads, failures and stops."""

"""Running the server: stopping and reloading with real signals, hostile clients, soak and fuzz, nginx, Redis
outages and the command line."""

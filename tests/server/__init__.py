"""The server as clients see it: real gunicorn processes (and the hub's parts on their own), the SDKs and a
browser."""

"""Resumable streams: the SSE wire format, each response's event log (readable again by id while it is kept), and
its copy in Redis, from which any worker or host resumes it."""

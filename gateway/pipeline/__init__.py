"""One request's path, shared by both fronts: admission, body, alias and key, cache and coalescing,
route, dispatch with retries and hedging, respond, record; each step its own module."""

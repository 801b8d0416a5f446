"""One request's path, shared by both fronts: admission (every endpoint's: infer, generate, the
streams, metadata, statistics), body, alias and key, cache and coalescing, forward, respond, record;
each step its own module. The dispatcher it forwards through is the engine under `Gateway`
(gateway/fleet/dispatch.py)."""

"""Which servers there are and which one a request goes to: routing across regions, balancing,
health and outlier ejection, discovery, config reload, cold starts, canary traffic."""

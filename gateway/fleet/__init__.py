"""Which servers there are and which one a request goes to: routing across regions, balancing,
health and outlier ejection, discovery, cold starts, canary traffic, and the dispatcher that sends
a request with retries and hedging."""

"""The engine that decides and acts for one llama-server: the prepare path (wiring builds it), what
each slot holds, the decision, the gates, parks and the RAM tier, which slot a request takes, and a
server's life around the requests."""

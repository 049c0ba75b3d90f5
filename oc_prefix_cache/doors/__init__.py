"""How requests come in: the plugin's daemon, the proxy (and its router front), the streaming relay
and upstream client, and the one guard every route of every door goes through."""

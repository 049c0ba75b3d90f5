"""What talks to llama-server and what it is: the slot and completion client, the server's identity
(model files, build, KV flags) and its model family, and the processes that run it."""

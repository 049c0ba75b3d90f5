"""What a request says, read without any I/O: its head (tools and system text up to the volatile
part), its messages and the conversation they continue, and the Anthropic and Responses bodies as
the chat completions llama-server would see (import-linter keeps this folder pure)."""

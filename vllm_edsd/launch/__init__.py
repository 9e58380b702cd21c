"""Starting the target: vLLM's ``LLM`` engines and speculative-decoding counters (``engine``),
the OpenAI-compatible server as a process (``server``), and the target as a transformers model
(``transformers_target``), shared by regeneration, features, EDSelect, training, the demo, the
bench and the tests. Nothing here imports the plugin: vLLM loads it by its entry point."""

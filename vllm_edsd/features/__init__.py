"""The verifier's hidden states for training (``edsd features``, ``cli``): the target's forward
captured at chosen layers through transformers (``hidden_states``) or vLLM's extraction
(``vllm_extraction``, ``host_connector``), for the training samples (``samples``), stored in
shards named by their content (``shards``)."""

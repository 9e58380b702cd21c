"""The prompts the engine tests send, with their per-request draft-length caps and reply lengths."""

# Eight prompts of different lengths; token ids of the toy tokenizer's vocabulary.
PROMPTS = [[1, *range(10 + 7 * i, 10 + 7 * i + 3 + i)] for i in range(8)]
# Six prompts, each one of two 257-token prefixes (two blocks of vLLM's CPU default of 128
# tokens, and one token more) and its own few tokens: once a prefix's first request has run,
# the prefix cache holds it for the others (tests/engine/test_serving_prefix_caching.py).
SHARED_PREFIXES = [[1, *range(20, 276)], [1, *range(500, 244, -1)]]
SHARED_PREFIX_PROMPTS = [SHARED_PREFIXES[which] + list(range(280 + 10 * i, 285 + 11 * i))
                         for i, which in enumerate([0, 1, 0, 1, 1, 0])]
# Their draft-length caps one request at a time, in order: the first prefix first computed by a
# request that opted out of drafting, the second by a drafting one; then uncapped, capped and
# opted-out requests on both (an opted-out request's blocks serve only opted-out requests).
SHARED_PREFIX_CAPS = [0, None, None, 2, 0, 1]
SHARED_PREFIX_TOKENS = 24

# Per-request draft-length caps (extra_args["num_speculative_tokens"]) for the eight prompts of
# ``trained``, with K=4: none, one, all, the engine's K (no cap) and between.
CAPS = [0, 1, 4, None, 0, 1, 4, 2]
# Tokens per reply on the fitted target (the ``trained`` fixture's prompts).
FITTED_TOKENS = 40

"""What the plugin serves beyond the paper: a request's draft length (``draft_length``:
per-request caps and the entropy-adaptive rule) and prompt lookup beside the drafter
(``lookup``). They import nothing of the plugin's core: its ``hooks`` hand them vLLM's runner
and proposer, and its ``request`` their keys of the speculative config."""

"""Drafter checkpoint formats and what the project reads of a target: the weight files
(``files``), a target's config.json (``target``), the walker of the declarative config schemas
(``schema``; the drafters' schemas are their methods', ``vllm_edsd.methods``), what a layout is
(``layouts``) and the vocabulary maps (``vocab``)."""

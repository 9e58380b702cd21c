"""``edsd pipeline`` (``cli``): a drafter made from one TOML description. The description's
schema, one dataclass per table, and its loading (``config``); the ShareGPT prompts of the
``data`` stage (``conversations``); the stages and their runner (``stages``)."""

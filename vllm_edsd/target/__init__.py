"""The target model as EDSD reads it: its hidden states at chosen layers (``hidden_states``) and
EDSelect, which picks the two aux layers (``selection``; ``edsd select``: ``select_cli``)."""
